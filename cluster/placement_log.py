"""A Ray worker setup hook that writes llama.cpp's layer placement and buffer sizes to the
worker's stderr log (``runtime_env: {env_vars: {__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR:
cluster.placement_log.log_llama_placement}}``): where each layer of a split went, on a real pair
as on the two-host test bed (tests/cluster/testbed.py), whose tests read it."""

from __future__ import annotations

import logging


def log_llama_placement() -> None:
    """Worker setup hook (the bed's serve config): llama.cpp's placement and buffer lines to the
    worker's stderr log, which the tests read."""
    class _Placement(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            m = record.getMessage()
            return "assigned to device" in m or "buffer size" in m

    h = logging.StreamHandler(open(2, "w", closefd=False))
    h.addFilter(_Placement())
    h.setFormatter(logging.Formatter("llama.cpp: %(message)s"))
    lg = logging.getLogger("llama_cpp.native")
    lg.setLevel(logging.DEBUG)
    lg.addHandler(h)
