"""The hostile cases on the real model: a 262,144-token vocabulary, where a grammar's token mask
is the largest and a sampler window the costliest (tests/test_hostile.py has the synthetic run
and the fuzzing)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.hostile import CASES
from tests.test_hostile import ANSWER_S, Bed


@pytest.fixture(scope="module")
def gemma_bed(gemma_path: str) -> Iterator[Bed]:
    b = Bed(gemma_path)
    deadline = time.monotonic() + 60
    while b.gaps.n < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield b
    b.close()


@pytest.mark.parametrize("name, route, body", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_request_on_the_real_model_is_answered_and_changes_nothing(gemma_bed, name, route, body):
    gemma_bed.gaps.reset()
    t0 = time.monotonic()
    status, detail = gemma_bed.answer(route, body)
    assert status in (200, 400), (name, status, detail)
    assert time.monotonic() - t0 < ANSWER_S
    gemma_bed.check_after(name)
