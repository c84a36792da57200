"""Shared prefixes computed once per group: a new prompt takes the KV of a prefix that another
slot holds or is computing, copied on the device, and the output does not change."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import SamplingParams
from engine.types import FinishReason

SYSTEM = [(7 * i + 3) % 4000 + 10 for i in range(300)]  # a 300-token shared system prompt
P = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompt(i: int) -> list[int]:
    return SYSTEM + [50 + i, 60 + i, 70 + 2 * i, 80, 90 + i]


def evaluated(e) -> int:
    """Tokens every group decoded so far (prompt and generated)."""
    return sum(p.batch_tokens for p in e.profiles())


def burst(e, n: int) -> list:
    """``n`` requests submitted together (one drain of the group's inbox): their finals."""
    reqs = [e.make_request(prompt(i), P) for i in range(n)]
    qs = [e.outputs.register(r.id) for r in reqs]
    for r in reqs:
        e.submit(r)
    finals, texts = [], []
    for q in qs:
        parts = []
        while True:
            o = q.get(timeout=120)
            parts.append(o.text)
            if o.finish_reason is not None:
                finals.append(o)
                texts.append("".join(parts))
                break
    return list(zip(texts, finals, strict=True))


@pytest.mark.parametrize("groups", [1, 2])
def test_a_burst_sharing_a_system_prompt_evaluates_it_once_per_group(make_engine, groups):
    n = 8
    shared = make_engine(n_parallel=n, pipeline_groups=groups, n_ctx=8192)
    alone = make_engine(n_parallel=n, pipeline_groups=groups, n_ctx=8192, share_prefix=False)
    got, ref = burst(shared, n), burst(alone, n)
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert all(f.finish_reason == FinishReason.LENGTH for _, f in got)
    gen = n * P.max_tokens
    # without sharing every slot evaluates the whole prompt; with it, each group once
    assert evaluated(alone) >= n * len(prompt(0)) + gen - n
    assert evaluated(shared) <= groups * len(SYSTEM) + n * (len(prompt(0)) - len(SYSTEM)) + gen
    cached = sorted(f.cached_tokens for _, f in got)
    assert cached[:groups] == [0] * groups and all(c == len(SYSTEM) for c in cached[groups:]), cached
    assert sum(g.prefix.n_copied for g in shared.groups) == (n - groups) * len(SYSTEM)


def test_a_prefix_held_by_an_idle_slot_is_copied_and_greedy_output_does_not_change(make_engine):
    on = make_engine(n_parallel=4, n_ctx=4096)
    off = make_engine(n_parallel=4, n_ctx=4096, share_prefix=False)
    for e in (on, off):
        run(e, e.make_request(prompt(0), P))
    outs = {}
    for name, e in (("on", on), ("off", off)):
        r = e.make_request(prompt(1), P)
        r.id_slot = 2  # another slot than the one holding the system prompt
        outs[name] = run(e, r)
    (text_on, fin_on), (text_off, fin_off) = outs["on"], outs["off"]
    assert text_on == text_off
    assert fin_on.cached_tokens == len(SYSTEM) and fin_off.cached_tokens == 0


def test_waiting_slots_go_on_when_the_slot_computing_their_prefix_is_cancelled(make_engine):
    e = make_engine(n_parallel=4, n_ctx=4096, n_batch=64)  # the prefix takes 5 steps
    ref = make_engine(n_parallel=4, n_ctx=4096, share_prefix=False)
    reqs = [e.make_request(prompt(i), P) for i in range(3)]
    qs = [e.outputs.register(r.id) for r in reqs]
    for r in reqs:
        e.submit(r)
    e.cancel(reqs[0].id)
    texts = []
    for q in qs[1:]:
        parts = []
        while (o := q.get(timeout=120)).finish_reason is None:
            parts.append(o.text)
        assert o.finish_reason == FinishReason.LENGTH, o
        texts.append("".join(parts) + o.text)
    assert texts == [ref.generate(prompt(i), P).text for i in (1, 2)]
    assert all(v.state == "idle" for v in e.slot_views())


def test_sharing_in_one_kv_stream_copies_a_range(make_engine):
    on = make_engine(n_parallel=4, n_ctx=4096, kv_unified=True)
    off = make_engine(n_parallel=4, n_ctx=4096, kv_unified=True, share_prefix=False)
    got, ref = burst(on, 4), burst(off, 4)
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert on.groups[0].prefix.n_copied == 3 * len(SYSTEM)


def test_a_short_common_prefix_is_not_shared(make_engine):
    e = make_engine(n_parallel=4, n_ctx=4096, share_min_tokens=400)
    burst(e, 4)
    assert e.groups[0].prefix.n_copied == 0


def test_a_request_without_cache_prompt_shares_nothing(make_engine):
    e = make_engine(n_parallel=4, n_ctx=4096)
    e.generate(prompt(0), P)
    _, fin = run(e, e.make_request(prompt(1), P, cache_prompt=False))
    assert fin.cached_tokens == 0 and e.groups[0].prefix.n_copied == 0


def test_sharing_under_concurrent_load_leaks_nothing(make_engine):
    """Staggered arrivals, more requests than slots, shared and unshared prompts mixed."""
    e = make_engine(n_parallel=4, pipeline_groups=2, n_ctx=4096)
    ref = make_engine(n_parallel=4, pipeline_groups=2, n_ctx=4096, share_prefix=False)
    prompts = [prompt(i) if i % 3 else [11 + i, 12, 13, 14] for i in range(12)]
    barrier = threading.Barrier(4)

    def run(i: int) -> str:
        if i < 4:
            barrier.wait()
        return e.generate(prompts[i], P).text

    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(run, range(12)))
    assert got == [ref.generate(p, P).text for p in prompts]
    assert all(v.state == "idle" for v in e.slot_views()) and e.scheduler.counts() == (0, 0)
    assert not any(g.prefix.pending for g in e.groups)


def run(e, r):
    """Submit one request and wait for it: (its text, its final output)."""
    q = e.outputs.register(r.id)
    e.submit(r)
    parts = []
    while (o := q.get(timeout=120)).finish_reason is None:
        parts.append(o.text)
    return "".join(parts) + o.text, o
