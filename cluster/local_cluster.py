"""A two-node Ray cluster on one machine: the real topology for the demo and the tests.

A head node carries the ``stage_local`` resource (engine and ingress), a second raylet
joins it with ``stage_peer`` (the RPC stage). Both are started with the venv's ``ray``
and stopped together. With ``pairs`` > 1, each further pair adds one raylet of each kind
(four raylets for two pairs), as two more machines would.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_PORT = 6390


def _ray_bin() -> str:
    cand = Path(sys.executable).parent / "ray"
    return str(cand) if cand.exists() else "ray"


def auth_env() -> dict[str, str]:
    """Ray 2.60's head turns token authentication on; joiners and drivers need the token."""
    env = dict(os.environ)
    token_file = Path.home() / ".ray" / "auth_token"
    if "RAY_AUTH_TOKEN" not in env and token_file.exists():
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN"] = token_file.read_text().strip()
    return env


# Serve's periodic work, which a busy node pays on every token: replicas' and routers' metrics
# flushed each second instead of every 0.1 s, the controller's loop twice a second instead of
# ten times (its reaction to a replica's death or a deploy, by a few tenths of a second). Set
# in the environment of every `ray start`, here and in the ray up configs.
SERVE_TUNING = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}


def tuned_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``SERVE_TUNING`` where it sets none of its own."""
    return {**SERVE_TUNING, **(env if env is not None else os.environ)}


def _run(args: list[str], env: dict[str, str] | None = None) -> None:
    log.info("$ %s", " ".join(args))
    subprocess.run(args, check=True, env=tuned_env(env), stdout=subprocess.DEVNULL)


def start(port: int = DEFAULT_PORT, head_cpus: int = 4, peer_cpus: int = 2, pairs: int = 1,
          node_memory: int | None = None) -> str:
    """Start the head and the peer raylet (and a local and a peer raylet per further pair);
    returns the cluster address. ``node_memory``: the memory each node states it has for a
    model (the topology's choice, deployments/topology.py), instead of the machine's."""
    ray = _ray_bin()
    # the memory a node states for a model, in MiB (the resource deployments/topology.py reads)
    extra = {"pgroups_memory_mib": node_memory >> 20} if node_memory else {}
    address = f"127.0.0.1:{port}"
    common = ["--disable-usage-stats", "--object-store-memory", str(300 * 1024 * 1024)]
    _run(
        [ray, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", f"--num-cpus={head_cpus}",
         "--resources=" + json.dumps({"stage_local": 1, **extra}), "--include-dashboard=false", *common]
    )
    env = auth_env()
    joiner = [*common, "--include-log-monitor=false"]  # one log monitor per host: the head's
    _run(
        [ray, "start", f"--address={address}", "--node-ip-address=127.0.0.1", f"--num-cpus={peer_cpus}",
         "--resources=" + json.dumps({"stage_peer": 1, **extra}), *joiner],
        env=env,
    )
    for _ in range(pairs - 1):
        for resource, cpus in (("stage_local", head_cpus // 2), ("stage_peer", peer_cpus)):
            _run([ray, "start", f"--address={address}", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
                  "--resources=" + json.dumps({resource: 1, **extra}), *joiner], env=env)
    os.environ.update({k: v for k, v in env.items() if k.startswith("RAY_AUTH")})
    _wait_nodes(address, 2 * pairs)
    return address


def _wait_nodes(address: str, n: int, timeout_s: float = 60.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    ray.init(address=address, logging_level=logging.WARNING, namespace="pipeline-groups")
    try:
        while sum(1 for x in ray.nodes() if x.get("Alive")) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(ray.nodes())} of {n} Ray nodes came up")
            time.sleep(0.5)
    finally:
        ray.shutdown()


def ingress_mode() -> str:
    """How HTTP reaches the ingress in the tests and benchmarks: ``direct`` (the ingress
    serves it, deployments/direct.py) unless ``PGROUPS_INGRESS=proxy`` asks for Serve's proxy."""
    mode = os.environ.get("PGROUPS_INGRESS", "direct")
    if mode not in ("direct", "proxy"):
        raise ValueError(f"PGROUPS_INGRESS={mode!r}: direct or proxy")
    return mode


@contextlib.contextmanager
def serve_session(port: int, http_port: int, head_cpus: int = 8, peer_cpus: int = 2, pairs: int = 1,
                  node_memory: int | None = None, ingress: str | None = None) -> Iterator[str]:
    """The two-node cluster with this process as its driver and HTTP on ``http_port`` (the
    tests and the benchmark): served by the ingress itself, or with ``ingress="proxy"`` by
    Serve's HTTP proxy on the head (default: ``ingress_mode()``); everything is stopped after."""
    import ray
    from ray import serve

    stop()
    address = start(port=port, head_cpus=head_cpus, peer_cpus=peer_cpus, pairs=pairs, node_memory=node_memory)
    ray.init(address=address, namespace="pipeline-groups", log_to_driver=False, logging_level=logging.WARNING)
    # one HTTP server, on the head: the nodes share this machine's address and the port
    location = "HeadOnly" if (ingress or ingress_mode()) == "proxy" else "Disabled"
    serve.start(proxy_location=location, http_options={"host": "127.0.0.1", "port": http_port})
    try:
        yield address
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            stop()


def stop() -> None:
    subprocess.run([_ray_bin(), "stop", "--force"], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
