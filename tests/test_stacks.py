"""The in-process stack sampler charges CPU time to the stacks that used it, and none to idle threads."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

from bench.host_profile import summarise
from observability.stacks import StackSampler, read_collapsed, start_from_env

BUSY_CPU_S = 0.6


def busy_leaf(used: list[float]) -> None:
    """Spins until it has had BUSY_CPU_S of CPU, however long a loaded box takes to give it."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < BUSY_CPU_S:
        sum(range(2000))
    used.append(time.thread_time() - t0)


def test_a_busy_thread_gets_the_cpu_time_and_an_idle_one_none(tmp_path: Path) -> None:
    stop = threading.Event()
    used: list[float] = []
    s = StackSampler(tmp_path / "p.txt", interval=0.002, flush_s=0.2).start()
    busy = threading.Thread(target=busy_leaf, args=(used,), name="busy")
    idle = threading.Thread(target=stop.wait, name="idle")
    t0 = time.thread_time()
    busy.start(), idle.start()
    busy.join()
    stop.set()
    idle.join()
    s.stop()
    assert time.thread_time() - t0 < 0.1  # this thread slept
    stacks = read_collapsed(tmp_path / "p.txt")
    per_thread: Counter[str] = Counter()
    for k, us in stacks.items():
        per_thread[k.split(";")[0]] += us
    assert per_thread["busy"] > used[0] * 1e6 / 2  # most of the CPU it had (a thread's clock, sampled)
    assert per_thread["idle"] < 1_000  # it only woke to end
    assert any(k.startswith("busy;") and "busy_leaf (test_stacks.py:" in k.split(";")[-1] for k in stacks)
    lines = summarise(Counter(), stacks, n_tokens=1000)
    assert lines[0].startswith("sampled: ") and any("| busy |" in line for line in lines)


def test_the_sampler_is_off_unless_asked_for(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PGROUPS_STACKS", raising=False)
    assert start_from_env("x") is None
    monkeypatch.setenv("PGROUPS_STACKS", str(tmp_path / "d"))
    s = start_from_env("x")
    try:
        assert s is not None and s.out.parent == tmp_path / "d"
    finally:
        s.stop()
    assert s.out.exists()
