"""Fair under mixed load: pinned requests wait apart, short prompts pass long ones (with aging,
so a long one is never starved), and a long prompt goes where it stalls the fewest streams.

The scheduler, the planner and the budget are driven directly (no model, no timing); one
engine test on the synthetic model checks the pinned bound and a short request passing a long
prompt end to end.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from engine import QueueFullError, SamplingParams
from engine.budget import PrefillBudget
from engine.planner import n_short, plan_step
from engine.scheduler import Scheduler, choose_slot
from engine.slots import SlotState, SlotView
from engine.types import Request
from tests.test_step_parts import busy

PARAMS = SamplingParams(temperature=0, max_tokens=8)


# ---- the scheduler: two kinds of waiting ------------------------------------------------------


class Bed:
    """A scheduler over ``n`` slots in ``groups`` groups, with what it started recorded."""

    def __init__(self, n: int = 4, groups: int = 2, **kw: object) -> None:
        per = n // groups
        self.views = [SlotView(i, i // per, i % per, "idle", 0, None, np.zeros(0, np.int32)) for i in range(n)]
        self.started: list[Request] = []
        self._base = itertools.count(1_000, 1_000)  # prompts that share nothing
        kw = {"max_queued": 8, "similarity": 0.1, **kw}
        self.s = Scheduler(self.views, dispatch=lambda g, r: self.started.append(r),
                           cancel_running=lambda g, rid: None, sink=lambda outs: None, **kw)

    def submit(self, rid: str, n_tokens: int = 4, id_slot: int = -1, tokens: list[int] | None = None) -> Request:
        base = next(self._base)
        r = Request(rid, tokens or list(range(base, base + n_tokens)), PARAMS, n_predict=8, id_slot=id_slot)
        self.s.submit(r)
        return r

    def finish(self, slot: int, cached: list[int] | None = None) -> None:
        v = self.views[slot]
        self.s.publish(SlotView(v.id, v.group, v.seq_id, "idle", len(cached or ()), None,
                                np.asarray(cached or [], np.int32)), True)

    def state(self, slot: int, state: str) -> None:
        v = self.views[slot]
        self.s.publish(SlotView(v.id, v.group, v.seq_id, state, 0, "x", np.zeros(0, np.int32)), False)

    def last(self) -> tuple[str, int]:
        r = self.started[-1]
        return r.id, r.slot_id


def test_pinned_requests_are_bounded_apart_and_an_unpinned_one_takes_an_idle_slot_at_once():
    b = Bed(4, 2, max_queued=1, max_queued_per_slot=2)
    b.submit("p0", id_slot=0)
    assert b.last() == ("p0", 0)
    b.submit("a", id_slot=0)
    b.submit("b", id_slot=0)  # both wait for slot 0
    with pytest.raises(QueueFullError, match="slot 0 is busy and 2 requests wait for it"):
        b.submit("c", id_slot=0)
    assert b.s.counts() == (1, 2)
    # pinned requests wait ahead of it, yet a request any slot can take starts now
    b.submit("u")
    assert b.last()[0] == "u" and b.last()[1] != 0
    b.submit("u2")
    b.submit("u3")
    assert {r.slot_id for r in b.started} == {0, 1, 2, 3}
    # every slot busy: the queue for any slot holds max_queued (1) of its own, whatever is pinned
    b.submit("w1")
    with pytest.raises(QueueFullError, match="all 4 slots are busy and 1 requests wait"):
        b.submit("w2")
    assert b.s.counts() == (4, 3)
    # slot 0 frees: the oldest request pinned to it takes it, not the one waiting for any slot
    b.finish(0)
    assert b.last() == ("a", 0)
    b.finish(1)
    assert b.last() == ("w1", 1)
    assert b.s.cancel("b") and b.s.counts() == (4, 0)
    b.finish(0)
    assert b.last() == ("w1", 1)  # nothing was waiting for slot 0 any more
    b.submit("p1", id_slot=0)
    assert b.last() == ("p1", 0)


def test_a_pinned_request_for_an_idle_slot_starts_even_when_others_wait_for_any_slot():
    b = Bed(2, 1, max_queued=4)
    b.submit("x")
    fam = Request("fam", list(range(10)), PARAMS, n_predict=8)
    fam.followers.append(Request("fam#1", list(range(10)), PARAMS, n_predict=8))
    b.s.submit(fam)  # waits for both slots of the group
    b.submit("pin", id_slot=1 - b.started[0].slot_id)
    assert b.last()[0] == "pin"


def test_waiting_requests_start_shortest_first_and_a_passed_one_starts_after_aging_passes():
    b = Bed(1, 1, aging=2)
    b.submit("blocker")
    b.submit("long1", 500)
    b.submit("long2", 500)
    b.submit("short1", 5)
    b.finish(0)
    assert b.last()[0] == "short1"  # both long ones passed once
    b.submit("short2", 5)
    b.finish(0)
    assert b.last()[0] == "short2"  # twice: they are due
    b.submit("short3", 5)
    b.finish(0)
    assert b.last()[0] == "long1"  # the oldest passed one first, before the shorter one
    b.finish(0)
    assert b.last()[0] == "long2"
    b.finish(0)
    assert b.last()[0] == "short3"


def test_a_conversation_another_group_holds_waits_for_that_group_not_aged_into_this_one():
    # two groups of one slot; group 1's prompt cache holds conversation A's history
    b = Bed(2, 2, aging=2, share_prefix=True, share_min=4)
    hist = list(range(70_000, 70_300))  # shares nothing with the other prompts
    b.s.kept(1, [("", np.asarray(hist, np.int32))])
    b.submit("x0")
    b.submit("x1")
    assert {r.slot_id for r in b.started} == {0, 1}
    b.submit("a", tokens=[*hist, 1, 2])
    for i in range(4):  # group 0's slot frees again and again: newer requests take it
        b.submit(f"n{i}", 5)
        b.finish(0)
        assert b.last() == (f"n{i}", 0)
    b.finish(1)  # its own group's slot: A goes there, its history reused
    assert b.last() == ("a", 1)
    # alone in the queue, A's next turn leaves group 0's free slot idle for a while (each event
    # counts), then takes it rather than wait on
    b.s.kept(1, [("", np.asarray(hist + [1, 2, 3], np.int32))])
    b.submit("a2", tokens=[*hist, 1, 2, 3, 4])  # both slots busy: it waits
    b.finish(0)  # group 0's slot frees; group 1's runs A
    assert b.last() == ("a", 1) and b.s.counts() == (1, 1)
    b.s.submit(Request("pin", [9], PARAMS, n_predict=8, id_slot=1))  # an event
    b.s.cancel("pin")
    assert b.last() == ("a", 1)
    b.s.submit(Request("pin2", [9], PARAMS, n_predict=8, id_slot=1))
    assert b.last() == ("a2", 0) and b.s.n_deferred_away == 1


def test_a_prompt_mostly_in_an_idle_slots_cache_counts_as_short_and_fifo_among_equals():
    b = Bed(1, 1, aging=8)
    cached = list(range(5000, 5600))
    b.submit("blocker")
    b.submit("new", 50)
    b.submit("equal1", 20)
    b.submit("equal2", 20)
    b.submit("cached", tokens=[*cached, 7])
    b.finish(0, cached)
    assert b.last()[0] == "cached"  # one token to evaluate after the slot's prefix
    b.finish(0)
    assert b.last()[0] == "equal1"  # the older of two equals
    b.finish(0)
    assert b.last()[0] == "equal2"
    b.finish(0)
    assert b.last()[0] == "new"


def test_without_aging_the_queue_is_first_come_first_served():
    b = Bed(1, 1, aging=0)
    b.submit("blocker")
    b.submit("long", 500)
    b.submit("short", 5)
    b.finish(0)
    assert b.last()[0] == "long"


# ---- across groups: a long prompt where it stalls the fewest streams --------------------------


def test_a_long_prompt_goes_to_the_group_with_fewest_streams_decoding():
    idle = [SlotView(1, 0, 1, "idle", 0, None, np.zeros(0, np.int32)),
            SlotView(3, 1, 1, "idle", 0, None, np.zeros(0, np.int32))]
    busy_ = {0: {0}, 1: {0}}  # one busy slot in each group ...
    decoding = {0: 1}  # ... group 0's decodes, group 1's evaluates its prompt
    last_used = {1: 0.0, 3: 5.0}  # least recently used alone would pick slot 1
    long_prompt = np.arange(1000, 1300, dtype=np.int32)  # 300 tokens, long above 256
    short = np.arange(2000, 2010, dtype=np.int32)
    assert choose_slot(idle, long_prompt, last_used, 0.1, busy_, decoding=decoding, long_prompt=256).id == 3
    assert choose_slot(idle, short, last_used, 0.1, busy_, decoding=decoding, long_prompt=256).id == 1
    # a cached prefix that saves the work still wins: 10 tokens left to evaluate on slot 1
    cached = [SlotView(1, 0, 1, "idle", 290, None, long_prompt[:290]), idle[1]]
    assert choose_slot(cached, long_prompt, last_used, 0.1, busy_, decoding=decoding, long_prompt=256).id == 1
    # balance still comes first: a group busier by two loses even with no stream decoding
    assert choose_slot(idle, long_prompt, last_used, 0.1, {0: {0}, 1: {0, 2, 3}}, decoding=decoding,
                       long_prompt=256).id == 1


def test_the_scheduler_counts_the_streams_decoding_from_the_published_states():
    b = Bed(4, 2, long_prompt=256)
    b.submit("g0")
    b.submit("g1")
    assert {r.slot_id // 2 for r in b.started} == {0, 1}
    decoding = b.started[0].slot_id
    b.state(decoding, "generating")  # its group published it decoding; the other still prompts
    b.submit("long", 300)
    assert b.last()[1] // 2 != decoding // 2


# ---- the planner: who claims a step's prompt tokens -------------------------------------------


def test_prompts_claim_a_steps_tokens_shortest_first_fifo_among_equals():
    long = busy(0, 0, list(range(10, 410)))  # 400 tokens: long above 256
    s1 = busy(1, 1, list(range(500, 520)))
    s2 = busy(2, 2, list(range(600, 620)))
    plan = plan_step([long, s1, s2], {}, 64, 512, False, None, 256, aging=8)
    assert {e.slot.id: len(e.tokens) for e in plan.entries} == {0: 24, 1: 20, 2: 20}
    # without aging, in the order the slots became busy
    plan = plan_step([long, s1, s2], {}, 64, 512, False, None, 256, aging=0)
    assert {e.slot.id: len(e.tokens) for e in plan.entries} == {0: 64}
    # equals: the slot that became busy first claims first
    plan = plan_step([s2, s1], {}, 30, 512, False, None, 256, aging=8)
    assert {e.slot.id: len(e.tokens) for e in plan.entries} == {2: 20, 1: 10}
    # what is left counts: a long prompt near its end claims before a fresh short one
    long.n_prompt_done = long.n_reused = 395  # 5 left (reused: short to evaluate too)
    plan = plan_step([s1, long], {}, 10, 512, False, None, 256, aging=8)
    assert {e.slot.id: len(e.tokens) for e in plan.entries} == {0: 5, 1: 5}


def run_steps(long, steps: int, capacity: int, aging: int, short_len: int, beside_short: int | None = None) -> list[int]:
    """A group's steps with a new short prompt arriving at each; the long prompt's tokens per step."""
    got = []
    active = [long]
    for i in range(steps):
        active.append(busy(10 + i, 1 + i, list(range(10_000 + 100 * i, 10_000 + 100 * i + short_len))))
        before = long.n_prompt_done
        plan = plan_step(active, {}, capacity, 512, False, None, 256, beside_short, aging)
        plan.advance()
        got.append(long.n_prompt_done - before)
        active = [s for s in active if s is long or s.n_prompt_done < len(s.req.prompt_tokens)]
    return got


def test_a_long_prompt_held_back_by_short_ones_claims_first_after_aging_steps():
    long = busy(0, 0, list(range(10, 1010)))
    # shorts fill every step; aging 3: the long prompt claims first each 4th step
    assert run_steps(long, 12, capacity=40, aging=3, short_len=40) == [0, 0, 0, 40] * 3
    assert long.n_passed == 0  # it has just had its due
    # no aging: first come, first served, and the long prompt came first
    long2 = busy(0, 0, list(range(10, 1010)))
    assert run_steps(long2, 4, capacity=40, aging=0, short_len=40) == [40] * 4


def test_beside_a_short_prompt_long_ones_take_a_small_chunk_until_held_back_aging_steps():
    long = busy(0, 0, list(range(10, 3010)))
    # a short prompt each step: the long one takes 128 of the 492 left; held back 4 steps in a
    # row, it claims the whole step first (the short one waits that step), then 128 again
    assert run_steps(long, 10, capacity=512, aging=4, short_len=20, beside_short=128) == (
        [128] * 4 + [512] + [128] * 4 + [512])
    # off: the long prompt takes what the short one leaves
    long2 = busy(0, 0, list(range(10, 2010)))
    assert run_steps(long2, 3, capacity=512, aging=4, short_len=20) == [492] * 3
    # the cut is over all long prompts of the step, shortest left first
    a = busy(0, 0, list(range(10, 1010)), done=600)
    b = busy(1, 1, list(range(2000, 3000)))
    s = busy(2, 2, list(range(5000, 5020)))
    plan = plan_step([b, a, s], {}, 512, 512, False, None, 256, 128, 4)
    assert {e.slot.id: len(e.tokens) for e in plan.entries} == {2: 20, 0: 128}


def test_the_cut_follows_short_prompts_in_any_group():
    b = PrefillBudget(2, gap_factor=3.0, chunk_min=8, beside_short=128)
    assert b.long_cut(0, 0) is None
    assert b.long_cut(0, 1) == 128
    b.short[1] = 1  # the other group started one
    assert b.long_cut(0, 0) == 128 and b.long_cut(1, 0) is None
    assert PrefillBudget(2, 3.0).long_cut(0, 3) is None  # off
    # short: by the tokens to evaluate after reuse; a slot waiting for a leader is not served
    fresh = busy(0, 0, list(range(300)))
    reused = busy(1, 1, list(range(300)), done=290)
    reused.n_reused = 290
    waiting = busy(2, 2, list(range(10)))
    waiting.leader = fresh
    done = busy(3, 3, [1, 2], done=2, state=SlotState.GENERATING)
    assert n_short([fresh, reused, waiting, done], 256) == 1


# ---- the engine -------------------------------------------------------------------------------


def test_engine_bounds_pinned_requests_apart_and_serves_a_short_prompt_beside_a_long_one(make_engine):
    e = make_engine(n_parallel=2, n_ctx=2 * 4096, n_batch=32, max_queued_requests=0, max_queued_per_slot=1)
    forever = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    blocker = e.make_request("blocker", forever, id_slot=0)
    e.submit(blocker)
    pinned = e.make_request("for slot 0", short, id_slot=0)
    e.submit(pinned)
    with pytest.raises(QueueFullError, match="slot 0"):
        e.submit(e.make_request("another for slot 0", short, id_slot=0))
    # no room in the queue for any slot (0), yet a slot is idle: it starts
    assert e.generate("any slot", short).final.slot == 1
    assert e.scheduler.counts() == (1, 1)
    e.cancel(pinned.id)
    e.cancel(blocker.id)
    deadline = time.monotonic() + 30
    while e.scheduler.counts() != (0, 0) or any(v.state != "idle" for v in e.slot_views()):
        assert time.monotonic() < deadline, e.slot_views()
        time.sleep(0.01)
    # a long prompt (about 100 steps of 32) starts; a short one after it gets its tokens
    # while the long one is still being evaluated
    long = e.make_request([1] + [(13 * i) % 3000 + 300 for i in range(3200)], short)
    q = e.outputs.register(long.id)
    e.submit(long)
    while not any(v.state == "processing_prompt" for v in e.slot_views()):
        time.sleep(0.001)
    assert e.generate("a short one", short).final.finish_reason == "length"
    assert q.empty()  # the long prompt has not got its first token
    while (o := q.get(timeout=120)).finish_reason is None:
        pass
    assert o.finish_reason == "length"
