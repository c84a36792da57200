"""n > 1: the prompt is evaluated once on one slot, its KV copied to the other choices'
slots of the same group, and every choice samples on its own."""

from __future__ import annotations

import time

import pytest

from engine import RequestError, SamplingParams

PROMPT = "Once upon a time, in a land of many pipelines, there lived a scheduler who"


def decoded_tokens(e) -> int:
    return sum(p.batch_tokens for p in e.profiles())


@pytest.mark.parametrize("kv_unified", [False, True])
def test_greedy_choices_equal_the_single_answer_and_the_prompt_is_decoded_once(make_engine, kv_unified):
    e = make_engine(n_parallel=4, pipeline_groups=1, cache_prompt=False, kv_unified=kv_unified)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one = e.generate(PROMPT, greedy)
    n_prompt = one.final.prompt_tokens
    before = decoded_tokens(e)
    three = e.generate_n(PROMPT, greedy, 3)
    decoded = decoded_tokens(e) - before
    assert [c.text for c in three] == [one.text] * 3  # the copied KV is the prompt's KV
    assert all(c.final.finish_reason == "length" and c.final.completion_tokens == 24 for c in three)
    # one prompt, then 3 rows a step (the first token of each comes from the prompt's logits)
    assert decoded == n_prompt + 3 * 23, (decoded, n_prompt)


def test_sampled_choices_differ_and_repeat_with_the_seed(make_engine):
    e = make_engine(n_parallel=4, pipeline_groups=2)
    params = SamplingParams(temperature=1.5, seed=11, max_tokens=16, ignore_eos=True)
    a = [c.text for c in e.generate_n(PROMPT, params, 2)]
    b = [c.text for c in e.generate_n(PROMPT, params, 2)]
    assert a == b and a[0] != a[1]
    # choice 0 is the single request with the same seed
    assert e.generate(PROMPT, params).text == a[0]


def test_n_beyond_a_groups_slots_is_refused(make_engine):
    e = make_engine(n_parallel=4, pipeline_groups=2)
    with pytest.raises(RequestError, match="n=3 needs 3 slots of one pipeline group"):
        e.make_request(PROMPT, SamplingParams(max_tokens=4), n=3)


def test_a_family_waits_for_free_slots_in_one_group_and_nothing_leaks(make_engine):
    e = make_engine(n_parallel=4, pipeline_groups=2)
    long = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    # one slot busy in each group: neither has two free slots for a family of 2
    blockers = [e.make_request(f"blocker {i}", long) for i in range(2)]
    for r in blockers:
        e.submit(r)
    deadline = time.monotonic() + 30
    while sum(v.state != "idle" for v in e.slot_views()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # the less busy group takes the second: neither group has two free slots now
    assert {v.group for v in e.slot_views() if v.state != "idle"} == {0, 1}
    fam = e.make_request(PROMPT, SamplingParams(temperature=0, max_tokens=4), n=2)
    q = [e.outputs.register(m.id) for m in fam.family]
    e.submit(fam)
    deadline = time.monotonic() + 30
    while e.scheduler.counts()[1] != 1:  # the family waits (for two free slots of one group)
        assert time.monotonic() < deadline, e.scheduler.counts()
        time.sleep(0.01)
    e.cancel(blockers[0].id)
    finals = []
    for qq in q:
        while True:
            o = qq.get(timeout=60)
            if o.finish_reason is not None:
                finals.append(o)
                break
    assert [o.finish_reason for o in finals] == ["length", "length"]
    e.cancel(blockers[1].id)
    deadline = time.monotonic() + 30
    while any(v.state != "idle" for v in e.slot_views()):
        assert time.monotonic() < deadline, e.slot_views()
        time.sleep(0.01)
    assert e.scheduler.counts() == (0, 0)


def test_cancelling_a_waiting_family_ends_every_choice(make_engine):
    e = make_engine(n_parallel=2, pipeline_groups=1)
    long = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    blocker = e.make_request("blocker", long)
    e.submit(blocker)
    fam = e.make_request(PROMPT, SamplingParams(max_tokens=4), n=2)
    q = [e.outputs.register(m.id) for m in fam.family]
    e.submit(fam)
    assert e.cancel(fam.id)
    assert [qq.get(timeout=10).finish_reason for qq in q] == ["cancelled", "cancelled"]
    e.cancel(blocker.id)


def test_id_slot_runs_on_that_slot_and_waits_for_it_without_holding_back_others(make_engine):
    e = make_engine(n_parallel=4, pipeline_groups=2)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for slot in (3, 0, 2):
        r = e.make_request(PROMPT, short, id_slot=slot)
        q = e.outputs.register(r.id)
        e.submit(r)
        while (o := q.get(timeout=30)).finish_reason is None:
            pass
        assert o.slot == slot
    # slot 1 busy: a request pinned to it waits; one behind it that any slot can take runs
    blocker = e.make_request("blocker", SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True), id_slot=1)
    e.submit(blocker)
    pinned = e.make_request(PROMPT, short, id_slot=1)
    qp = e.outputs.register(pinned.id)
    e.submit(pinned)
    free = e.generate("any slot", short)
    assert free.final.finish_reason == "length" and free.final.slot != 1
    assert qp.empty() and e.scheduler.counts()[1] == 1
    e.cancel(blocker.id)
    while (o := qp.get(timeout=30)).finish_reason is None:
        pass
    assert o.slot == 1 and o.finish_reason == "length"
    with pytest.raises(RequestError, match="id_slot 4 does not exist"):
        e.make_request(PROMPT, short, id_slot=4)
