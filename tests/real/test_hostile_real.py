"""The hostile cases on the real model: a 262,144-token vocabulary, where a grammar's token mask
is the largest and a sampler window the costliest (tests/test_hostile.py has the synthetic run
and the fuzzing)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.hostile import CASES
from tests.test_hostile import Bed, running_bed


@pytest.fixture(scope="module")
def gemma_bed(gemma_path: str) -> Iterator[Bed]:
    yield from running_bed(gemma_path)


@pytest.mark.parametrize("name, route, body", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_request_on_the_real_model_is_answered_and_changes_nothing(gemma_bed, name, route, body):
    gemma_bed.survives(name, route, body)
