"""The parts of a step and the prefix cache as units: no model, no Ray, no native call.

The planner is fed slots in the states a group's thread leaves them in; the prefix cache
runs over a recording stand-in for the context, so what it asks llama.cpp to do (and in which
order) is what is asserted.
"""

from __future__ import annotations

import pytest

from engine.cache.prefix import PrefixCache, Reuse, keep_prefix
from engine.config import SpeculativeConfig
from engine.params import SamplingParams
from engine.planner import draft_requests, plan_start, plan_step
from engine.slots import Slot, SlotState
from engine.types import Request

PARAMS = SamplingParams(temperature=0, max_tokens=64)


def busy(slot_id: int, seq: int, prompt: list[int], *, done: int = 0, state=SlotState.PROMPT,
         cached: list[int] | None = None, last: int = -1) -> Slot:
    s = Slot(id=slot_id, group=0, seq_id=seq, cache_tokens=list(cached if cached is not None else prompt[:done]))
    s.req = Request(f"r{slot_id}", list(prompt), PARAMS, n_predict=64, slot_id=slot_id)
    s.state, s.n_prompt_done, s.last_token = state, done, last
    return s


# ---- the planner ------------------------------------------------------------------------------


def test_the_plan_puts_decode_rows_first_then_prompt_chunks_in_arrival_order_laid_out_by_sequence():
    gen = busy(0, 2, [1, 2, 3], done=3, state=SlotState.GENERATING, last=9)
    a = busy(1, 0, list(range(10, 20)))  # became busy first: its chunk is taken first
    b = busy(2, 1, list(range(30, 40)))
    plan = plan_step([a, gen, b], {}, capacity=8, n_ubatch=512, unified=False)
    # the generating row takes one token; a gets 7, b nothing: capacity 8
    assert [(e.seq_id, e.pos0, e.tokens, e.out) for e in plan.entries] == [
        (0, 0, list(range(10, 17)), False), (2, 3, [9], True)]
    assert plan.n_tokens == 8 and plan.n_logits == 1
    (row,) = plan.rows
    assert row.slot is gen and row.batch_idx == 7 and row.logits_idx == 0


def test_a_last_prompt_chunk_gets_a_row_and_a_waiting_slot_gets_nothing():
    a = busy(0, 0, [1, 2, 3, 4], done=2)
    w = busy(1, 1, [1, 2, 3, 5])
    w.leader, w.n_from_leader = a, 3
    plan = plan_step([a, w], {}, capacity=16, n_ubatch=512, unified=False)
    assert [(e.slot.id, e.tokens, e.out) for e in plan.entries] == [(0, [3, 4], True)]
    assert [(r.slot.id, r.batch_idx, r.logits_idx) for r in plan.rows] == [(0, 1, 0)]


def test_a_waiting_slot_is_copied_in_the_step_that_completes_its_leaders_prefix():
    a = busy(0, 0, list(range(10)), done=4, cached=[0, 1, 2, 3])
    w = busy(1, 1, list(range(8)) + [99])
    w.leader, w.n_from_leader = a, 8
    a.waiters.append(w)
    # capacity 3: a reaches 7 tokens, short of the 8 the waiter takes -> no copy yet
    early = plan_step([a, w], {}, capacity=3, n_ubatch=512, unified=False)
    assert early.copies == []
    plan = plan_step([a, w], {}, capacity=16, n_ubatch=512, unified=False)
    ((c,),) = [plan.copies]
    assert (c.src, c.dst, c.n, c.row) == (a, w, 8, None)
    c.done = True  # the runner made it
    plan.advance()
    assert a.n_prompt_done == 10 and w.leader is None and a.waiters == []
    assert (w.n_prompt_done, w.n_reused) == (8, 8)


def test_an_n_gt_1_follower_samples_on_its_leaders_row_unless_its_copy_failed():
    for made in (True, False):
        a = busy(0, 0, [1, 2, 3, 4], done=2, cached=[1, 2])
        f = busy(1, 1, [1, 2, 3, 4])
        f.leader, f.n_from_leader, f.on_leader_row = a, 4, True
        a.waiters.append(f)
        plan = plan_step([a, f], {}, capacity=16, n_ubatch=512, unified=False)
        lead, follow = plan.rows
        assert follow.slot is f and (follow.batch_idx, follow.logits_idx) == (lead.batch_idx, lead.logits_idx)
        assert plan.n_logits == 1  # the follower reads the leader's logits, nothing more
        plan.copies[0].done = made
        plan.advance()
        # made: the whole prompt is the follower's, counted as evaluated, not reused
        assert [r.slot for r in plan.rows] == ([a, f] if made else [a])
        assert (f.n_prompt_done, f.n_reused, f.on_leader_row) == ((4, 0, False) if made else (0, 0, False))


def test_a_start_reuses_a_prefix_and_a_follower_reuses_nothing_of_its_own():
    pc = cache()
    mine = Slot(id=0, group=0, seq_id=0, cache_tokens=SYSTEM[:10])
    other = Slot(id=1, group=0, seq_id=1, cache_tokens=SYSTEM + [7])
    r = Request("x", SYSTEM + [9], PARAMS, 64, slot_id=0)
    st = plan_start(mine, r, [mine, other], pc, cache_prompt=True)
    assert (st.reuse.source, st.reuse.shared, st.leader) == (other, 100, None)
    # prompt caching off: nothing of the KV is reused
    assert plan_start(mine, r, [mine, other], pc, cache_prompt=False).reuse == Reuse()
    assert plan_start(mine, r, [mine, other], pc, True, leader=other).reuse == Reuse()
    mine.state = SlotState.GENERATING
    with pytest.raises(AssertionError, match="busy"):
        plan_start(mine, r, [mine, other], pc, cache_prompt=True)


def test_drafts_take_rows_after_their_slot_and_count_in_the_logits():
    g0 = busy(0, 0, [1, 2], done=2, state=SlotState.GENERATING, last=5)
    g1 = busy(1, 1, [1, 2], done=2, state=SlotState.GENERATING, last=6)
    plan = plan_step([g0, g1], {0: [7, 8, 9]}, capacity=16, n_ubatch=512, unified=False)
    assert [(e.tokens, e.draft) for e in plan.entries] == [([5, 7, 8, 9], [7, 8, 9]), ([6], [])]
    assert [(r.batch_idx, r.logits_idx, r.draft) for r in plan.rows] == [(0, 0, [7, 8, 9]), (4, 4, [])]
    assert plan.n_logits == 5
    # a draft is cut to what the batch holds
    small = plan_step([g0, g1], {0: [7, 8, 9]}, capacity=3, n_ubatch=512, unified=False)
    assert small.entries[0].draft == [7]


def test_draft_requests_stop_before_n_predict_and_past_max_rows():
    spec = SpeculativeConfig(type="ngram", n_max=8, n_min=2, max_rows=1)
    g = busy(0, 0, [1, 2], done=2, state=SlotState.GENERATING, last=5)
    g.n_generated = 60  # 64 - 60 - 1 = 3 left to draft
    ((s, hist, limit),) = draft_requests([g], spec, n_ctx_slot=1024)
    assert s is g and hist == [1, 2, 5] and limit == 3
    assert draft_requests([g, busy(1, 1, [1], done=1, state=SlotState.GENERATING)], spec, 1024) == []


# ---- the prefix cache over a recording context -------------------------------------------------


class FakeContext:
    """Sequences as llama.cpp keeps them (positions per sequence), every call recorded."""

    def __init__(self, pos_min: dict[int, int] | None = None) -> None:
        self.calls: list[tuple] = []
        self.pos_min = pos_min or {}

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        self.calls.append(("rm", seq, p0, p1))
        return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.calls.append(("cp", src, dst, p0, p1))

    def seq_pos_min(self, seq: int) -> int:
        return self.pos_min.get(seq, 0)


SYSTEM = list(range(100, 200))  # a 100-token shared prefix


def cache(ctx=None, **kw) -> PrefixCache:
    return PrefixCache(ctx or FakeContext(), **{"n_swa": 0, "unified": False, "shareable": True, "share_min": 32, **kw})


def test_a_prefix_held_by_another_slot_beats_the_slots_own_shorter_one():
    pc = cache()
    mine = Slot(id=0, group=0, seq_id=0, cache_tokens=SYSTEM[:10] + [1])
    other = Slot(id=1, group=0, seq_id=1, cache_tokens=SYSTEM + [7, 8])
    prompt = SYSTEM + [9, 9]
    r = pc.plan(mine, prompt, [mine, other], own=True, share=True)
    assert (r.own, r.source, r.shared, r.ready) == (10, other, 100, True)
    # without sharing (a recurrent model, or the config): only its own
    assert cache(shareable=False).plan(mine, prompt, [mine, other], own=True, share=True).source is None
    # a gain under share_min is not worth a copy
    near = Slot(id=2, group=0, seq_id=2, cache_tokens=SYSTEM[:30])
    assert pc.plan(mine, prompt, [mine, near], own=True, share=True).source is None


def test_the_last_prompt_token_is_never_reused():
    pc = cache()
    mine = Slot(id=0, group=0, seq_id=0)
    other = Slot(id=1, group=0, seq_id=1, cache_tokens=list(SYSTEM))
    r = pc.plan(mine, list(SYSTEM), [mine, other], own=True, share=True)
    assert r.shared == len(SYSTEM) - 1


def test_a_prompt_on_its_way_in_another_slot_is_waited_for():
    pc = cache()
    mine = Slot(id=0, group=0, seq_id=0)
    computing = busy(1, 1, SYSTEM + [5], done=20)
    r = pc.plan(mine, SYSTEM + [6], [mine, computing], own=True, share=True)
    assert (r.source, r.shared, r.ready) == (computing, 100, False)
    mine.start(Request("w", SYSTEM + [6], PARAMS, 64), sampler=None, n_reused=0, leader=computing, n_from_leader=r.shared)
    assert mine.waiting and not pc.due(mine)
    computing.cache_tokens.extend(SYSTEM[20:])  # the decode got there
    assert pc.due(mine)
    # a follower (of n > 1 or of a prefix) is nobody's source
    third = Slot(id=2, group=0, seq_id=2)
    assert pc.plan(third, SYSTEM + [7], [mine, third], own=True, share=True).source is None


def test_a_window_that_dropped_the_prefix_positions_shares_nothing():
    # sliding window of 64: the source's oldest position must be <= 100 - 64 for 100 tokens
    far = cache(FakeContext({1: 60}), n_swa=64)
    ok = cache(FakeContext({1: 36}), n_swa=64)
    mine = Slot(id=0, group=0, seq_id=0)
    other = Slot(id=1, group=0, seq_id=1, cache_tokens=SYSTEM + list(range(10)))
    assert far.plan(mine, SYSTEM + [1], [mine, other], own=True, share=True).source is None
    assert ok.plan(mine, SYSTEM + [1], [mine, other], own=True, share=True).source is other
    assert keep_prefix(FakeContext({0: 60}), 64, 0, list(SYSTEM), 100) == 0


def test_a_copy_between_streams_takes_the_whole_sequence_then_cuts_it():
    ctx = FakeContext()
    pc = cache(ctx)
    src = Slot(id=1, group=0, seq_id=1, cache_tokens=SYSTEM + [7, 8])
    dst = Slot(id=0, group=0, seq_id=0, cache_tokens=[1, 2, 3])
    assert pc.reuse_from(src, dst, 100)
    # never a range across streams: llama.cpp aborts the process on one
    assert ctx.calls == [("rm", 0, 0, -1), ("cp", 1, 0, -1, -1), ("rm", 0, 100, -1)]
    assert dst.cache_tokens == SYSTEM and pc.n_copied == 100
    assert pc.copying_from(src) and not pc.copying_from(dst)
    # the destination goes idle before the next decode made the copy: it forgets its KV
    pc.settle(dst)
    assert dst.cache_tokens == [] and not pc.copying_from(src)
    pc.copy(src, dst, 100)
    pc.applied()
    pc.settle(dst)
    assert dst.cache_tokens == SYSTEM


def test_a_copy_in_one_stream_shares_a_range_of_cells():
    ctx = FakeContext()
    pc = cache(ctx, unified=True)
    src = Slot(id=1, group=0, seq_id=1, cache_tokens=SYSTEM + [7])
    dst = Slot(id=0, group=0, seq_id=0)
    assert pc.copy(src, dst, 100)
    assert ctx.calls == [("rm", 0, 0, -1), ("cp", 1, 0, 0, 100)] and not pc.pending


# ---- the slot's lifecycle ----------------------------------------------------------------------


def test_finish_resets_a_slot_and_unlinks_who_waited_for_it():
    leader = Slot(id=0, group=0, seq_id=0)
    leader.start(Request("a", SYSTEM + [1], PARAMS, 64), sampler=None, n_reused=0)
    w = Slot(id=1, group=0, seq_id=1)
    w.start(Request("b", SYSTEM + [2], PARAMS, 64), sampler=None, n_reused=4, leader=leader, n_from_leader=100)
    assert leader.waiters == [w] and w.state is SlotState.PROMPT
    leader.finish()
    assert leader.state is SlotState.IDLE and leader.req is None and leader.waiters == []
    # the waiter evaluates its prompt itself, from what it kept of its own
    assert w.leader is None and w.n_from_leader == 0 and w.n_prompt_done == 4
    w.got_prefix(0)
    with pytest.raises(AssertionError, match="busy"):
        w.start(Request("c", [1], PARAMS, 64), sampler=None, n_reused=0)
