"""The batch layout against llama.cpp itself: the ubatch count the profiler reports is the
number of graphs llama.cpp computes for the step, and ordering by sequence id cuts it."""

from __future__ import annotations

import ctypes
import random

import llama_cpp
import pytest

from engine.batching import Entry, count_ubatches, order_entries
from engine.native.batch import Batch
from engine.native.context import Context
from engine.native.library import _load
from engine.native.model import Model


@pytest.fixture(scope="module")
def model(model_path: str):
    m = Model(model_path)
    yield m
    m.close()


class GraphCounter:
    """Counts graph computations: the scheduler asks about layer 0's norm once per graph."""

    def __init__(self) -> None:
        base = _load("ggml-base")
        base.ggml_get_name.restype = ctypes.c_char_p
        base.ggml_get_name.argtypes = [ctypes.c_void_p]
        self.n = 0

        def cb(t, ask, _user):  # noqa: ANN001
            if ask and base.ggml_get_name(t) == b"attn_norm-0":
                self.n += 1
            return False

        self.cb = llama_cpp.ggml_backend_sched_eval_callback(cb)


@pytest.mark.parametrize("unified", [False, True], ids=["per-seq-kv", "unified-kv"])
def test_ubatch_count_matches_llama_cpp(model, unified):
    counter = GraphCounter()
    ctx = Context(model, n_ctx=8 * 256, n_seq_max=8, n_batch=512, n_ubatch=512, n_threads=1,
                  kv_unified=unified, cb_eval=counter.cb)
    batch = Batch(512)
    rng = random.Random(3)
    pos = [0] * 8
    try:
        for step in range(12):
            seqs = rng.sample(range(8), rng.randint(1, 8))
            entries = [Entry(None, s, pos[s], [5] * rng.choice([1, 1, 1, 7]), True) for s in seqs]
            if step % 2:
                entries = order_entries(entries)
            batch.clear()
            for e in entries:
                batch.add(e.tokens, e.pos0, e.seq_id, e.out)
                pos[e.seq_id] += len(e.tokens)
            before = counter.n
            ctx.decode(batch)
            ctx.synchronize()
            assert counter.n - before == count_ubatches(entries, ctx.n_ubatch, unified), [
                (e.seq_id, len(e.tokens)) for e in entries
            ]
    finally:
        ctx.close()


def test_sorted_rows_take_one_ubatch_per_run():
    entries = [Entry(None, s, 0, [1], True) for s in (5, 1, 4, 0, 3, 2)]
    assert count_ubatches(entries, 512, unified=False) > 1
    assert count_ubatches(order_entries(entries), 512, unified=False) == 1


def _entries(spec: list[tuple[int, int]]) -> list:
    return [Entry(None, seq, 0, [0] * n, True) for seq, n in spec]


def test_count_ubatches_follows_llama_cpp_split_rules():
    decode = _entries([(3, 1), (0, 1), (2, 1), (1, 1)])  # the order slots became busy
    assert count_ubatches(decode, 512, unified=False) == 3  # [3], [0] ... cut at every descent
    assert count_ubatches(order_entries(decode), 512, unified=False) == 1
    gap = order_entries(_entries([(0, 1), (1, 1), (3, 1), (4, 1)]))
    assert count_ubatches(gap, 512, unified=False) == 2  # a free sequence id splits the run
    assert count_ubatches(gap, 512, unified=True) == 1
    # a prompt chunk beside decode rows: one token rides with them, the rest is its own ubatch
    mixed = order_entries(_entries([(0, 1), (1, 40), (2, 1)]))
    assert count_ubatches(mixed, 512, unified=False) == 2
    assert count_ubatches(_entries([(0, 600)]), 512, unified=True) == 2
