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
from collections.abc import Callable
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.protocol import (
    ApiError,
    ApiRequest,
    ApplyTemplateRequest,
    ChatCompletionRequest,
    DetokenizeRequest,
    Embedded,
    EmbeddingRequest,
    InfillRequest,
    Submitted,
    TokenizeRequest,
    ToolSettings,
    piece_json,
)
from deployments.router import STATS_PERIOD_S, Route
from engine import (
    Engine,
    EngineConfig,
    Output,
    QueueFullError,
    RequestError,
    SamplingParams,
    SlotBusyError,
)
from engine.infill import infill_tokens
from engine.reasoning import ReasoningPlan
from engine.tokenizer import Tokenizer
from engine.tools import ToolPlan
from engine.types import SHUTTING_DOWN, FinishReason, Request
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


def _on_peer_node() -> bool:
    """Whether this replica runs on a node with the peer stage's resource."""
    from deployments.app import PEER_RESOURCE

    me = ray.get_runtime_context().get_node_id()
    return any(n["NodeID"] == me and PEER_RESOURCE in n.get("Resources", {}) for n in ray.nodes())


NOT_CONNECTED = "this engine replica has no output stream from the ingress (it restarted); retry the request"


def chat_prompt(tokenizer: Tokenizer, req: ChatCompletionRequest,
                default_max_tokens: int) -> tuple[str, SamplingParams, ToolPlan]:
    """A chat request's prompt (its tools in it, as its template takes them), its sampling
    (a forced tool call's grammar in it) and its tool plan."""
    plan = ToolPlan.make(tokenizer.template.source, tokenizer.template.builtin, req.tools, req.tool_choice,
                         req.parallel_tool_calls)
    prompt = tokenizer.apply_chat_template(plan.messages(req.template_messages()), tools=plan.template_tools(),
                                           kwargs=req.template_kwargs())
    params = req.sampling(default_max_tokens, req.max_completion_tokens)
    grammar = plan.grammar()
    if grammar is not None:
        params = params.model_copy(update={"grammar": grammar})
    return prompt, params, plan


class _Conn:
    """One output stream to one ingress replica: its queue and the requests it carries."""

    def __init__(self, ingress_id: str, conn_id: str) -> None:
        self.ingress_id, self.id = ingress_id, conn_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.requests: set[str] = set()


_CLOSE = object()  # ends an output stream


@serve.deployment(
    name="engine",
    num_replicas=1,
    max_ongoing_requests=100_000,
    health_check_period_s=2,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=30,
    # pairs: prefix affinity and load across replicas, calls that name a replica go to it
    request_router_config=RequestRouterConfig(request_router_class="deployments.router:PairRouter",
                                              request_routing_stats_period_s=STATS_PERIOD_S),
)
class EngineDeployment:
    async def __init__(self, config: dict[str, Any], stage_wait_s: float = 300.0,
                       stage_timeout_s: float | None = 60.0, pair_stage: dict[str, Any] | None = None,
                       topology: dict[str, Any] | None = None, peer_cpus: list[int] | None = None) -> None:
        """``pair_stage`` (the app's ``rpc`` settings): this replica starts its own stage.
        ``topology``: the application's shape and why (deployments/topology.py). ``peer_cpus``
        (replicas): the cores of a peer node's replica, where the stage would have run."""
        for name in ("engine", "deployments", "observability"):
            logging.getLogger(name).setLevel(logging.INFO)
        self._replica = _replica_tag()
        self._stage = None  # a pair's own stage actor; None: the app's shared one
        if pair_stage is not None:
            from cluster.rpc_stage import start_pair_stage
            from deployments.app import PEER_RESOURCE, RpcArgs

            self._stage, endpoint = await asyncio.to_thread(
                start_pair_stage, RpcArgs.model_validate(pair_stage), self._replica, PEER_RESOURCE)
            config = {**config, "rpc_endpoints": [*config.get("rpc_endpoints", []), endpoint]}
        self.topology = topology or {"topology": "layer_split", "reason": "configured"}
        if peer_cpus and _on_peer_node():
            config = {**config, "local_cpus": peer_cpus}
        self.config = EngineConfig.model_validate(config)
        self.loop = asyncio.get_running_loop()
        self._owner: dict[str, _Conn] = {}  # request id -> the stream its outputs go to
        self._conns: dict[str, _Conn] = {}  # connection id -> stream
        self._failed: str | None = None  # why this replica must be replaced
        self._draining = False
        for ep in self.config.rpc_endpoints:
            await self._wait_for_stage(ep, stage_wait_s)
        self.engine: Engine = await asyncio.to_thread(Engine, self.config, self._sink_from_thread)
        self.model_name = self.engine.model_name
        self.metrics = EngineMetrics(self.model_name, self._replica)
        self.metrics.set_stage_up(True)
        self.metrics.set_topology(self.topology["topology"])
        self._last_busy: tuple[float, float, float | None] | None = None
        self.stage_timeout_s = stage_timeout_s if self.config.rpc_endpoints else None
        self._watchdog = self.loop.create_task(self._watch()) if self.stage_timeout_s else None
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
        """A decode that has not returned for ``stage_timeout_s`` means the peer stopped
        answering with the connection still open. llama.cpp cannot be interrupted there, so
        the replica fails what it holds, reports itself unhealthy and is replaced by Serve;
        the new replica connects when the stage answers again."""
        assert self.stage_timeout_s is not None
        while self._failed is None:
            await asyncio.sleep(min(1.0, self.stage_timeout_s / 4))
            stalled = self.engine.stalled_for()
            if stalled > self.stage_timeout_s:
                self._fail_replica(
                    f"the RPC stage did not answer for {stalled:.0f} s (stage_timeout_s "
                    f"{self.stage_timeout_s:.0f}); the engine replica restarts"
                )

    def _fail_replica(self, reason: str) -> None:
        log.error("%s", reason)
        self._failed = reason
        self.metrics.set_stage_up(False)
        self._cut_all(reason)

    def _cut_all(self, reason: str) -> int:
        """End every request this replica holds with a 503 towards its client, and close every
        output stream (Serve's drain of this replica must not wait on them)."""
        cut = list(self._owner.items())
        for rid, conn in cut:
            conn.requests.discard(rid)
            conn.queue.put_nowait([Output(rid, "", 0, FinishReason.ERROR, error=reason, status=503)])
        self._owner.clear()
        for conn in self._conns.values():
            conn.queue.put_nowait(_CLOSE)
        return len(cut)

    # ---- outputs ----------------------------------------------------------------------------

    def _sink_from_thread(self, outs: list[Output]) -> None:
        self.loop.call_soon_threadsafe(self._deliver, outs)

    def _deliver(self, outs: list[Output]) -> None:
        per_conn: dict[_Conn, list[Output]] = defaultdict(list)
        for o in outs:
            conn = self._owner.get(o.request_id)
            if o.finish_reason is not None:
                self._owner.pop(o.request_id, None)
                if conn is not None:
                    conn.requests.discard(o.request_id)
            self.metrics.observe(o)
            if conn is not None:
                per_conn[conn].append(o)
        for conn, items in per_conn.items():
            conn.queue.put_nowait(items)

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
        conn = self._conns[conn_id] = _Conn(ingress_id, conn_id)
        q = conn.queue
        try:
            yield {"connected": self._replica}
            while True:
                batch = await q.get()
                if batch is _CLOSE:
                    return
                while not q.empty():
                    more = q.get_nowait()
                    if more is _CLOSE:
                        yield batch
                        return
                    batch.extend(more)
                yield batch
        finally:
            if self._conns.get(conn_id) is conn:
                del self._conns[conn_id]
            for rid in list(conn.requests):
                self._owner.pop(rid, None)
                self.engine.cancel(rid)
            conn.requests.clear()

    async def close_stream(self, conn_id: str, replica: str | None = None) -> bool:
        """End one output stream (its ingress replica is stopping); its requests are cancelled."""
        conn = self._conns.get(conn_id)
        if conn is not None:
            conn.queue.put_nowait(_CLOSE)
        return conn is not None

    # ---- requests ---------------------------------------------------------------------------

    async def submit(self, conns: dict[str, str] | str, request_id: str, req: ApiRequest,
                     route: Route | None = None) -> Submitted | ApiError:
        """Tokenise and queue one request the ingress has validated; returns its prompt size
        (and what the ingress needs to shape its answer) or an error. The chat template and
        the tokenizer run off the event loop that delivers every stream's tokens."""
        # the ingress's output stream to each replica it holds one to; ``route`` is the router's
        conn_id = conns.get(self._replica, "") if isinstance(conns, dict) else conns
        if self._failed is not None:
            return ApiError(503, self._failed)
        if self._draining:
            return ApiError(503, SHUTTING_DOWN)
        if conn_id not in self._conns:
            return ApiError(503, NOT_CONNECTED)
        try:
            r, extra = await asyncio.to_thread(self._prepare, request_id, req)
        except (ValueError, RequestError) as e:
            return ApiError(400, str(e))
        conn = self._conns.get(conn_id)
        if conn is None or self._failed is not None or self._draining:
            return ApiError(503, self._failed or (SHUTTING_DOWN if self._draining else NOT_CONNECTED))
        ids = [m.id for m in r.family]
        for m in ids:
            self._owner[m] = conn
            conn.requests.add(m)
        try:
            self.engine.submit(r)
        except (QueueFullError, RuntimeError) as e:
            for m in ids:
                self._owner.pop(m, None)
                conn.requests.discard(m)
            if isinstance(e, QueueFullError):
                self.metrics.rejected()
                return ApiError(429, str(e))
            return ApiError(503, str(e))
        return Submitted(len(r.prompt_tokens), r.n_predict, self._replica, conn_id, self.engine.n_ctx_slot, **extra)

    def _prepare(self, request_id: str, req: ApiRequest) -> tuple[Request, dict[str, Any]]:
        """The engine request, and for the ingress: the echoed prompt, the tool-call parser's
        settings."""
        extra: dict[str, Any] = {}
        if isinstance(req, ChatCompletionRequest):
            prompt, params, plan = chat_prompt(self.engine.tokenizer, req, self._default_max_tokens())
            if plan.active:
                extra["tools"] = ToolSettings(tuple(plan.names), plan.parallel)
            thinking = ReasoningPlan.make(req.reasoning_format, self.engine.tokenizer.template.source or "", prompt)
            if thinking is not None:
                extra["reasoning"] = thinking
            return self.engine.make_request(prompt, params, request_id, cache_prompt=req.cache_prompt, n=req.n,
                                            id_slot=req.id_slot), extra
        prompt = req.prompt
        params = req.sampling(self._default_max_tokens())
        n_cmpl, most = getattr(req, "n_cmpl", 1), self.config.n_slots_per_group
        if n_cmpl > most:  # llama-server's words: llama.vscode reads them and asks for fewer
            raise RequestError(f"Field 'n_cmpl': Value must be between 1 and {most} (the slots of one pipeline group)")
        if isinstance(req, InfillRequest):
            asked = max(req.n_predict or 0, req.max_tokens or 0, 0)
            prompt = infill_tokens(self.engine.tokenizer, req.input_prefix, req.input_suffix, req.prompt, req.extra(),
                                   self.config.n_batch, self.engine.n_ctx_slot, asked)
        r = self.engine.make_request(prompt, params, request_id, cache_prompt=req.cache_prompt, n=req.n,
                                     id_slot=req.id_slot)
        if req.echo:  # after make_request: token ids are checked there (400), not decoded blind
            extra["echo"] = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)
        return r, extra

    # ---- llama-server's utility endpoints (off the event loop: inputs can be large) -----------

    async def embed(self, req: EmbeddingRequest) -> Embedded | ApiError:
        """Embeddings of the request's inputs (off the event loop; one context, its own thread)."""
        if self.engine.embedder is None:
            return ApiError(501, "this server does not serve embeddings: set embeddings: true in its config "
                            "(llama-server's --embeddings)")
        n_embd = self.engine.embedder.n_embd
        if req.dimensions is not None and req.dimensions != n_embd:
            return ApiError(400, f"dimensions must be the model's own, {n_embd} (vectors are not cut)")
        try:
            vectors, n = await asyncio.to_thread(self.engine.embed, req.inputs())
        except RequestError as e:
            return ApiError(400, str(e))
        return Embedded(vectors, n)

    async def count_tokens(self, req: ChatCompletionRequest) -> dict | ApiError:
        """Anthropic's count_tokens: the prompt tokens the chat request would have."""
        def work() -> dict:
            prompt, _, _ = chat_prompt(self.engine.tokenizer, req, self._default_max_tokens())
            return {"input_tokens": len(self.engine.tokenize_prompt(prompt))}

        return await self._utility(work)

    async def tokenize(self, body: dict) -> dict | ApiError:
        def work() -> dict:
            req = TokenizeRequest.model_validate(body)
            toks = self.engine.tokenizer.encode(req.content, add_special=req.add_special,
                                                parse_special=req.parse_special)
            if not req.with_pieces:
                return {"tokens": toks}
            return {"tokens": [{"id": t, "piece": piece_json(self.engine.tokenizer.piece(t))} for t in toks]}

        return await self._utility(work)

    async def detokenize(self, body: dict) -> dict | ApiError:
        def work() -> dict:
            req = DetokenizeRequest.model_validate(body)
            bad = [t for t in req.tokens if not 0 <= t < self.engine.model.n_vocab]
            if bad:
                raise RequestError(f"token ids out of range [0, {self.engine.model.n_vocab}): {bad[:5]}")
            return {"content": self.engine.tokenizer.decode(req.tokens)}

        return await self._utility(work)

    async def apply_template(self, body: dict) -> dict | ApiError:
        def work() -> dict:
            req = ApplyTemplateRequest.model_validate(body)
            text = self.engine.tokenizer.apply_chat_template(req.template_messages(), kwargs=req.chat_template_kwargs)
            return {"prompt": text}

        return await self._utility(work)

    async def _utility(self, work: Callable[[], dict]) -> dict | ApiError:
        try:
            return await asyncio.to_thread(work)
        except ValueError as e:  # pydantic's ValidationError, RequestError, TemplateError
            return ApiError(400, str(e))

    async def props(self) -> dict:
        tok = self.engine.tokenizer
        return {
            "model_alias": self.model_name,
            "model_path": self.config.model,
            "total_slots": self.config.n_parallel,
            "pipeline_groups": self.config.pipeline_groups,
            "default_generation_settings": {
                "n_ctx": self.engine.n_ctx_slot,
                "params": SamplingParams(max_tokens=self.engine.n_ctx_slot).model_dump(mode="json"),
            },
            "chat_template": tok.template.source,
            "chat_template_origin": tok.template.origin,
            "bos_token": tok.bos_text,
            "eos_token": tok.eos_text,
            "modalities": {"vision": False, "audio": False},
            "devices": self.engine.devices,
            "topology": self.topology,
        }

    async def drain(self, grace_s: float, replica: str | None = None) -> dict:
        """Stop taking requests; give running ones ``grace_s`` to finish, then end the rest
        with a shutting-down error. Called before a shutdown so that it is quick."""
        self._draining = True
        deadline = time.monotonic() + grace_s
        while self._owner and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for rid in list(self._owner):
            self.engine.cancel(rid)
        # cancelled, but their clients are still there: they get an error
        return {"cut": self._cut_all(SHUTTING_DOWN)}

    def tables(self) -> dict:
        """Sizes of every per-request table (a leak shows here)."""
        running, waiting = self.engine.scheduler.counts()
        return {
            "owners": len(self._owner),
            "connections": len(self._conns),
            "connection_requests": sum(len(c.requests) for c in self._conns.values()),
            "running": running,
            "waiting": waiting,
            "active_slots": sum(len(g.active) for g in self.engine.groups),
            "rss_bytes": rss_bytes(os.getpid()),
            "replica": self._replica,
        }

    def _default_max_tokens(self) -> int:
        # OpenAI's meaning of a missing max_tokens: until the slot's context is full
        return self.engine.n_ctx_slot

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
            "meta": self.engine.model.meta(),
            "speculative": self.config.speculative.model_dump() if self.config.speculative else None,
            "healthy": self.engine.healthy and self._failed is None,
            "replica": self._replica,
            "topology": self.topology["topology"],
            "pid": os.getpid(),
        }

    async def slots(self, replica: str | None = None) -> list[dict]:
        return [
            {
                "id": v.id,
                "group": v.group,
                "seq_id": v.seq_id,
                "state": v.state,
                "is_processing": v.state != "idle",
                "n_cached_tokens": v.n_cached,
                "id_task": v.request_id,
                "replica": self._replica,
            }
            for v in self.engine.slot_views()
        ]

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
