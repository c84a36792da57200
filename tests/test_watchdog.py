"""The frozen-stage watchdog's judgement (deployments/watchdog.py): a decode past a few times its
expected step with nobody working on it is frozen; a slow step that is busy somewhere is not,
up to the ceiling; a step nothing was learnt for waits for the ceiling."""

from __future__ import annotations

from deployments.watchdog import StallJudge
from engine.types import Decode


def polls(judge: StallJudge, readings: list[tuple[list[Decode], float | None]]) -> list[Decode | None]:
    return [judge.frozen(decodes, stage) for decodes, stage in readings]


def test_a_decode_nobody_works_on_is_frozen_soon_after_its_limit():
    judge = StallJudge(ceiling_s=60.0, factor=10.0, floor_s=5.0)
    d = lambda s, cpu: Decode(0, s, 0.2, cpu)  # noqa: E731 - a 0.2 s step: limit 5 s (the floor)
    got = polls(judge, [([d(3.0, 1.0)], 7.0), ([d(4.0, 1.0)], 7.0), ([d(5.5, 1.0)], 7.0), ([d(6.5, 1.0)], 7.0)])
    assert got[:2] == [None, None]  # under the floor
    assert got[2] is not None and got[2].seconds == 5.5  # idle since the last poll, past the limit
    assert judge.limit(d(0, 0)) == 5.0 and StallJudge(60.0, 10.0, 5.0).limit(Decode(0, 0, 2.0, 0)) == 20.0
    assert "expected to take 0.20 s" in judge.reason(got[2])


def test_a_slow_step_that_is_busy_is_left_to_the_ceiling():
    judge = StallJudge(ceiling_s=30.0, factor=10.0, floor_s=5.0)
    # the local stage computes (its thread's CPU advances), the peer is idle
    local = [([Decode(0, s, 0.2, s)], 7.0) for s in (6.0, 7.0, 8.0, 29.0)]
    assert polls(judge, local) == [None] * 4
    # the peer computes (its server's CPU advances), the thread waits on the socket
    judge = StallJudge(ceiling_s=30.0, factor=10.0, floor_s=5.0)
    peer = [([Decode(0, s, 0.2, 1.0)], s) for s in (6.0, 7.0, 8.0, 29.0)]
    assert polls(judge, peer) == [None] * 4
    # past the ceiling, whatever it does
    assert judge.frozen([Decode(0, 31.0, 0.2, 2.0)], 40.0) is not None


def test_a_step_nothing_was_learnt_for_waits_for_the_ceiling():
    judge = StallJudge(ceiling_s=60.0, factor=10.0, floor_s=5.0)
    idle = [([Decode(0, s, None, 1.0)], 7.0) for s in (10.0, 30.0, 59.0)]
    assert polls(judge, idle) == [None] * 3
    assert judge.frozen([Decode(0, 61.0, None, 1.0)], 7.0) is not None


def test_a_stage_that_does_not_answer_counts_as_idle():
    judge = StallJudge(ceiling_s=60.0, factor=10.0, floor_s=5.0)
    got = polls(judge, [([Decode(1, 5.5, 0.1, 2.0)], None), ([Decode(1, 6.5, 0.1, 2.0)], None)])
    assert got[0] is None and got[1] is not None and got[1].group == 1
