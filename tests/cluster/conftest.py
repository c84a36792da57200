"""The two-host test bed (``make test-cluster``): ``ray up`` with a config made from
``cluster/two-sparks.yaml``, ``serve run`` of one made from
``deployments/configs/two-sparks.yaml`` on the head, all torn down after.

These tests need root; ``make test`` does not collect them (``--ignore=tests/cluster``), and
run alone without ``PGROUPS_TESTBED=1`` they fail with the command to run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.cluster import testbed as tb

HERE = Path(__file__).resolve().parent
FIGURES: dict[str, float | int | str] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster: the two-host `ray up` test bed (make test-cluster; root)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PGROUPS_TESTBED") == "1":
        return
    fail = pytest.mark.usefixtures("_needs_testbed")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(fail)


@pytest.fixture
def _needs_testbed() -> None:
    pytest.fail("the two-host test bed builds namespaces as root: run `make test-cluster`")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if not FIGURES:
        return
    terminalreporter.section("two-host test bed: figures")
    for k, v in FIGURES.items():
        terminalreporter.write_line(f"{k}: {v}")
    out = tb.STATE.parent / "testbed-logs"
    out.mkdir(parents=True, exist_ok=True)
    (out / "figures.json").write_text(json.dumps(FIGURES, indent=1) + "\n")


@pytest.fixture(scope="session")
def bed():
    """The bed with Ray up on both nodes and the app served; everything removed after, also
    after a failure or Ctrl-C (and `make test-cluster` runs `down` once more on exit)."""
    tb.install_cleanup()
    t0 = time.monotonic()
    try:
        tb.up()
        FIGURES["bed_up_s"] = round(time.monotonic() - t0, 1)
        FIGURES["ray_up_s"] = round(tb.ray_up(), 1)
        FIGURES["peer_joined_after_ray_up_s"] = round(tb.wait_for_peer(), 1)
        proc = tb.serve_run()
        FIGURES["serve_run_healthy_s"] = round(tb.wait_healthy(proc=proc), 1)
        yield proc
    finally:
        t1 = time.monotonic()
        tb.down()
        FIGURES["down_s"] = round(time.monotonic() - t1, 1)
        FIGURES["bed_total_s"] = round(time.monotonic() - t0, 1)
