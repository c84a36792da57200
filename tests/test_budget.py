"""Chunked prefill: the prompt tokens a step may carry while other streams decode."""

from __future__ import annotations

import threading
import time

from engine import SamplingParams
from engine.budget import PrefillBudget
from engine.planner import plan_step
from engine.slots import SlotState
from tests.test_step_parts import busy


def test_the_budget_follows_the_measured_cost_of_decode_steps_and_prompt_tokens():
    b = PrefillBudget(2, stall=0.5, chunk_min=8)
    assert b.tokens(0, 0, 512) == 512  # nothing decodes anywhere: the whole batch
    assert b.tokens(0, 3, 512) == 8  # nothing learnt yet: the smallest chunk
    for _ in range(20):
        b.observe(n_rows=3, n_prompt=0, seconds=0.100)  # a decode step: 100 ms
        b.observe(n_rows=3, n_prompt=40, seconds=0.140)  # 40 prompt tokens add 40 ms
    assert abs(b.tokens(0, 3, 512) - 50) <= 1  # half of 100 ms at 1 ms a token
    # another group decodes: this group's prompt is cut too; a cheap token gets the batch
    b.decoding[1] = 4
    assert abs(b.tokens(0, 0, 512) - 50) <= 1
    for _ in range(40):
        b.observe(n_rows=3, n_prompt=400, seconds=0.104)
    assert b.tokens(0, 3, 512) == 512
    assert PrefillBudget(1, stall=None, chunk_min=8).tokens(0, 3, 512) == 512  # off


def test_prompts_go_whole_unless_the_decoding_streams_outnumber_them():
    b = PrefillBudget(2, stall=0.5, chunk_min=8)
    for _ in range(20):
        b.observe(n_rows=3, n_prompt=0, seconds=0.100)
        b.observe(n_rows=3, n_prompt=40, seconds=0.140)
    assert abs(b.tokens(0, 8, 512, n_prompting=1) - 50) <= 1  # one long prompt beside 8 streams
    # a burst: the first of four prompts decodes, three wait; chunks would only delay them
    assert b.tokens(0, 1, 512, n_prompting=3) == 512
    assert b.tokens(0, 2, 512, n_prompting=2) == 512
    # the other group's counts weigh as much as this group's
    b.decoding[1], b.prompting[1] = 6, 0
    assert abs(b.tokens(0, 1, 512, n_prompting=3) - 50) <= 1
    b.prompting[1] = 4
    assert b.tokens(0, 1, 512, n_prompting=3) == 512


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


def test_a_long_prompt_beside_a_decoding_stream_is_evaluated_in_smaller_chunks(make_engine):
    """With two streams decoding, the long prompt takes more steps than n_batch chunks would, and
    its output is the same (the stream's own text may part at a near tie after the prompt
    arrives: its rows then share batches of other shapes, which llama.cpp rounds otherwise)."""
    greedy = SamplingParams(temperature=0, max_tokens=1800, ignore_eos=True)  # outlasts the prompt
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    long_prompt = [1] + [(13 * i) % 3000 + 300 for i in range(1500)]
    results = {}
    for arm, stall in (("off", None), ("on", 0.5)):
        e = make_engine(n_parallel=3, n_ctx=3 * 2048, n_batch=512, prefill_stall=stall, prefill_chunk_min=16)
        e.generate(long_prompt, short)  # warm: the budget has seen prompt steps
        streams = [threading.Thread(target=e.generate, args=(p, greedy)) for p in ("a story", "the king")]
        for t in streams:
            t.start()
        while sum(v.state == "generating" for v in e.slot_views()) < 2:
            time.sleep(0.01)
        s0 = sum(p.steps for p in e.profiles())
        other = [1] + [(17 * i) % 3000 + 300 for i in range(1500)]  # nothing of it cached
        results[arm] = e.generate(other, short).text
        results[arm + "-steps"] = sum(p.steps for p in e.profiles()) - s0
        for t in streams:
            t.join(60)
    assert results["on"] == results["off"]
    # off: ceil(1500 / 510) chunks beside the streams' rows, and the steps of whatever the
    # streams' group had begun (the engine's step count); on: the chunks are smaller
    assert results["off-steps"] <= 12 and results["on-steps"] > 4 * results["off-steps"], results
