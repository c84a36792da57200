"""End-to-end fixtures: a two-node Ray cluster on this machine and the app deployed on it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

HTTP_PORT = int(os.environ.get("PGROUPS_TEST_HTTP_PORT", "8765"))
RAY_PORT = int(os.environ.get("PGROUPS_TEST_RAY_PORT", "6391"))
BASE = f"http://127.0.0.1:{HTTP_PORT}"
NODE_MEMORY = 100 << 20


# The e2e tests in the order that deploys each app once (a deploy costs about 40 s on 2 cores):
# first every test on test_http_api's APP, then the apps that differ from it, each once. A
# module not listed runs last; within a rank the collected order stands.
DEPLOY_ORDER = [
    ("test_a_stage_whose_settings_changed", "test_the_first_client_vanishing"),  # rpc port variants
    ("test_peer_failure.py",),  # APP with a short stage_timeout_s
    ("test_clients.py",),  # the embeddings model, then the chat model
    ("test_reliability.py",),  # its own app (api_key, short timeouts)
    ("test_pairs.py",),
    ("test_topology.py",),
]
SHARED_APP = ("test_edges_http.py", "test_guard_http.py", "test_heads_http.py", "test_hostile_http.py",
              "test_http_api.py", "test_images_http.py", "test_metrics.py", "test_page.py", "test_readme.py", "test_sdks.py")


def deploy_rank(item: pytest.Item) -> int:
    name, module = item.name, item.path.name
    for rank, keys in enumerate(DEPLOY_ORDER, start=1):
        if any(name.startswith(k) or module == k for k in keys):
            return rank
    return 0 if module in SHARED_APP else len(DEPLOY_ORDER) + 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slots = [i for i, item in enumerate(items) if "/e2e/" in str(item.fspath)]
    for i in slots:
        items[i].add_marker(pytest.mark.e2e)
    ordered = sorted((items[i] for i in slots), key=deploy_rank)
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item


@pytest.fixture(scope="session")
def ray_cluster(model_path: str) -> Iterator[str]:
    from cluster import local_cluster

    # four raylets: room for two pairs (tests/e2e/test_pairs.py); one-stage apps use two of them.
    # Each states NODE_MEMORY for a model, so that the topology's choice depends on the config
    # (tests/e2e/test_topology.py), not on this machine
    with local_cluster.serve_session(RAY_PORT, HTTP_PORT, pairs=2, node_memory=NODE_MEMORY) as address:
        yield address


def wait_healthy(timeout_s: float = 180.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if httpx.get(BASE + "/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError("the service did not become healthy")


@pytest.fixture(scope="session")
def deploy(ray_cluster: str, model_path: str) -> Callable[[dict], str]:
    """Deploy ``build_app(args)`` as the one application (on the synthetic model unless the
    args name another); returns the base URL."""
    from ray import serve

    from deployments.app import build_app

    current: dict = {}

    def _deploy(args: dict) -> str:
        # the tests' apps are the engine as configured unless they name a topology
        args = {"model": model_path, "topology": "layer_split", **args}
        if current.get("args") != args:
            if current:
                # the RPC stage serves one engine at a time: the old one must let go first
                serve.delete("pgroups")
            # bounded: an app that cannot be placed fails the test instead of hanging the run
            app = build_app(args)
            done = threading.Thread(target=serve.run, args=(app,), kwargs={"name": "pgroups", "route_prefix": "/"},
                                    daemon=True)
            done.start()
            done.join(300)
            if done.is_alive():
                raise TimeoutError(f"the app did not start in 300 s: {serve.status().applications.get('pgroups')}")
            current["args"] = dict(args)
        wait_healthy()
        return BASE

    return _deploy
