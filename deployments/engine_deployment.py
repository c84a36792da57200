"""The engine actor: one ``Engine`` in a Ray Serve replica on the local node.

Tokens leave it in per-step batches: each ingress replica holds one long-lived stream
(``outputs``) that carries the outputs of every request it submitted, as many steps as
have accumulated since its last read in one item. A Ray item costs about a millisecond of
CPU, so one item per token per request would cost more than the model on a small box.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import defaultdict
from typing import Any

from ray import serve

from deployments.protocol import ChatCompletionRequest, CompletionRequest
from engine import Engine, EngineConfig, Output, QueueFullError, RequestError, SlotBusyError
from observability.metrics import EngineMetrics
from observability.process import rss_bytes

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


def error(kind: str, message: str, status: int, **extra: Any) -> dict:
    return {"error": {"type": kind, "message": message, "status": status, **extra}}


@serve.deployment(
    name="engine",
    num_replicas=1,
    max_ongoing_requests=100_000,
    health_check_period_s=2,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=30,
)
class EngineDeployment:
    async def __init__(self, config: dict[str, Any], stage_wait_s: float = 300.0) -> None:
        for name in ("engine", "deployments", "observability"):
            logging.getLogger(name).setLevel(logging.INFO)
        self.config = EngineConfig.model_validate(config)
        self.loop = asyncio.get_running_loop()
        self._owner: dict[str, str] = {}  # request id -> ingress id
        self._queues: dict[str, asyncio.Queue] = defaultdict(asyncio.Queue)
        for ep in self.config.rpc_endpoints:
            await self._wait_for_stage(ep, stage_wait_s)
        self.engine: Engine = await asyncio.to_thread(Engine, self.config, self._sink_from_thread)
        self.model_name = self.engine.model_name
        self._replica = _replica_tag()
        self.metrics = EngineMetrics(self.model_name, self._replica)
        self.metrics.set_stage_up(True)
        self._last_busy: tuple[float, float, float | None] | None = None
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

    # ---- outputs ----------------------------------------------------------------------------

    def _sink_from_thread(self, outs: list[Output]) -> None:
        self.loop.call_soon_threadsafe(self._deliver, outs)

    def _deliver(self, outs: list[Output]) -> None:
        per_ingress: dict[str, list[tuple]] = defaultdict(list)
        for o in outs:
            ing = self._owner.get(o.request_id)
            if o.finish_reason is not None:
                self._owner.pop(o.request_id, None)
            self.metrics.observe(o)
            if ing is not None:
                per_ingress[ing].append(tuple(o))
        for ing, items in per_ingress.items():
            self._queues[ing].put_nowait(items)

    async def outputs(self, ingress_id: str):
        """Stream of lists of outputs (as tuples) for every request of one ingress replica."""
        q = self._queues[ingress_id]
        try:
            while True:
                batch = await q.get()
                while not q.empty():
                    batch.extend(q.get_nowait())
                yield batch
        finally:
            self._queues.pop(ingress_id, None)
            for rid, ing in list(self._owner.items()):
                if ing == ingress_id:
                    self.engine.cancel(rid)

    # ---- requests ---------------------------------------------------------------------------

    async def submit(self, ingress_id: str, request_id: str, kind: str, body: dict) -> dict:
        """Validate, tokenise and queue one request; returns its prompt size or an error."""
        try:
            if kind == "chat":
                req = ChatCompletionRequest.model_validate(body)
                prompt: str | list[int] = self.engine.tokenizer.apply_chat_template(
                    req.template_messages(), kwargs=req.chat_template_kwargs
                )
                params = req.sampling(self._default_max_tokens(), req.max_completion_tokens)
            else:
                req = CompletionRequest.model_validate(body)
                prompt = req.prompt  # type: ignore[assignment]
                params = req.sampling(self._default_max_tokens())
            r = self.engine.make_request(prompt, params, request_id)
        except (ValueError, RequestError) as e:
            return error("invalid_request_error", str(e), 400)
        self._owner[request_id] = ingress_id
        self._queues[ingress_id]  # the stream may open after the first outputs
        try:
            self.engine.submit(r)
        except QueueFullError as e:
            self._owner.pop(request_id, None)
            self.metrics.rejected()
            return error("rate_limit_error", str(e), 429)
        except RuntimeError as e:
            self._owner.pop(request_id, None)
            return error("server_error", str(e), 503)
        return {"prompt_tokens": len(r.prompt_tokens), "n_predict": r.n_predict}

    def _default_max_tokens(self) -> int:
        # OpenAI's meaning of a missing max_tokens: until the slot's context is full
        return self.engine.n_ctx_slot

    async def cancel(self, request_id: str) -> bool:
        return self.engine.cancel(request_id)

    # ---- state ------------------------------------------------------------------------------

    async def info(self) -> dict:
        return {
            "model": self.model_name,
            "n_ctx_slot": self.engine.n_ctx_slot,
            "n_parallel": self.config.n_parallel,
            "pipeline_groups": self.config.pipeline_groups,
            "devices": self.engine.devices,
            "n_vocab": self.engine.model.n_vocab,
            "healthy": self.engine.healthy,
            "replica": self._replica,
        }

    async def slots(self) -> list[dict]:
        return [
            {
                "id": v.id,
                "group": v.group,
                "seq_id": v.seq_id,
                "state": v.state,
                "is_processing": v.state != "idle",
                "n_cached_tokens": v.n_cached,
                "id_task": v.request_id,
            }
            for v in self.engine.slot_views()
        ]

    async def slot_action(self, slot_id: int, action: str, filename: str | None) -> dict:
        try:
            return await asyncio.to_thread(self.engine.slot_action, slot_id, action, filename)
        except RequestError as e:
            return error("invalid_request_error", str(e), 400)
        except SlotBusyError as e:
            return error("invalid_request_error", str(e), 409)
        except FileNotFoundError as e:
            return error("not_found_error", str(e), 404)

    async def metrics_text(self) -> bytes:
        running, waiting = self.engine.scheduler.counts()
        self.metrics.collect_engine(self.engine, running, waiting)
        await self._collect_stages()
        return self.metrics.render()

    async def _collect_stages(self) -> None:
        """Stage busy since the last scrape: CPU seconds over wall seconds and threads."""
        now = time.monotonic()
        local_cpu = sum(p.decode_cpu for p in self.engine.profiles())
        peer = await self._stage_health()
        last = self._last_busy
        self.metrics.set_stage_rss("local", rss_bytes(os.getpid()))
        if peer is not None:
            self.metrics.set_stage_up(bool(peer["accepting"]))
            self.metrics.set_stage_rss("peer", int(peer.get("rss_bytes", 0)))
        if last is not None:
            dt = max(now - last[0], 1e-9)
            self.metrics.set_stage_busy("local", (local_cpu - last[1]) / dt / self.config.local_threads())
            if peer is not None and last[2] is not None:
                self.metrics.set_stage_busy("peer", (peer["cpu_seconds"] - last[2]) / dt / peer["threads"])
        self._last_busy = (now, local_cpu, peer["cpu_seconds"] if peer else None)

    async def _stage_health(self) -> dict | None:
        if not self.config.rpc_endpoints:
            return None
        from cluster.rpc_stage import get_stage

        try:
            stage = get_stage()
        except ValueError:
            return {"missing": True, "accepting": False, "cpu_seconds": 0.0, "threads": 1}
        try:
            return await asyncio.wait_for(stage.health.remote(), timeout=2.0)
        except Exception:
            return {"accepting": False, "cpu_seconds": 0.0, "threads": 1, "endpoint": ""}

    def check_health(self) -> None:
        if not self.engine.healthy:
            raise RuntimeError("engine unhealthy: a pipeline group stopped")

    def __del__(self) -> None:
        eng = getattr(self, "engine", None)
        if eng is not None:
            eng.close()


def _replica_tag() -> str:
    try:
        ctx = serve.get_replica_context()
    except Exception:
        return "local"
    rid = getattr(ctx, "replica_id", None)
    return str(getattr(rid, "unique_id", None) or getattr(ctx, "replica_tag", "0"))
