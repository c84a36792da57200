"""The engine actor: one ``Engine`` in a Ray Serve replica on the local node.

Requests come in as ``EngineRequest``s the ingress made (its template, its tokens:
``deployments.prompts``), are accepted here off the event loop (their checks, their grammar's
compilation) and answered with what the ingress cannot know (``deployments.contract``). Tokens
leave in per-step batches, on one long-lived output stream per ingress replica (``outputs``;
``deployments.engine_streams`` is its half). No API module runs here: ``/props`` and
``/slots`` are reported raw and shaped by the ingress.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.args import PEER_RESOURCE, RpcArgs
from deployments.contract import Embedded, Submitted
from deployments.engine_streams import EngineStreams
from deployments.errors import CLIENT_ERRORS, ApiError
from deployments.router import STATS_PERIOD_S, Route
from deployments.watchdog import LATE_POLL_S, StallJudge
from engine import (
    Engine,
    EngineConfig,
    Output,
    QueueFullError,
    RequestError,
    SlotBusyError,
)
from engine.types import SHUTTING_DOWN, EngineRequest, Fault
from observability.live import LiveFigures
from observability.metrics import EngineMetrics
from observability.process import rss_bytes
from observability.stacks import start_from_env

log = logging.getLogger(__name__)


def wait_for_endpoint(endpoint: str, timeout_s: float) -> None:
    """Block until ``host:port`` accepts TCP connections (the RPC stage is up)."""
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"RPC stage {endpoint} not reachable after {timeout_s:.0f} s: {e}") from e
            time.sleep(0.5)


def _on_peer_node() -> bool:
    """Whether this replica runs on a node with the peer stage's resource."""
    me = ray.get_runtime_context().get_node_id()
    return any(n["NodeID"] == me and PEER_RESOURCE in n.get("Resources", {}) for n in ray.nodes())


NOT_CONNECTED = "this engine replica has no output stream from the ingress (it restarted); retry the request"

# Prompts are made (templated, tokenised) and utility calls run on two bounded pools, off the
# loop that delivers every stream's tokens: small bodies on a few threads, bodies past
# LARGE_BODY_BYTES one at a time on a thread of their own, so large bodies neither take more
# than a core from the decode threads nor make a short request's prompt wait behind them.
PREPARE_THREADS = 2
LARGE_BODY_BYTES = 64 * 1024
STAGE_POLL_S = 1.0  # how often the replica asks whether its stage's server is still the one it loaded on




@serve.deployment(
    name="engine",
    num_replicas=1,
    max_ongoing_requests=100_000,
    health_check_period_s=2,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=30,
    graceful_shutdown_wait_loop_s=0.25,  # how often a stopping replica looks whether it has drained
    # pairs: prefix affinity and load across replicas, calls that name a replica go to it
    request_router_config=RequestRouterConfig(request_router_class="deployments.router:PairRouter",
                                              request_routing_stats_period_s=STATS_PERIOD_S),
)
class EngineDeployment:
    async def __init__(self, config: dict[str, Any], stage_wait_s: float = 300.0,
                       stage_timeout_s: float | None = 60.0, pair_stage: dict[str, Any] | None = None,
                       topology: dict[str, Any] | None = None, peer_cpus: list[int] | None = None,
                       stall: dict[str, float] | None = None) -> None:
        """``pair_stage`` (the app's ``rpc`` settings): this replica starts its own stage.
        ``stall``: the frozen-stage watchdog's ``factor`` and ``floor_s`` (deployments/watchdog.py).
        ``topology``: the application's shape and why (deployments/topology.py). ``peer_cpus``
        (replicas): the cores of a peer node's replica, where the stage would have run."""
        for name in ("engine", "deployments", "observability"):
            logging.getLogger(name).setLevel(logging.INFO)
        self._replica = _replica_tag()
        self._stacks = start_from_env("engine")  # a developer's profile of the host path
        self._stage = None  # a pair's own stage actor; None: the app's shared one
        if pair_stage is not None:
            from deployments.stage.actor import start_pair_stage

            self._stage, endpoint = await asyncio.to_thread(
                start_pair_stage, RpcArgs.model_validate(pair_stage), self._replica, PEER_RESOURCE)
            config = {**config, "rpc_endpoints": [*config.get("rpc_endpoints", []), endpoint]}
        self.topology = topology or {"topology": "layer_split", "reason": "configured"}
        if peer_cpus and _on_peer_node():
            config = {**config, "local_cpus": peer_cpus}
        self.config = EngineConfig.model_validate(config)
        self.loop = asyncio.get_running_loop()
        self._prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
        self._prepare_large = ThreadPoolExecutor(1, thread_name_prefix="prepare-large")
        self._failed: str | None = None  # why this replica must be replaced
        self._cache_lost = False  # its prompt cache's entries counted as lost (it failed)
        self._draining = False
        for ep in self.config.rpc_endpoints:
            await self._wait_for_stage(ep, stage_wait_s)
        loaded_under = await self._stage_server()
        self.engine: Engine = await asyncio.to_thread(Engine, self.config, self._sink_from_thread)
        # the stage server this replica's KV lives on: every slot's and prompt cache entry's
        # peer-side KV is in buffers that process allocated for this model. Another server (a
        # restart, a replacement) holds none of it, and this replica never reconnects: it fails
        # (``_watch_stage_server``) and Serve starts one that loads the model afresh
        self._stage_pid = await self._stage_server()
        if loaded_under and self._stage_pid and loaded_under != self._stage_pid:
            self._failed = f"the stage's server changed while the model loaded (pid {loaded_under} -> {self._stage_pid})"
        self.model_name = self.engine.model_name
        self.metrics = EngineMetrics(self.model_name, self._replica)
        self.out = EngineStreams(self.metrics.observe, self.engine.cancel)
        self.metrics.set_stage_up(True)
        self.metrics.set_topology(self.topology["topology"])
        self.metrics.set_load(self.engine.model.load_s, self.engine.model.released_bytes)
        self.figures = LiveFigures(self.engine, self.config, self.metrics, lambda: self._stage_health(),
                                   self._replica, self.topology)
        self.stage_timeout_s = stage_timeout_s if self.config.rpc_endpoints else None
        self._stall = StallJudge(stage_timeout_s or 60.0, **(stall or {}))
        self._watchdog = self.loop.create_task(self._watch()) if self.stage_timeout_s else None
        self._server_watch = self.loop.create_task(self._watch_stage_server()) if self._stage_pid else None
        log.info("engine replica %s serving %s", self._replica, self.model_name)

    async def _wait_for_stage(self, endpoint: str, timeout_s: float) -> None:
        """Wait until the stage listens; ask its actor rather than connect to the server."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            health = await self._stage_health()
            if health is None or health.get("missing"):
                break  # no stage actor (an external RPC server): probe the port
            if health["accepting"] and health["endpoint"] == endpoint:
                return
            await asyncio.sleep(0.2)
        await asyncio.to_thread(wait_for_endpoint, endpoint, max(1.0, deadline - time.monotonic()))

    # ---- the frozen-peer watchdog -----------------------------------------------------------

    async def _watch(self) -> None:
        """A decode judged frozen (deployments/watchdog.py: past a few times its expected step,
        with neither its thread nor the stage's server working; or past ``stage_timeout_s``)
        means the peer stopped answering with the connection still open. llama.cpp cannot be
        interrupted there, so the replica fails what it holds (the ingress resumes it
        elsewhere), asks the stage actor for a fresh server in place of the frozen one, reports
        itself unhealthy and is replaced by Serve; the new replica connects to the fresh server,
        so recovery does not wait for the frozen process to wake."""
        assert self.stage_timeout_s is not None
        judge = self._stall
        judge.ceiling_s = self.stage_timeout_s
        health: dict | None = None
        late = False
        while self._failed is None:
            # polled faster once a decode is late: its idleness is confirmed a poll later
            await asyncio.sleep(LATE_POLL_S if late else min(1.0, self.stage_timeout_s / 4))
            decodes = self.engine.decodes()
            if not decodes:
                judge.frozen([], None)
                late = False
                continue
            # the stage's CPU is asked for only while a decode has run past its limit
            late = any(d.seconds > judge.limit(d) for d in decodes)
            health = await self._stage_health() if late else None
            frozen = judge.frozen(decodes, (health or {}).get("cpu_seconds") if late else None)
            if frozen is not None:
                self._fail_replica(judge.reason(frozen), Fault.STAGE_FROZEN, "stage_frozen")
                await self._replace_stage_server(health or await self._stage_health())

    async def _stage_server(self) -> int | None:
        """The pid of the stage's server process (None: no stage actor, or it does not answer)."""
        health = await self._stage_health()
        return (health or {}).get("pid") if health and health.get("accepting") else None

    async def _watch_stage_server(self) -> None:
        """Fail the replica as soon as the stage's server is another process than the one the
        model was loaded on (killed and restarted, or replaced after a freeze), busy or idle:
        the KV of every slot and cached conversation on the peer went with the old process, so
        nothing may be restored from it, and a request arriving later is served by the next
        replica instead of failing on a dead connection first."""
        while self._failed is None:
            await asyncio.sleep(STAGE_POLL_S)
            health = await self._stage_health()
            pid = (health or {}).get("pid")
            if self._failed is None and pid and pid != self._stage_pid:
                self._fail_replica(f"the stage's server restarted (pid {self._stage_pid} -> {pid}): the KV this "
                                   "replica held on it is gone", Fault.ENGINE, "stage_restart")

    async def _replace_stage_server(self, health: dict | None) -> None:
        """Have the stage actor replace the server process that froze (``health``: the stage
        as it was when the stall was seen). A stage whose actor does not answer either (the
        whole peer node stopped) is left to come back by itself."""
        pid = (health or {}).get("pid")
        if not pid:
            return
        from deployments.stage.actor import get_stage

        try:
            stage = self._stage or get_stage()
            replaced = await asyncio.wait_for(stage.replace_server.remote(pid), timeout=5.0)
        except Exception as e:
            log.warning("the stage actor did not replace the frozen server: %s", e)
            return
        if replaced:
            log.warning("the stage's frozen server (pid %s) was replaced by a fresh one", pid)

    def _fail_replica(self, reason: str, fault: Fault, cause: str) -> None:
        log.error("%s", reason)
        self._failed = reason
        self.metrics.set_stage_up(False)
        self._lose_cache(cause)
        self.out.cut_all(reason, fault)

    def _lose_cache(self, cause: str) -> None:
        """The replica fails: the prompt cache entries it holds go with its KV (counted once)."""
        if not self._cache_lost:
            self._cache_lost = True
            n = sum(p.cache_entries for p in self.engine.profiles())
            self.metrics.count_cache_lost(cause, n)
            if n:
                log.warning("%d prompt cache entries dropped with this replica (%s)", n, cause)

    # ---- outputs ----------------------------------------------------------------------------

    def _sink_from_thread(self, outs: list[Output]) -> None:
        self.loop.call_soon_threadsafe(self.out.deliver, outs)

    async def outputs(self, ingress_id: str, conn_id: str, replica: str | None = None):
        """One ingress replica's output stream: first ``{"connected": replica}`` (or
        ``{"refused": why}`` from a replica that is stopping or is not the one asked for, and
        the end), then lists of the ``Output``s of the requests it submitted on this
        connection. When the stream ends, only this connection's requests are cancelled."""
        if replica is not None and replica != self._replica:
            yield {"refused": f"replica {replica} is gone"}  # the router's fallback for a dead target
            return
        if self._failed is not None or self._draining:
            yield {"refused": self._failed or SHUTTING_DOWN}  # the ingress retries later
            return
        async for item in self.out.serve(ingress_id, conn_id, {"connected": self._replica}):
            yield item

    # ---- requests ---------------------------------------------------------------------------

    def _off_loop(self, n_bytes: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the pool for a body of ``n_bytes`` (an awaitable)."""
        pool = self._prepare_large if n_bytes > LARGE_BODY_BYTES else self._prepare
        return self.loop.run_in_executor(pool, fn, *args)

    async def submit(self, conns: dict[str, str] | str, req: EngineRequest,
                     route: Route | None = None, n_bytes: int = 0) -> Submitted | ApiError:
        """Queue one request the ingress made (its prompt's tokens, its settings; its body was
        ``n_bytes``): what the ingress cannot know of it (this replica, its stream, its budget
        in a slot, the seed chosen for its choices), or a refusal. Its checks and its grammar's
        compilation run off the event loop that delivers every stream's tokens."""
        # the ingress's output stream to each replica it holds one to; ``route`` is the router's
        conn_id = conns.get(self._replica, "") if isinstance(conns, dict) else conns
        if self._failed is not None:
            return ApiError(503, self._failed)
        if self._draining:
            return ApiError(503, SHUTTING_DOWN)
        if conn_id not in self.out.conns:
            return ApiError(503, NOT_CONNECTED)
        try:
            r = await self._off_loop(n_bytes, self.engine.accept, req)
        except CLIENT_ERRORS as e:  # RequestError (a ValueError): the request's own 400
            return ApiError(400, str(e)[:1000] or type(e).__name__)
        ids = [m.id for m in r.family]
        conn = None if self._failed is not None or self._draining else self.out.route(conn_id, ids)
        if conn is None:
            return ApiError(503, self._failed or (SHUTTING_DOWN if self._draining else NOT_CONNECTED))
        try:
            self.engine.submit(r)
        except (QueueFullError, RuntimeError) as e:
            self.out.drop(conn, ids)
            if isinstance(e, QueueFullError):
                self.metrics.rejected()
                return ApiError(429, str(e))
            return ApiError(503, str(e))
        return Submitted(len(r.prompt_tokens), r.n_predict, self._replica, conn_id, self.engine.n_ctx_slot,
                         seed=r.params.seed if req.n > 1 else None)

    async def embed(self, inputs: list[str | list[int]], dimensions: int | None = None,
                    n_bytes: int = 0) -> Embedded | ApiError:
        """One normalised vector per input (the embedder has a context and thread of its own)."""
        e = self.engine.embedder
        if e is None:
            return ApiError(501, "this server does not serve embeddings: set embeddings: true in its config "
                            "(llama-server's --embeddings)")
        if dimensions is not None and dimensions != e.n_embd:
            return ApiError(400, f"dimensions must be the model's own, {e.n_embd} (vectors are not cut)", "dimensions")
        try:
            vectors, n = await self._off_loop(n_bytes, self.engine.embed, inputs)
        except CLIENT_ERRORS as err:
            return ApiError(400, str(err)[:1000] or type(err).__name__)
        return Embedded(vectors, n)

    async def props(self) -> dict:
        """What llama-server's ``/props`` reads of this replica (the ingress shapes it)."""
        return {"config": self.config, "n_ctx_slot": self.engine.n_ctx_slot, "model_name": self.engine.model_name,
                "devices": self.engine.devices, "topology": self.topology, "modalities": self.engine.modalities}

    async def drain(self, grace_s: float, replica: str | None = None) -> dict:
        """Stop taking requests; give running ones ``grace_s`` to finish, then end the rest
        with a shutting-down error. Called before a shutdown so that it is quick."""
        self._draining = True
        deadline = time.monotonic() + grace_s
        while self.out.owner and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for rid in list(self.out.owner):
            self.engine.cancel(rid)
        # cancelled, but their clients are still there: they get an error
        return {"cut": self.out.cut_all(SHUTTING_DOWN, Fault.SHUTDOWN)}

    def tables(self) -> dict:
        """Sizes of every per-request table (a leak shows here)."""
        running, waiting = self.engine.scheduler.counts()
        return {
            "owners": len(self.out.owner),
            "connections": len(self.out.conns),
            "connection_requests": sum(len(c.requests) for c in self.out.conns.values()),
            "running": running,
            "waiting": waiting,
            "active_slots": sum(len(g.active) for g in self.engine.groups),
            "rss_bytes": rss_bytes(os.getpid()),
            "replica": self._replica,
        }

    async def cancel(self, request_id: str, n: int = 1, replica: str | None = None) -> bool:
        """Cancel a request and its other choices (``replica``: routing only)."""
        hit = self.engine.cancel(request_id)  # a family still waiting goes whole
        for i in range(1, n):
            hit = self.engine.cancel(f"{request_id}#{i}") or hit
        return hit

    # ---- state ------------------------------------------------------------------------------

    async def info(self, replica: str | None = None) -> dict:
        return {
            # only inside Ray: asking outside it would start a local Ray instance
            "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
            "model": self.model_name,
            "n_ctx_slot": self.engine.n_ctx_slot,
            "n_parallel": self.config.n_parallel,
            "pipeline_groups": self.config.pipeline_groups,
            "devices": self.engine.devices,
            "n_vocab": self.engine.model.n_vocab,
            "modalities": self.engine.modalities,
            "meta": {**self.engine.model.meta(), "n_ctx": self.engine.n_ctx_slot},
            "speculative": self.config.speculative.model_dump() if self.config.speculative else None,
            "healthy": self.engine.healthy and self._failed is None,
            "replica": self._replica,
            "topology": self.topology["topology"],
            "pid": os.getpid(),
            # what the ingress makes prompts with (deployments/prompts.py): the model's vocabulary
            # and template, and a slot's size
            "model_path": self.config.model, "chat_template": self.config.chat_template,
            "chat_template_file": self.config.chat_template_file,
            "n_slots_per_group": self.config.n_slots_per_group, "n_batch": self.config.n_batch,
        }

    async def slots(self, replica: str | None = None) -> dict:
        """What llama-server's ``/slots`` reads of this replica (the ingress shapes it)."""
        views = [{k: getattr(v, k) for k in ("id", "group", "seq_id", "state", "n_cached", "request_id")}
                 for v in self.engine.slot_views()]
        return {"slots": views, "n_ctx_slot": self.engine.n_ctx_slot, "speculative": self.config.speculative is not None,
                "replica": self._replica, "prompt_cache": self.figures.caches()}

    async def slot_action(self, slot_id: int, action: str, filename: str | None,
                          replica: str | None = None) -> dict | ApiError:
        try:
            return await asyncio.to_thread(self.engine.slot_action, slot_id, action, filename)
        except RequestError as e:
            return ApiError(400, str(e))
        except SlotBusyError as e:
            return ApiError(409, str(e))
        except FileNotFoundError as e:
            return ApiError(404, str(e))
        except TimeoutError as e:
            return ApiError(504, str(e))
        except RuntimeError as e:  # the group failed the action (e.g. a corrupt slot file)
            return ApiError(500, str(e))

    async def metrics_text(self, replica: str | None = None) -> bytes:
        return await self.figures.scrape()

    async def pipeline(self, replica: str | None = None) -> dict[str, Any]:
        return await self.figures.page()

    async def _stage_health(self) -> dict | None:
        if not self.config.rpc_endpoints:
            return None
        from deployments.stage.actor import get_stage

        try:
            stage = self._stage or get_stage()
        except ValueError:
            return {"missing": True, "accepting": False, "cpu_seconds": 0.0, "threads": 1}
        try:
            return await asyncio.wait_for(stage.health.remote(), timeout=2.0)
        except Exception:
            return {"accepting": False, "cpu_seconds": 0.0, "threads": 1, "endpoint": ""}

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router weighs replicas by (Serve polls it)."""
        running, waiting = self.engine.scheduler.counts()
        return {"running": running, "waiting": waiting, "slots": self.config.n_parallel}

    def check_health(self) -> None:
        if self._failed is not None:
            raise RuntimeError(self._failed)
        problem = self.engine.problem()
        if problem is not None:
            self._lose_cache("engine_failed")
            raise RuntimeError(f"engine unhealthy: {problem}")

    def __del__(self) -> None:
        eng = getattr(self, "engine", None)
        if eng is not None:
            # a stalled decode never returns: do not wait for its group
            eng.close(timeout=1.0 if self._failed else 30.0)


def _replica_tag() -> str:
    try:
        ctx = serve.get_replica_context()
    except Exception:
        return "local"
    rid = getattr(ctx, "replica_id", None)
    return str(getattr(rid, "unique_id", None) or getattr(ctx, "replica_tag", "0"))
