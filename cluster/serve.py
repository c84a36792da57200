"""``make serve``: start the local two-node cluster, ``serve run`` a config, stop it all after.

Runs in the foreground; Ctrl-C (or SIGTERM) stops Serve, then the Ray processes it started.
With ``--address`` it serves on an existing cluster (``ray up``) and starts nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from cluster import local_cluster

GRACE_S = 40.0  # in-flight requests get the deployments' graceful shutdown time (30 s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="Serve config file, e.g. deployments/configs/local.yaml")
    p.add_argument("--address", default=None, help="existing Ray cluster; default: start a local one")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = a.address is None
    if started:
        local_cluster.stop()
        address = local_cluster.start()
    else:
        address = a.address
    env = local_cluster.auth_env()
    env["RAY_ADDRESS"] = address
    serve_bin = str(Path(sys.executable).parent / "serve")
    proc = subprocess.Popen([serve_bin, "run", a.config], env=env)

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            try:
                proc.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
        if started:
            subprocess.run([serve_bin, "shutdown", "-y"], env=env, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            local_cluster.stop()
    return rc


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    sys.exit(main())
