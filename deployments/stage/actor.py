"""The peer stage as a Ray actor: supervises a ggml RPC server process on its node.

The server runs in a child process so that a crash is contained; the actor restarts it
when it exits and answers health checks. ``start_stage`` (called by the app builder)
places the actor on the node with the ``stage_peer`` resource, picks the address to bind,
and waits until the server accepts connections.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from typing import Any

import ray

from deployments.stage import server as rpc_server
from deployments.stage.server import port_listening
from observability.gpu import node_meter
from observability.process import cpu_seconds, rss_bytes

log = logging.getLogger(__name__)

STAGE_NAME = "pgroups-rpc-stage"
NAMESPACE = "pipeline-groups"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class RpcStage:
    def __init__(self, host: str | None, port: int, threads: int, devices: list[str] | None, cache_dir: str | None,
                 cpus: list[int] | None = None):
        # a pair's stage: its own node's address, and a free port (two stages may share a machine)
        host = host or ray.util.get_node_ip_address()
        port = port or _free_port(host)
        self.host, self.port = host, port
        self._settings = _settings(host, port, threads, devices, cache_dir, cpus)
        self.threads = threads or (os.cpu_count() or 1)
        self.cmd = rpc_server.command(host, port, threads, devices, cache_dir, cpus)
        self.restarts = 0
        self.started_at = 0.0
        self._stopping = False
        self._lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self._spawned = threading.Event()
        # PDEATHSIG fires when the spawning thread ends, so one long-lived thread spawns them all
        threading.Thread(target=self._supervise, daemon=True, name="rpc-stage-supervisor").start()
        self._spawned.wait(30)

    def _spawn(self) -> None:
        with self._lock:
            # the server prints a line per connection; keep only its errors
            self.proc = subprocess.Popen(
                self.cmd, env=dict(os.environ), stdout=subprocess.DEVNULL, preexec_fn=rpc_server.die_with_parent
            )
            self.started_at = time.monotonic()
        log.info("rpc stage pid %d: %s", self.proc.pid, " ".join(self.cmd))

    def _supervise(self) -> None:
        self._spawn()
        self._spawned.set()
        backoff = 0.2
        while not self._stopping:
            rc = self.proc.wait()
            if self._stopping:
                return
            # a server that dies at once (port taken) is retried slower and slower
            quick = time.monotonic() - self.started_at < 5.0
            backoff = min(backoff * 2, 10.0) if quick else 0.2
            log.warning("rpc server exited with %s; restarting in %.1f s", rc, backoff)
            self.restarts += 1
            time.sleep(backoff)
            self._spawn()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def settings(self) -> dict[str, Any]:
        return self._settings

    def ready(self, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not (self.proc.poll() is None and port_listening(self.port)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"RPC stage {self.endpoint()} did not start in {timeout_s} s")
            time.sleep(0.1)
        return self.endpoint()

    def health(self) -> dict[str, Any]:
        alive = self.proc is not None and self.proc.poll() is None
        return {
            "alive": alive,
            "accepting": alive and port_listening(self.port),
            "pid": self.proc.pid if self.proc else None,
            "restarts": self.restarts,
            "endpoint": self.endpoint(),
            "threads": self.threads,
            "rss_bytes": rss_bytes(self.proc.pid) if alive else 0,
            "cpu_seconds": cpu_seconds(self.proc.pid) if alive else 0.0,
            "gpu_busy": node_meter().busy(),  # the peer node's GPUs; None on a CPU node
        }

    def kill_server(self) -> int | None:
        """Fault injection (the soak, tests): SIGKILL the server; the supervisor restarts it."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None
        proc.kill()
        return proc.pid

    def replace_server(self, pid: int) -> bool:
        """The engine's watchdog found the server ``pid`` frozen: SIGKILL it (a stopped process
        dies too) so that the supervisor starts a fresh one at once, and the engine's next
        replica connects to a server that answers instead of waiting for this one to wake.
        False when ``pid`` is no longer the server (already replaced)."""
        proc = self.proc
        if proc is None or proc.pid != pid or proc.poll() is not None:
            return False
        log.warning("rpc server pid %d did not answer the engine; replacing it", pid)
        proc.kill()
        return True

    def stop(self) -> None:
        self._stopping = True
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _node_ips_with(resource: str) -> list[str]:
    return [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get(resource, 0) > 0]


def choose_host(rpc_host: str | None, peer_resource: str | None, local_resource: str) -> str:
    """The address the stage binds: given, else the peer's private address, else loopback."""
    if rpc_host:
        return rpc_host
    peers = _node_ips_with(peer_resource) if peer_resource else []
    locals_ = _node_ips_with(local_resource)
    if not peers or (locals_ and peers[0] in locals_):
        return "127.0.0.1"
    return peers[0]


def _settings(host: str, port: int, threads: int, devices: list[str] | None, cache_dir: str | None,
              cpus: list[int] | None) -> dict[str, Any]:
    return {"host": host, "port": port, "threads": threads, "devices": list(devices or []),
            "cache_dir": cache_dir, "cpus": list(cpus or [])}


def start_stage(rpc: Any, peer_resource: str | None, local_resource: str) -> str:
    """Start the stage actor, or reuse the running one when its settings are these; a stage
    started with other settings is stopped and replaced. Returns the endpoint once it
    accepts connections."""
    host = choose_host(rpc.host, peer_resource, local_resource)
    args = (host, rpc.port, rpc.threads, rpc.devices, rpc.cache_dir, rpc.cpus)
    want = _settings(*args)
    try:
        old = get_stage()
    except ValueError:
        old = None
    if old is not None:
        try:
            have = ray.get(old.settings.remote(), timeout=30)
        except Exception as e:  # an unresponsive or older stage: replace it
            have = {"error": str(e)}
        if have != want:
            log.info("the RPC stage runs with %s; restarting it with %s", have, want)
            stop_stage(old)
    opts: dict[str, Any] = {"name": STAGE_NAME, "namespace": NAMESPACE, "lifetime": "detached", "get_if_exists": True}
    if peer_resource and ray.cluster_resources().get(peer_resource, 0) > 0:
        opts["resources"] = {peer_resource: 0.01}
    stage = RpcStage.options(**opts).remote(*args)
    endpoint = ray.get(stage.ready.remote(rpc.start_timeout_s), timeout=rpc.start_timeout_s + 30)
    log.info("RPC stage ready at %s", endpoint)
    return endpoint


def start_pair_stage(rpc: Any, replica: str, peer_resource: str) -> tuple[Any, str]:
    """The stage of one pair, started by its engine replica: named after the replica, owned
    by it (it dies with it), placed in the replica's placement group's second bundle (the
    peer node) when Serve gave it one. Returns the actor and its endpoint once it accepts."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    opts: dict[str, Any] = {"name": f"{STAGE_NAME}-{replica}", "namespace": NAMESPACE, "max_restarts": 0}
    pg = ray.util.get_current_placement_group()
    if pg is not None and len(pg.bundle_specs) > 1:
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1)
        if pg.bundle_specs[1].get(peer_resource):
            opts["resources"] = {peer_resource: 0.01}
    elif ray.cluster_resources().get(peer_resource, 0) > 0:
        opts["resources"] = {peer_resource: 0.01}
    stage = RpcStage.options(**opts).remote(None, 0, rpc.threads, rpc.devices, rpc.cache_dir, rpc.cpus)
    endpoint = ray.get(stage.ready.remote(rpc.start_timeout_s), timeout=rpc.start_timeout_s + 30)
    log.info("pair stage of replica %s ready at %s", replica, endpoint)
    return stage, endpoint


def stop_stage(stage: Any | None = None, timeout_s: float = 30.0) -> None:
    """Stop the stage's server, remove the actor, and wait until its name is free."""
    if stage is None:
        try:
            stage = get_stage()
        except ValueError:
            return
    try:
        ray.get(stage.stop.remote(), timeout=10)
    except Exception:  # killed below either way
        pass
    ray.kill(stage, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            get_stage()
        except ValueError:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the RPC stage actor {STAGE_NAME} did not go away in {timeout_s:.0f} s")


def get_stage() -> Any:
    return ray.get_actor(STAGE_NAME, namespace=NAMESPACE)
