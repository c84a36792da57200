"""A sampling profiler of a process's own Python threads, weighted by their CPU time.

For a developer measuring the host path (``PGROUPS_STACKS=<dir>`` in the environment of the
Ray nodes): every replica that calls ``start_from_env`` samples each thread's stack every
``interval`` seconds and charges it the CPU time the thread used since the last sample (its
``pthread_getcpuclockid`` clock), so idle threads weigh nothing; it rewrites
``<dir>/<role>-<pid>.txt`` every few seconds in the collapsed format flame-graph tools read
(``frame;frame;frame microseconds``). Where an outside profiler cannot read the
interpreter (py-spy 0.4.3 finds no Python version in some builds), this runs inside the
process. It costs the sampled process about 3 % of a core at the default interval; off unless
asked for.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ENV = "PGROUPS_STACKS"
FLUSH_S = 5.0  # how often a sampler rewrites its file


class StackSampler:
    def __init__(self, out: Path, interval: float = 0.005, flush_s: float = FLUSH_S) -> None:
        self.out, self.interval, self.flush_s = out, interval, flush_s
        self.weights: Counter[tuple] = Counter()  # (thread name, frames...) -> CPU seconds
        self._last: dict[int, float] = {}  # thread ident -> its CPU seconds at the last sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()

    def sample(self) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        last, self._last = self._last, {}  # threads that ended drop out
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            try:
                used = time.clock_gettime(time.pthread_getcpuclockid(ident))
            except OSError:  # the thread ended
                continue
            before = last.get(ident)
            self._last[ident] = used
            if before is None or used <= before:
                continue
            stack = []
            f = frame
            while f is not None:  # formatted only when written: a sample stays cheap
                stack.append((f.f_code, f.f_lineno))
                f = f.f_back
            stack.append(names.get(ident, str(ident)))
            self.weights[tuple(stack)] += used - before

    def collapsed(self) -> dict[str, int]:
        """Each stack as ``thread;outermost;...;innermost`` -> CPU microseconds."""
        out: Counter[str] = Counter()
        for key, seconds in list(self.weights.items()):
            frames = [f"{code.co_name} ({Path(code.co_filename).name}:{line})" for code, line in reversed(key[:-1])]
            out[";".join([key[-1], *frames])] += int(seconds * 1e6)
        return dict(out)

    def flush(self) -> None:
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text("".join(f"{k} {v}\n" for k, v in sorted(self.collapsed().items(), key=lambda kv: -kv[1])))
        tmp.replace(self.out)

    def _run(self) -> None:
        next_flush = time.monotonic() + self.flush_s
        while not self._stop.wait(self.interval):
            self.sample()
            if time.monotonic() >= next_flush:
                self.flush()
                next_flush = time.monotonic() + self.flush_s


def start_from_env(role: str) -> StackSampler | None:
    """Sample this process's threads into ``$PGROUPS_STACKS/<role>-<pid>.txt``, if that is set."""
    where = os.environ.get(ENV)
    if not where:
        return None
    Path(where).mkdir(parents=True, exist_ok=True)
    return StackSampler(Path(where) / f"{role}-{os.getpid()}.txt").start()


def read_collapsed(path: Path) -> Counter[str]:
    """A sampler's file: each stack -> CPU microseconds."""
    out: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, us = line.rpartition(" ")
        out[stack] += int(us)
    return out
