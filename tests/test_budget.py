"""Chunked prefill: the prompt tokens a step may carry while other streams decode."""

from __future__ import annotations

import threading
import time

import pytest
from pydantic import ValidationError

from engine import EngineConfig, SamplingParams
from engine.budget import BURST_MIN, PrefillBudget
from engine.cost import StepCost
from engine.planner import plan_step
from engine.slots import SlotState
from tests.test_step_parts import busy

WAIT_S = 60.0


def cpu(rows: int, k: int) -> float:
    """A CPU's step: 50 ms and 12.5 ms a row; a chunk costs 30 ms and 3.3 ms a token (so 8
    tokens cost 7 ms a token, 256 tokens 3.4)."""
    return 0.050 + 0.0125 * rows + (0.030 + 0.0033 * k if k else 0.0)


def gpu(rows: int, k: int) -> float:
    """A GPU's: 20 ms and 0.2 ms a row; a chunk costs 1 ms and 0.01 ms a token."""
    return 0.020 + 0.0002 * rows + (0.001 + 0.00001 * k if k else 0.0)


def learnt(hw, rows: int, chunks: list[int], **kw) -> PrefillBudget:
    """A budget whose model has seen decode steps of ``rows`` (and one row more, for the slope)
    and steps with each of ``chunks`` beside them, costing what ``hw`` says."""
    b = PrefillBudget(2, **{"gap_factor": 3.0, "min_rate": 0.0, "chunk_min": 8, **kw})
    for _ in range(30):
        for r in (rows, rows + 1):
            b.observe(r, 0, hw(r, 0))
        for k in chunks:
            b.observe(rows, k, hw(rows, k))
    return b


def test_the_cost_model_fits_a_line_in_the_rows_and_a_per_token_cost_by_chunk_size():
    c = StepCost()
    assert c.base(4) is None and c.per_token(8) is None and c.step(4, 8) is None
    for _ in range(60):
        for r in (2, 4, 8):
            c.observe(r, 0, cpu(r, 0))
        for k in (8, 64, 512):
            c.observe(4, k, cpu(4, k))
    assert c.base(6) == pytest.approx(cpu(6, 0), rel=1e-3)
    assert c.fixed() == pytest.approx(0.050, rel=1e-2)
    for k in (8, 64, 512):  # the sizes seen: their own cost per token
        assert c.per_token(k) == pytest.approx((cpu(4, k) - cpu(4, 0)) / k, rel=1e-3)
        assert c.step(4, k) == pytest.approx(cpu(4, k), rel=1e-3)
    assert c.per_token(8) > 2 * c.per_token(512)  # a small chunk costs more a token
    # between two sizes seen, on log2(k); below them, the smallest's; above them, the line
    # through the chunks' costs (30 ms + 3.3 ms a token here), never more a token than the largest
    mid = (c.per_token(8) + c.per_token(64)) / 2
    assert c.per_token(23) == pytest.approx(mid, rel=0.02)
    assert c.per_token(2) == c.per_token(8)
    assert c.per_token(2048) == pytest.approx((0.030 + 0.0033 * 2048) / 2048, rel=1e-3)
    c3 = StepCost()
    for _ in range(30):
        c3.observe(4, 0, cpu(4, 0))
        c3.observe(4, 64, cpu(4, 64))
    assert c3.per_token(512) == c3.per_token(64)  # one size seen: its cost a token
    # a step without rows (an idle prompt) counts the line's fixed part, not a row's cost
    c2 = StepCost()
    for _ in range(30):
        for r in (2, 8):
            c2.observe(r, 0, cpu(r, 0))
        c2.observe(0, 512, cpu(0, 512))
    assert c2.per_token(512) == pytest.approx((cpu(0, 512) - 0.050) / 512, rel=1e-2)
    assert [k for k, _ in c2.buckets()] == [512]


def test_the_gap_bound_alone_takes_the_largest_chunk_whose_step_stays_within_the_factor():
    b = learnt(cpu, 8, [8, 32, 128, 512])
    k = b.tokens(0, 8, 512)
    ref = cpu(8, 0)
    # the largest within 3x: 81 tokens at the true costs; the model, interpolating between the
    # sizes seen (32 and 128), prices the sizes between a little high
    assert cpu(8, k) <= 3.0 * ref < cpu(8, k + 8)
    assert 70 <= k <= 81
    # a looser bound, a larger chunk
    b.gap_factor = 6.0
    assert b.tokens(0, 8, 512) > 2 * k
    # another group decodes and this one has no rows: the other group's step is the reference
    b.gap_factor = 3.0
    b.decoding[1] = 8
    k0 = b.tokens(0, 0, 512)
    assert cpu(0, k0) <= 3.0 * ref * 1.01 and k0 > k


def test_where_prompt_tokens_cost_a_share_of_a_row_the_prompts_least_rate_wins_over_the_gap():
    b = learnt(cpu, 8, [8, 32, 128, 512], min_rate=0.7)
    k = b.tokens(0, 8, 512)
    k_gap = learnt(cpu, 8, [8, 32, 128, 512]).tokens(0, 8, 512)
    assert k > k_gap  # the gap bound alone would starve the prompt

    def rate(n: int) -> float:
        return n / cpu(8, n)

    full = rate(512)  # the whole batch beside the same rows
    assert rate(k) >= 0.7 * full * 0.99 and rate(k - 8) < 0.7 * full  # the smallest chunk at that rate
    # the gap it costs: about 1 / (1 - 0.7) times the step without it, not the whole batch's
    assert 3.0 < cpu(8, k) / cpu(8, 0) < 4.5 < cpu(8, 512) / cpu(8, 0)
    # a prompt held to its floor: min_rate 0.9 takes more, 0 the gap bound's chunk
    b.min_rate = 0.9
    assert b.tokens(0, 8, 512) > k
    b.min_rate = 0.0
    assert b.tokens(0, 8, 512) == k_gap


def test_a_gap_factor_of_1_without_a_least_rate_fixes_the_chunk_at_its_floor():
    """How the benchmark's fixed-chunk arms (and a user who wants llama-server's -b beside
    streams) pin the chunk: no chunk step lasts 1x a step without it, so the floor decides."""
    for hw, rows in ((cpu, 8), (gpu, 16)):
        for floor in (16, 64):
            b = learnt(hw, rows, [8, 64, 512], gap_factor=1.0, min_rate=0.0, chunk_min=floor)
            assert b.tokens(0, rows, 512) == floor
    assert PrefillBudget(2, gap_factor=1.0, chunk_min=64).tokens(0, 4, 512) == 64  # nothing learnt yet


def test_where_prompt_tokens_are_cheap_beside_a_decode_step_the_prompt_gets_the_whole_batch():
    b = learnt(gpu, 16, [8, 64, 512], min_rate=0.7)
    assert b.tokens(0, 16, 512) == 512  # 512 tokens add 6 ms to a 23 ms step
    assert b.tokens(0, 16, 2048) > 1024  # beyond the sizes seen, a size's cost per token is the largest's


def test_from_the_smallest_chunk_the_budget_climbs_to_the_chunk_the_bounds_set():
    """Each choice is made on what the model has seen; a chunk larger than any seen is priced at
    the largest's cost per token (too high), so each step errs small, then learns the larger size."""
    for hw, rows, expect in ((cpu, 8, None), (gpu, 16, 512)):
        b = PrefillBudget(2, gap_factor=3.0, min_rate=0.7, chunk_min=8)
        for _ in range(20):
            b.observe(rows, 0, hw(rows, 0))
        chosen = []
        for _ in range(60):
            k = b.tokens(0, rows, 512)
            chosen.append(k)
            b.observe(rows, k, hw(rows, k))
            b.observe(rows, 0, hw(rows, 0))
        assert chosen[0] == 8  # nothing seen of prompts: the smallest chunk
        assert chosen[-1] == chosen[-2] > 8
        if expect is not None:
            assert chosen[-1] == expect
        else:  # the least rate holds with the true costs, the gap at about 1 / (1 - 0.7)
            k = chosen[-1]
            assert k / hw(rows, k) >= 0.7 * 512 / hw(rows, 512) * 0.97
            assert hw(rows, k) / hw(rows, 0) < 4.5


def test_the_budget_is_off_or_whole_unless_the_decoding_streams_outnumber_the_prompts():
    assert PrefillBudget(1, gap_factor=None).tokens(0, 3, 512) == 512  # off
    b = PrefillBudget(2, gap_factor=3.0, min_rate=0.7, chunk_min=8)
    assert b.tokens(0, 0, 512) == 512  # nothing decodes anywhere: the whole batch
    assert b.tokens(0, 3, 512) == 8  # nothing learnt yet: the smallest chunk
    b = learnt(cpu, 8, [8, 64, 512], min_rate=0.7)
    k = b.tokens(0, 8, 512, n_prompting=1)
    assert 8 < k < 512  # one long prompt beside 8 streams
    # a burst: the first of four prompts decodes, three wait; chunks would only delay them
    assert b.tokens(0, 1, 512, n_prompting=3) == 512
    assert b.tokens(0, 2, 512, n_prompting=2) == 512
    # the other group's counts weigh as much as this group's
    b.decoding[1], b.prompting[1] = 6, 0
    assert 8 < b.tokens(0, 1, 512, n_prompting=3) < 512
    b.prompting[1] = 4
    assert b.tokens(0, 1, 512, n_prompting=3) == 512


def test_a_bursts_steps_last_at_most_the_burst_bound_where_the_whole_batch_would_not():
    """Several prompts and few streams: large chunks, bounded in time so that a newcomer waits
    for the step in flight at most about ``burst_step_s`` (seconds of a whole batch on a CPU)."""
    b = learnt(cpu, 1, [8, 64, 512], burst_step_s=1.0)
    assert cpu(1, 512) > 1.5  # a whole batch of this CPU
    k = b.tokens(0, 1, 512, n_prompting=3)
    assert cpu(1, k) <= 1.0 * 1.01 and cpu(1, k + 8) > 1.0 * 0.99  # the largest within the bound
    assert BURST_MIN < k < 512
    assert b.tokens(0, 0, 512, n_prompting=2) >= k  # no rows: a chunk at least as large
    b.burst_step_s = 2.0  # the whole batch fits
    assert b.tokens(0, 1, 512, n_prompting=3) == 512
    b.burst_step_s = None  # off: whole batches, as llama-server
    assert b.tokens(0, 1, 512, n_prompting=3) == 512
    b.burst_step_s = 1.0
    assert b.tokens(0, 0, 512, n_prompting=1) == 512  # one prompt alone goes whole
    assert b.tokens(0, 8, 512, n_prompting=1) < k  # beside streams: the gap's budget, not the burst's
    # a bound too short for a slow device: never under BURST_MIN tokens, where a token costs more
    b.burst_step_s = 0.1
    assert b.tokens(0, 1, 512, n_prompting=3) == BURST_MIN < 512
    assert b.tokens(0, 1, 96, n_prompting=3) == 96  # a batch smaller than that: whole
    # a GPU's whole batch fits the bound; nothing learnt yet: the whole batch teaches the model
    assert learnt(gpu, 1, [8, 64, 512], burst_step_s=0.5).tokens(0, 1, 512, n_prompting=3) == 512
    assert PrefillBudget(2, gap_factor=3.0, burst_step_s=0.5).tokens(0, 0, 512, n_prompting=4) == 512


def test_the_knobs_are_validated_and_the_old_one_is_refused_by_its_new_name():
    c = EngineConfig(model="m.gguf")
    assert (c.prefill_gap_factor, c.prefill_min_rate) == (3.0, 0.7)
    for bad in ({"prefill_gap_factor": 0.5}, {"prefill_min_rate": 1.5}):
        with pytest.raises(ValidationError):
            EngineConfig(model="m.gguf", **bad)
    with pytest.raises(ValidationError, match="prefill_stall is now prefill_gap_factor"):
        EngineConfig(model="m.gguf", prefill_stall=0.5)


def test_the_plan_cuts_long_prompts_to_the_budget_and_never_the_decode_rows_nor_short_prompts():
    gen = busy(0, 0, [1, 2, 3], done=3, state=SlotState.GENERATING, last=9)
    a = busy(1, 1, list(range(10, 100)))  # 90 tokens: long above 50
    b = busy(2, 2, list(range(100, 200)))
    short = busy(3, 3, list(range(200, 230)))  # 30 tokens: whole
    plan = plan_step([gen, a, b, short], {}, capacity=80, n_ubatch=512, unified=False, prompt_budget=20,
                     long_prompt=50)
    assert [(e.slot.id, len(e.tokens)) for e in plan.entries] == [(0, 1), (1, 20), (3, 30)]
    assert plan_step([gen, a], {}, 64, 512, False, prompt_budget=None).n_tokens == 64
    # a prompt mostly reused from the cache is as short as what it evaluates
    b.n_reused = b.n_prompt_done = 60
    assert [len(e.tokens) for e in plan_step([b], {}, 80, 512, False, 5, 50).entries] == [40]


class GivenCost(StepCost):
    """A cost model that has learnt ``hw``'s costs and learns nothing from the steps that run."""

    def __init__(self, hw, rows: int) -> None:
        super().__init__()
        for _ in range(30):
            for r in (rows, rows + 1):
                super().observe(r, 0, hw(r, 0))
            for k in (8, 32, 128, 512):
                super().observe(rows, k, hw(rows, k))

    def observe(self, rows: int, k: int, seconds: float) -> None:
        pass


def test_a_long_prompt_beside_decoding_streams_takes_the_budgets_chunks(make_engine):
    """With two streams decoding, the long prompt takes the chunks the budget sets for the given
    (CPU-like) costs, so more steps than n_batch chunks would, and its output is the same (the
    streams' own text may part at a near tie after the prompt arrives: their rows then share
    batches of other shapes, which llama.cpp rounds otherwise)."""
    greedy = SamplingParams(temperature=0, max_tokens=1800, ignore_eos=True)  # outlasts the prompt
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    long_prompt = [1] + [(13 * i) % 3000 + 300 for i in range(1500)]
    results = {}
    for arm, gap in (("off", None), ("on", 3.0)):
        e = make_engine(n_parallel=3, n_ctx=3 * 2048, n_batch=512, prefill_gap_factor=gap, prefill_chunk_min=16)
        e.prefill.cost = GivenCost(cpu, 2)
        e.generate(long_prompt, short)
        streams = [threading.Thread(target=e.generate, args=(p, greedy)) for p in ("a story", "the king")]
        for t in streams:
            t.start()
        while sum(v.state == "generating" for v in e.slot_views()) < 2:
            time.sleep(0.01)
        s0 = sum(p.steps for p in e.profiles())
        other = [1] + [(17 * i) % 3000 + 300 for i in range(1500)]  # nothing of it cached
        results[arm] = e.generate(other, short).text
        results[arm + "-steps"] = sum(p.steps for p in e.profiles()) - s0
        results[arm + "-chunk"] = e.prefill.tokens(0, 2, 512)
        for t in streams:
            t.join(60)
    assert results["on"] == results["off"]
    # off: ceil(1500 / 510) chunks beside the streams' rows, and the steps of whatever the
    # streams' group had begun (the engine's step count); on: at most the budget's chunk a step
    # (about 60 tokens for these costs: the least rate's, above the gap bound's)
    chunk = results["on-chunk"]
    assert 16 < chunk < 128 and results["off-chunk"] == 512
    assert results["off-steps"] <= 12 and results["on-steps"] >= 1501 / chunk, results


def test_decode_steps_slowed_by_another_groups_chunk_do_not_raise_the_reference():
    """Two groups on the same stages: a decode step of one that runs beside the other's chunk
    waits for that chunk. Learnt as a decode step it would raise the reference the gap bound
    multiplies, so the next chunk would grow, slow the other group more, and grow again."""
    b = PrefillBudget(2, gap_factor=3.0, min_rate=0.0, chunk_min=8)
    for _ in range(30):  # both groups decode
        for g in (0, 1):
            for r in (4, 5):
                b.begin(g, 0)
                b.observe(r, 0, cpu(r, 0), g)
    chunks = []
    for _ in range(300):  # group 0 carries a long prompt's chunks; each of group 1's steps waits for one
        k = b.tokens(0, 4, 512)
        chunks.append(k)
        b.begin(0, k)
        b.begin(1, 0)
        b.observe(4, 0, cpu(4, 0) + cpu(4, k), 1)
        b.observe(4, k, cpu(4, k), 0)
    assert b.cost.base(4) == pytest.approx(cpu(4, 0), rel=1e-3)  # the line is the clean decode step's
    assert max(chunks[50:]) > 8  # it learnt past the floor
    assert all(cpu(4, k) <= 3.0 * cpu(4, 0) * 1.05 for k in chunks[50:]), max(chunks)
    # a step that failed leaves nothing behind: the other group's next decode step is learnt again
    b.begin(0, 64)
    b.end(0)
    b.begin(1, 0)
    assert not b.end(1)


def test_where_small_chunks_cost_much_more_a_token_the_rate_bound_stops_at_its_gap_cap():
    """A CPU where a prompt token costs an eighth of a decode step in a large chunk and a fifth
    in a chunk of 8 (each chunk costs 80 ms of its own): 70 % of the whole batch's rate would
    stretch the others' gap half as far again as 1 / (1 - 0.7) times, where the chunk stops."""

    def slow(rows: int, k: int) -> float:
        return 0.040 + 0.014 * rows + (0.080 + 0.012 * k if k else 0.0)

    b = learnt(slow, 4, [8, 16, 32, 64, 128, 256, 512], min_rate=0.7)
    k = b.tokens(0, 4, 512)
    ref = slow(4, 0)
    uncapped = _first_rate(slow, 4, 512, 0.7)
    assert slow(4, uncapped) > 1.5 * ref / (1 - 0.7)  # what the rate alone would cost the others
    assert slow(4, k) <= ref / (1 - 0.7) * 1.02 and slow(4, k + 8) > ref / (1 - 0.7)
    assert k > learnt(slow, 4, [8, 16, 32, 64, 128, 256, 512]).tokens(0, 4, 512)  # more than the gap bound's


def _first_rate(hw, rows: int, capacity: int, min_rate: float) -> int:
    full = capacity / hw(rows, capacity)
    return next(k for k in range(1, capacity + 1) if k / hw(rows, k) >= min_rate * full)


def test_the_groups_threads_read_and_write_the_budget_one_at_a_time():
    """The groups' threads share the lists and the cost model's sums: a read (the next step's
    chunk) never runs while another group's step time is being learnt, so it sees the model
    before or after that write, whole."""
    entered, gate = threading.Event(), threading.Event()

    class HeldCost(StepCost):
        def observe(self, rows: int, k: int, seconds: float) -> None:
            entered.set()
            assert gate.wait(WAIT_S)
            super().observe(rows, k, seconds)

    b = PrefillBudget(2, gap_factor=2.0, cost=HeldCost())
    writer = threading.Thread(target=b.observe, args=(4, 0, 0.1, 0))
    writer.start()
    assert entered.wait(WAIT_S)
    got: list[object] = []
    readers = [threading.Thread(target=lambda: got.append(b.tokens(1, 4, 512, 1))),
               threading.Thread(target=lambda: got.append(b.publish(1, 3, 1, 0))),
               threading.Thread(target=lambda: got.append(b.begin(1, 8)))]
    for t in readers:
        t.start()
    for t in readers:
        t.join(0.5)
    assert got == [] and all(t.is_alive() for t in readers)  # each waits for the write
    gate.set()
    writer.join(WAIT_S)
    for t in readers:
        t.join(WAIT_S)
    assert len(got) == 3 and b.cost.base(4) == pytest.approx(0.1)
