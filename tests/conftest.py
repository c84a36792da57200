"""Shared fixtures: the synthetic model files and engines built from them."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from deployments.stage import server as rpc_server
from engine import Engine, EngineConfig
from tests.models import ensure_synthetic_model
from tests.models.synthetic import ModelShape, write_model

REPO = Path(__file__).resolve().parents[1]
RPC_PORT = 50161

# property-based tests run the same examples every time in `make test` (a red run names a real
# defect, not a new draw); HYPOTHESIS_PROFILE=explore draws new ones (PGROUPS_FUZZ_EXAMPLES: how many)
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def engine_factory(**defaults: object) -> Iterator[Callable[..., Engine]]:
    """Body of an engine fixture: ``make(**overrides)`` builds engines from ``defaults``; all
    are closed at teardown."""
    engines: list[Engine] = []

    def make(**kw: object) -> Engine:
        e = Engine(EngineConfig(**{**defaults, **kw}))
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()


@pytest.fixture(scope="session")
def model_path() -> str:
    """The synthetic model: exact shapes, fast, and peaked logits that keep greedy stable."""
    return str(ensure_synthetic_model())


@pytest.fixture
def make_engine(model_path: str) -> Iterator[Callable[..., Engine]]:
    yield from engine_factory(model=model_path, n_threads=1)


@pytest.fixture(scope="session")
def small_shape() -> ModelShape:
    return ModelShape(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=128, n_vocab=1024, seed=7)


@pytest.fixture(scope="session")
def q8_model(tmp_path_factory: pytest.TempPathFactory, small_shape: ModelShape) -> str:
    path = tmp_path_factory.mktemp("models") / "q8.gguf"
    shape = ModelShape(**{**small_shape.__dict__, "ftype": "q8_0"})
    return str(write_model(path, shape))


@pytest.fixture(scope="module")
def rpc_server_proc() -> Iterator[subprocess.Popen]:
    """A ggml RPC server on loopback, one per test module."""
    proc = rpc_server.launch("127.0.0.1", RPC_PORT, threads=1)
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def rpc_endpoint(rpc_server_proc: subprocess.Popen) -> str:
    return f"127.0.0.1:{RPC_PORT}"


@pytest.fixture
def rpc_server_pid(rpc_server_proc: subprocess.Popen) -> int:
    return rpc_server_proc.pid


def cpu_count() -> int:
    return os.cpu_count() or 1
