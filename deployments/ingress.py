"""The HTTP ingress: the OpenAI-compatible API, SSE streaming, slots, health and metrics.

Each ingress replica opens one long-lived stream from the engine actor that carries the
outputs of all its requests in per-step batches, and hands each output to the waiting
request's queue. Every opening of the stream has its own connection id; a request is
submitted on the current connection and registered here first, so no output can arrive
for an unknown request, and a stream that ends fails only its own requests (503, retry).
A client that goes away cancels its request in the engine.
"""


import asyncio
import base64
import contextvars
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from starlette.background import BackgroundTask

from deployments.anthropic import CountTokensRequest, MessagesShaper
from deployments.endpoints import (
    CHAT,
    COMPLETION,
    ENDPOINTS,
    INFILL,
    LLAMA,
    MESSAGES,
    RESPONSES,
    Endpoint,
    openai_error,
)
from deployments.protocol import (
    ApiError,
    ApplyTemplateRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    Submitted,
    TokenizeRequest,
    completion_probabilities,
    engine_request,
    error_body,
    error_type,
    llama_final,
    now,
    parse_body,
    pick_fields,
    prompt_progress,
    timings,
    validate_body,
)
from deployments.router import Route, known_replicas, prefix_hashes, routing_text
from deployments.shaping import (
    Choice,
    ResponsesShaper,
    SseEvents,
    by_choice,
    member_ids,
    total_usage,
)
from engine.types import SHUTTING_DOWN, FinishReason, Output
from observability.metrics import merge_exposition
from observability.process import rss_bytes

log = logging.getLogger(__name__)

# the documentation routes are the ingress's own, behind the API key like every route
app = FastAPI(title="pipeline-groups OpenAI-compatible API", version="0.1.0",
              docs_url=None, redoc_url=None, openapi_url=None)

_REF = "#/components/schemas/{model}"
_BODY_MODELS = {m.__name__: m for m in (*(e.request for e in ENDPOINTS), TokenizeRequest, DetokenizeRequest,
                                         ApplyTemplateRequest, CountTokensRequest, EmbeddingRequest)}


def _body(name: str) -> dict:
    """The route reads the raw body itself (to answer bad JSON with 400), so declare it here."""
    ref = {"$ref": _REF.format(model=name)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _openapi() -> dict:
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        routes = [r for r in app.routes if getattr(r, "include_in_schema", True)]
        spec = get_openapi(title=app.title, version=app.version, routes=routes)
        comps = spec.setdefault("components", {}).setdefault("schemas", {})
        for name, model in _BODY_MODELS.items():
            schema = model.model_json_schema(ref_template=_REF)
            comps.update(schema.pop("$defs", {}))
            comps[name] = schema
        app.openapi_schema = spec
    return app.openapi_schema


app.openapi = _openapi  # type: ignore[method-assign]



DONE = b"data: [DONE]\n\n"


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def err_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(message, error_type(status), status, param),
        status_code=status,
        headers=headers,
    )


@app.exception_handler(HTTPError)
async def _http_error(_request: Request, e: HTTPError) -> JSONResponse:
    return err_response(e.status, e.message, e.param, e.headers)


@app.exception_handler(Exception)
async def _internal_error(_request: Request, e: Exception) -> JSONResponse:
    """Whatever else fails is a 500 in OpenAI's error shape (the log has the traceback)."""
    log.error("request failed: %r", e, exc_info=e)
    return err_response(500, f"internal error: {type(e).__name__}")


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msg = err.get("msg", "invalid")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _error_status(o: Output) -> tuple[int, str]:
    """The HTTP status and message of a request's failed last output. A request is only
    ever "cancelled" towards a client that is still there when the server cut it."""
    if o.finish_reason is FinishReason.CANCELLED:
        return 503, SHUTTING_DOWN
    return (o.status or 500), (o.error or "generation failed")


def _error_event(o: Output) -> bytes:
    """A failed request's last output as an SSE error event (OpenAI's error shape)."""
    status, message = _error_status(o)
    return b"data: " + json.dumps(error_body(message, error_type(status), status)).encode() + b"\n\n"


def _event_stream(events: AsyncIterator[bytes], cleanup: BackgroundTask) -> StreamingResponse:
    """An SSE response; ``cleanup`` runs however it ends, also when the client is gone before
    the stream starts (then the generator never runs and cannot clean up itself)."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, background=cleanup)


def _error_of(o: Output) -> JSONResponse:
    status, message = _error_status(o)
    return err_response(status, message, headers={"Retry-After": "1"} if status == 503 else None)


_BACKGROUND: set[asyncio.Task] = set()  # strong references until done


def _reshaped(resp: Response, ep: Endpoint) -> Response:
    """An error answer that a shaper made in OpenAI's shape, in the endpoint's own instead."""
    if resp.status_code < 400 or not isinstance(resp, JSONResponse) or ep.error is openai_error:
        return resp
    try:
        message = json.loads(resp.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return resp
    headers = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
    return JSONResponse(ep.error(resp.status_code, message), status_code=resp.status_code, headers=headers)


def _detached(coro: Coroutine) -> asyncio.Task:
    """Run ``coro`` outside the HTTP request that asked for it. Serve cancels the handle
    calls made in a request's context when that request ends or its client goes away: the
    shared output stream, or a cancel sent as a client leaves, must not go with it."""
    task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


MAX_FIELD_NAMES = 256  # distinct ignored field names counted (a client cannot grow the table without bound)
OFFLOAD_BYTES = 64 * 1024  # bodies larger than this are parsed off the event loop


async def _sized(n_bytes: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` for a body of ``n_bytes``: inline when small, in a thread when large."""
    return fn(*args) if n_bytes < OFFLOAD_BYTES else await asyncio.to_thread(fn, *args)


class _Pending:
    """A request waiting for outputs: its queue (every choice's outputs) and the output
    stream it came by."""

    __slots__ = ("rid", "queue", "conn", "replica", "finished", "echo", "n")

    def __init__(self, rid: str, n: int = 1) -> None:
        self.rid = rid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.conn: str | None = None  # set once an engine replica took it
        self.replica: str | None = None
        self.finished = False
        self.echo: str | None = None
        self.n = n  # choices


@serve.deployment(name="ingress", max_ongoing_requests=2048, graceful_shutdown_timeout_s=30)
@serve.ingress(app)
class Ingress:
    def __init__(
        self,
        engine: Any,
        model_names: list[str],
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        max_body_bytes: int = 8 * 1024 * 1024,
        connect_timeout_s: float = 10.0,
        strict_request_fields: bool = False,
    ) -> None:
        self.engine = engine
        self.model_names = model_names
        self.strict = strict_request_fields
        self.ignored_fields: dict[str, int] = {}  # field name -> requests that sent it (each logged once)
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
        self.max_body_bytes = max_body_bytes
        self.connect_timeout_s = connect_timeout_s
        self.ingress_id = uuid.uuid4().hex
        self._pending: dict[str, _Pending] = {}
        self._discover_task: asyncio.Task | None = None
        self._pumps: dict[str | None, asyncio.Task] = {}  # by the replica asked for (None: any)
        self._streams: dict[str, str] = {}  # engine replica id -> the output stream's connection id
        self._opening: dict[str | None, str] = {}  # a pump's stream being opened: its connection id
        self._connected = asyncio.Event()  # at least one output stream is up

    # ---- the output streams from the engine replicas -----------------------------------------

    @property
    def _deployment(self) -> str:
        return getattr(self.engine, "deployment_name", "engine")

    def _ensure_pump(self) -> None:
        if self._discover_task is None or self._discover_task.done():
            self._discover_task = _detached(self._discover())

    async def _discover(self) -> None:
        """One output stream per engine replica (pair) that the router knows of; before it
        knows any, one stream to whichever replica Serve picks."""
        try:  # a first call makes the handle's router, which then learns the replicas
            await asyncio.wait_for(self.engine.info.remote(), self.connect_timeout_s)
        except Exception as e:  # no replica yet: the streams wait for one
            log.info("engine not answering yet: %s", e)
        while True:
            known = known_replicas(self._deployment)
            if not known:  # a handle without the pair router (or no replica yet): one stream to any
                if None not in self._pumps or self._pumps[None].done():
                    self._pumps[None] = _detached(self._pump(None))
            elif self._reaching_any():
                pass  # which replica the first stream reaches shows when it registers: no second one to it
            else:
                for rid in known - set(self._streams):
                    if rid not in self._pumps or self._pumps[rid].done():
                        self._pumps[rid] = _detached(self._pump(rid))
                for rid in [r for r in self._pumps if r is not None and r not in known]:
                    self._pumps.pop(rid).cancel()
            await asyncio.sleep(1.0 if self._streams else 0.2)

    def _reaching_any(self) -> bool:
        """Whether the stream to any replica (opened while the router knew none) is still being
        opened: once the router knows replicas, a stream per replica would otherwise be opened
        to the same one and two streams would hold it."""
        anyone = self._pumps.get(None)
        return anyone is not None and not anyone.done() and None in self._opening

    async def _pump(self, target: str | None) -> None:
        """Hold one output stream from an engine replica, with a fresh connection id each time
        it is opened. When a stream ends, only the requests submitted on it fail (503, retry)."""
        backoff = 0.2
        while True:
            known = known_replicas(self._deployment)
            if (target is None and known) or (target is not None and known and target not in known):
                return  # the streams per replica take over; or this replica is gone
            conn, replica = uuid.uuid4().hex, None
            self._opening[target] = conn
            try:
                gen = self.engine.options(stream=True).outputs.remote(self.ingress_id, conn, replica=target)
                async for batch in gen:
                    if isinstance(batch, dict):
                        if "refused" in batch:  # stopping, or not the replica asked for
                            log.info("engine replica refused the output stream: %s", batch["refused"])
                            break
                        replica = batch["connected"]  # the engine replica registered this stream
                        self._streams[replica] = conn
                        self._opening.pop(target, None)
                        self._connected.set()
                        backoff = 0.2
                        continue
                    for o in batch:  # Outputs, as the engine made them
                        p = self._pending.get(o.request_id)
                        if p is not None:
                            p.queue.put_nowait(o)
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # the ingress is stopping
                    raise
                log.warning("output stream %s from the engine was cancelled", conn[:8])
            except Exception as e:  # the engine replica died or is being replaced
                log.warning("output stream %s from the engine ended: %s", conn[:8], e)
            finally:
                if self._opening.get(target) == conn:
                    del self._opening[target]
                if replica is not None and self._streams.get(replica) == conn:
                    del self._streams[replica]
                if not self._streams:
                    self._connected.clear()
            self._fail_stream(conn)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _fail_stream(self, conn: str) -> None:
        lost = {id(p): p for p in self._pending.values() if p.conn == conn}
        for p in lost.values():
            for m in member_ids(p.rid, p.n):
                p.queue.put_nowait(Output(m, "", 0, FinishReason.ERROR, error="the engine replica restarted; retry the request",
                                          status=503))

    async def _connection(self) -> dict[str, str]:
        """The output streams requests can be submitted on, by engine replica."""
        self._ensure_pump()
        if not self._connected.is_set():
            try:
                await asyncio.wait_for(self._connected.wait(), self.connect_timeout_s)
            except TimeoutError:
                raise HTTPError(503, "the engine is not available (starting or restarting); retry",
                                headers={"Retry-After": "2"}) from None
        return dict(self._streams)

    def tables(self) -> dict:
        """Sizes of the per-request tables (a leak shows here)."""
        return {"pending": len(self._pending), "connected": self._connected.is_set(), "rss_bytes": rss_bytes(os.getpid()),
                "streams": dict(self._streams), "known": sorted(known_replicas(self._deployment))}

    async def __del__(self) -> None:
        """Serve's destructor: end this replica's output stream at the engine, whose graceful
        shutdown otherwise waits out its timeout on it (a caller that goes away does not end a
        streaming call there)."""
        streams = dict(self._streams)
        for t in [self._discover_task, *self._pumps.values()]:
            if t is not None:
                t.cancel()
        for replica, conn in streams.items():
            try:
                await asyncio.wait_for(self.engine.close_stream.remote(conn, replica=replica), 5.0)
            except Exception:  # the engine is gone or going: nothing holds it
                pass

    # ---- plumbing ----------------------------------------------------------------------------

    def _check_auth(self, request: Request) -> None:
        if not self.api_key:
            return
        h = request.headers.get("authorization", "")
        # Anthropic's clients send the key as x-api-key
        token = h[7:] if h[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not token or not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise HTTPError(401, "invalid or missing API key (Authorization: Bearer <key>)")

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes ``max_body_bytes``: a declared
        Content-Length is checked first; a chunked body is counted as it arrives."""
        too_big = HTTPError(413, f"request body larger than {self.max_body_bytes} bytes")
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > self.max_body_bytes:
            raise too_big
        parts, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > self.max_body_bytes:
                raise too_big
            parts.append(chunk)
        return b"".join(parts)

    async def _json(self, request: Request, raw: bytes | None = None) -> dict:
        if raw is None:
            raw = await self._read_body(request)
        try:
            return await _sized(len(raw), parse_body, raw)
        except ValueError as e:
            raise HTTPError(400, str(e)) from None

    def _check_model(self, name: str | None) -> None:
        """Any name serves the one model, as llama-server does (clients left at their default,
        ``gpt-4o-mini``, work); with ``strict_request_fields`` an unknown name is OpenAI's 404."""
        if self.strict and name and name not in self.model_names:
            raise HTTPError(404, f"the model {name!r} does not exist; this server serves {self.model_names[0]!r}", "model")

    def _validate(self, model_cls: type, body: dict) -> Any:
        req, unknown = validate_body(model_cls, body, self.strict)
        sampling = getattr(engine_request(req), "sampling", None)
        if sampling is not None:  # a generating request: its sampling fields hold together
            sampling(1)
        for name in unknown:
            if name not in self.ignored_fields:
                log.warning("ignoring the unknown request field %r (logged once; set strict_request_fields to "
                            "refuse unknown fields)", name[:100])
            if name in self.ignored_fields or len(self.ignored_fields) < MAX_FIELD_NAMES:
                self.ignored_fields[name] = self.ignored_fields.get(name, 0) + 1
        return req

    def _ingress_metrics(self) -> bytes:
        """The ingress's own series: request fields it ignored, by name."""
        lines = [b"# HELP pgroups_ignored_request_fields_total Requests that carried a field this server does not "
                 b"know (ignored; strict_request_fields refuses them).",
                 b"# TYPE pgroups_ignored_request_fields_total counter"]
        for name, n in sorted(self.ignored_fields.items()):
            label = json.dumps(name[:100])[1:-1].replace("\\'", "'")
            lines.append(f'pgroups_ignored_request_fields_total{{field="{label}"}} {n}'.encode())
        return b"\n".join(lines) + b"\n"

    async def _parse(self, request: Request, model_cls: type) -> tuple[Any, bytes]:
        """The request's body as ``model_cls``, checked (auth, size, JSON, fields); raises ``HTTPError``."""
        self._check_auth(request)
        raw = await self._read_body(request)
        body = await self._json(request, raw)
        try:
            req = await _sized(len(raw), self._validate, model_cls, body)
        except ValidationError as e:
            raise HTTPError(400, _validation_message(e)) from None
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        return req, raw

    async def _submit(self, request: Request, ep: Endpoint) -> Response:
        """One generating request of endpoint ``ep``: read, submit, answer in its shape; every
        error in the endpoint's error shape (the one place that maps them)."""
        try:
            resp = await self._run(request, ep)
        except HTTPError as e:
            return JSONResponse(ep.error(e.status, e.message, e.param), status_code=e.status, headers=e.headers)
        return _reshaped(resp, ep)

    async def _run(self, request: Request, ep: Endpoint) -> Response:
        api_req, raw = await self._parse(request, ep.request)
        self._check_model(api_req.model)
        req = engine_request(api_req)  # what the engine runs
        conns = await self._connection()
        rid = ep.id_prefix + uuid.uuid4().hex
        p = _Pending(rid, req.n)
        ids = member_ids(rid, req.n)
        for m in ids:
            self._pending[m] = p
        route = Route(tuple(conns), tuple(await _sized(len(raw), prefix_hashes, routing_text(req))))
        try:
            res = await self.engine.submit.remote(conns, rid, req, route=route)
        except BaseException:
            for m in ids:
                self._pending.pop(m, None)
            # the client left (or the call failed) while the engine may have taken it: cancel
            # there too, or it generates what nobody reads (a cancel of an unknown id is a no-op)
            _detached(self._cancel(rid, req.n))
            raise
        if isinstance(res, ApiError):
            for m in ids:
                self._pending.pop(m, None)
            raise HTTPError(res.status, res.message, headers={"Retry-After": "1"} if res.status in (429, 503) else None)
        p.conn, p.replica = res.conn, res.replica
        if p.conn not in self._streams.values():  # its stream ended while it was submitted
            self._fail_stream(p.conn)
        p.echo = res.echo  # completions' echo: the prompt's text comes first
        try:
            resp = await getattr(self, ep.answer)(ep, rid, p, api_req, req, res)
        except BaseException:  # nobody will read its outputs: the engine stops generating them
            await self._release(rid)
            raise
        resp.headers["x-engine-replica"] = p.replica  # which engine replica (pair) served it
        return resp

    # ---- the answers, by endpoint (endpoints.py names them) ----------------------------------

    async def _openai_answer(self, ep: Endpoint, rid: str, p: _Pending, api_req: Any, req: Any,
                             res: Submitted) -> Response:
        model = self.model_names[0]
        choices = [Choice(i, ep.kind, req.n_logprobs() is not None, res.tools, res.reasoning) for i in range(req.n)]
        if req.stream:
            return self._stream(rid, self._sse(rid, p.queue, ep.kind, model, req.include_usage, choices))
        return await self._collect(rid, p.queue, ep.kind, model, choices)

    async def _llama_answer(self, ep: Endpoint, rid: str, p: _Pending, api_req: Any, req: Any,
                            res: Submitted) -> Response:
        model, want_tokens = self.model_names[0], bool(getattr(req, "return_tokens", False))
        fields, post = req.response_fields, bool(req.post_sampling_probs)
        if req.stream:
            return self._stream(rid, self._llama_sse(rid, p.queue, model, want_tokens, res.n_ctx, fields, post))
        return await self._llama_collect(rid, p.queue, model, want_tokens, req.n, res.n_ctx, fields, post)

    async def _messages_answer(self, ep: Endpoint, rid: str, p: _Pending, api_req: Any, req: Any,
                               res: Submitted) -> Response:
        shaper = MessagesShaper(rid, self.model_names[0], res.tools, res.prompt_tokens)
        if req.stream:
            return self._stream(rid, self._typed_sse(rid, p.queue, shaper))
        return await self._typed_collect(rid, p.queue, shaper)

    async def _responses_answer(self, ep: Endpoint, rid: str, p: _Pending, api_req: Any, req: Any,
                                res: Submitted) -> Response:
        shaper = ResponsesShaper(rid, self.model_names[0], api_req)
        if req.stream:
            return self._stream(rid, self._typed_sse(rid, p.queue, shaper))
        return await self._typed_collect(rid, p.queue, shaper)

    def _stream(self, rid: str, events: AsyncIterator[bytes]) -> StreamingResponse:
        return _event_stream(self._guarded(rid, events), BackgroundTask(self._release, rid))

    async def _guarded(self, rid: str, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A stream that ends with an error event, not a dropped connection, when shaping an
        event fails after the first byte, and releases its request however it ends."""
        try:
            async for chunk in events:
                yield chunk
        except Exception as e:
            log.exception("stream of %s failed", rid)
            msg = f"the stream failed: {type(e).__name__}"
            yield b"data: " + json.dumps(error_body(msg, error_type(500), 500)).encode() + b"\n\n" + DONE
        finally:
            await self._release(rid)

    async def _release(self, rid: str) -> None:
        """Forget a request (every choice); cancel it in the engine unless it finished."""
        p = self._pending.get(rid)
        if p is None:
            return
        for m in member_ids(rid, p.n):
            self._pending.pop(m, None)
        if not p.finished:
            _detached(self._cancel(rid, p.n, p.replica))

    async def _cancel(self, rid: str, n: int = 1, replica: str | None = None) -> None:
        try:
            await self.engine.cancel.remote(rid, n, replica=replica)
        except Exception:  # the engine is gone; nothing to cancel
            pass

    async def _outputs(self, rid: str, q: asyncio.Queue) -> AsyncIterator[list[Output]]:
        """The request's outputs until its last, as lists of what has arrived since the last
        read (one list per step while the client keeps up, several steps when it falls
        behind); cancels the request in the engine if abandoned."""
        deadline = time.monotonic() + self.request_timeout_s if self.request_timeout_s else None
        p = self._pending.get(rid)
        n = p.n if p is not None else 1
        left = n  # choices not finished
        try:
            if p is not None and p.echo:
                yield [Output(m, p.echo, 0) for m in member_ids(rid, n)]
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    o = await asyncio.wait_for(q.get(), timeout)
                except TimeoutError:
                    yield [Output(rid, "", 0, FinishReason.ERROR, error=f"request timed out after {self.request_timeout_s} s",
                                  status=504)]
                    return
                batch = [o]
                left -= o.finish_reason is not None
                while left and not q.empty():
                    o = q.get_nowait()
                    batch.append(o)
                    left -= o.finish_reason is not None
                if not left and p is not None:
                    p.finished = True
                yield batch
                if not left:
                    return
        finally:
            await self._release(rid)

    async def _collect(self, rid: str, q: asyncio.Queue, kind: str, model: str, choices: list[Choice]) -> Response:
        async for batch in self._outputs(rid, q):
            for i, outs in by_choice(batch).items():
                choices[i].add(outs)
        for c in choices:  # one failed choice fails the request
            if c.last is not None and c.last.finish_reason is not None and c.last.finish_reason.failed:
                return _error_of(c.last)
        if not all(c.finished for c in choices):  # the wait timed out (504) before an output came
            return err_response(504, f"request timed out after {self.request_timeout_s} s")
        obj = "chat.completion" if kind == "chat" else "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": now(), "model": model,
                             "choices": [c.body() for c in choices], "usage": total_usage([c.last for c in choices]),
                             "timings": timings(choices[0].last)})

    async def _sse(self, rid: str, q: asyncio.Queue, kind: str, model: str, include_usage: bool,
                   choices: list[Choice]):
        ev = SseEvents(rid, kind, model, include_usage)
        if kind == "chat":
            yield b"".join(ev.chunk(None, None, first=True, index=c.index) for c in choices)
        async for batch in self._outputs(rid, q):
            out = b"".join(ev.progress(o) for o in batch if o.progress is not None)
            for i, outs in by_choice(batch).items():
                out += choices[i].events(ev, outs)
                last = outs[-1]
                if last.finish_reason is not None and last.finish_reason.failed:
                    yield out + _error_event(last) + DONE
                    return
            if all(c.finished for c in choices):
                if include_usage:
                    out += ev.usage([c.last for c in choices])
                yield out + DONE
                return
            if out:
                yield out
        yield DONE

    async def _typed_collect(self, rid: str, q: asyncio.Queue, shaper: Any) -> Response:
        """A whole answer of a shaper of typed events (Responses, Messages): ``add`` each batch,
        then its ``final`` body."""
        last = None
        async for batch in self._outputs(rid, q):
            shaper.add(batch)
            last = batch[-1]
        if last is None or last.finish_reason is None:
            return err_response(504, f"request timed out after {self.request_timeout_s} s")
        if last.finish_reason.failed:
            return _error_of(last)
        return JSONResponse(shaper.final(last))

    async def _typed_sse(self, rid: str, q: asyncio.Queue, shaper: Any):
        """A shaper's typed events (no ``[DONE]``): its opening, a delta per batch of text, then
        its closing (or its error event)."""
        yield shaper.opening()
        async for batch in self._outputs(rid, q):
            last = batch[-1]
            text = "".join(o.text for o in batch)
            out = shaper.delta(text) if text else b""
            if last.finish_reason is not None and last.finish_reason.failed:
                yield out + shaper.failed(*_error_status(last))
                return
            if last.finish_reason is not None:
                yield out + shaper.closing(last)
                return
            if out:
                yield out

    async def _llama_collect(self, rid: str, q: asyncio.Queue, model: str, want_tokens: bool, n: int = 1,
                             n_ctx: int = 0, fields: list[str] | None = None, post: bool = False) -> Response:
        """llama-server's answer: one object, or with ``n_cmpl`` > 1 a list, one per choice."""
        parts: list[list[str]] = [[] for _ in range(n)]
        tokens: list[list[int]] = [[] for _ in range(n)]
        probs: list[list[dict]] = [[] for _ in range(n)]
        lasts: list[Output | None] = [None] * n
        async for batch in self._outputs(rid, q):
            for i, outs in by_choice(batch).items():
                for o in outs:
                    parts[i].append(o.text)
                    tokens[i].extend(o.tokens)
                    probs[i].extend(completion_probabilities(o, post))
                lasts[i] = outs[-1]
        bodies = []
        for i, last in enumerate(lasts):
            if last is None or last.finish_reason is None:  # the wait timed out
                return err_response(504, f"request timed out after {self.request_timeout_s} s")
            if last.finish_reason.failed:
                return _error_of(last)
            body = llama_final(last, "".join(parts[i]), model, tokens[i] if want_tokens else None, n_ctx)
            if probs[i]:
                body["completion_probabilities"] = probs[i]
            bodies.append(pick_fields(body, fields))
        return JSONResponse(bodies if n > 1 else bodies[0])

    async def _llama_sse(self, rid: str, q: asyncio.Queue, model: str, want_tokens: bool, n_ctx: int = 0,
                         fields: list[str] | None = None, post: bool = False):
        """llama-server's /completion stream: ``{"content", "stop": false}`` events, then the
        final object with ``stop: true`` (no ``[DONE]``, as llama-server)."""
        async for batch in self._outputs(rid, q):
            last = batch[-1]
            text = "".join(o.text for o in batch)
            toks = [t for o in batch for t in o.tokens]
            if last.finish_reason is not None and last.finish_reason.failed:
                yield _error_event(last)
                return
            probs = [p for o in batch for p in completion_probabilities(o, post)]
            if last.finish_reason is not None:
                event = llama_final(last, text, model, toks if want_tokens else None, n_ctx)
                if probs:
                    event["completion_probabilities"] = probs
                yield b"data: " + json.dumps(pick_fields(event, fields), ensure_ascii=False).encode() + b"\n\n"
                return
            event = {"content": text, "stop": False}
            progress = [o for o in batch if o.progress is not None]
            if progress:
                event["prompt_progress"] = prompt_progress(progress[-1])
            if want_tokens:
                event["tokens"] = toks
            if probs:
                event["completion_probabilities"] = probs
            yield b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"

    # ---- routes ------------------------------------------------------------------------------

    @app.post("/v1/completions", openapi_extra=_body("CompletionRequest"))
    @app.post("/completions", include_in_schema=False)
    async def completions(self, request: Request) -> Response:
        return await self._submit(request, COMPLETION)

    @app.post("/completion", openapi_extra=_body("LlamaCompletionRequest"))
    async def llama_completion(self, request: Request) -> Response:
        return await self._submit(request, LLAMA)

    @app.post("/infill", openapi_extra=_body("InfillRequest"))
    async def infill(self, request: Request) -> Response:
        return await self._submit(request, INFILL)

    @app.post("/v1/messages", openapi_extra=_body("MessagesRequest"))
    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API; its errors in Anthropic's shape."""
        return await self._submit(request, MESSAGES)

    @app.post("/v1/embeddings", openapi_extra=_body("EmbeddingRequest"))
    @app.post("/embeddings", include_in_schema=False)
    async def embeddings(self, request: Request) -> Response:
        """OpenAI's embeddings: a normalised vector per input, as floats or base64 (float32)."""
        req, res = await self._embed(request)
        if isinstance(res, ApiError):
            return err_response(res.status, res.message)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if req.encoding_format == "base64"
                 else v.tolist()} for i, v in enumerate(res.vectors)]
        return JSONResponse({"object": "list", "data": data, "model": self.model_names[0],
                             "usage": {"prompt_tokens": res.n_tokens, "total_tokens": res.n_tokens}})

    @app.post("/embedding", include_in_schema=False)
    async def llama_embedding(self, request: Request) -> Response:
        """llama-server's: ``[{"index", "embedding": [vector]}]``."""
        _, res = await self._embed(request)
        if isinstance(res, ApiError):
            return err_response(res.status, res.message)
        return JSONResponse([{"index": i, "embedding": [v.tolist()]} for i, v in enumerate(res.vectors)])

    async def _embed(self, request: Request) -> tuple[Any, Any]:
        req, _ = await self._parse(request, EmbeddingRequest)
        self._check_model(req.model)
        try:
            return req, await self.engine.embed.remote(req)
        except Exception as e:  # the engine replica is restarting
            return req, ApiError(503, f"the engine is not available: {type(e).__name__}")

    @app.post("/v1/messages/count_tokens", openapi_extra=_body("CountTokensRequest"))
    async def count_tokens(self, request: Request) -> Response:
        try:
            req, _ = await self._parse(request, CountTokensRequest)
            res = await self.engine.count_tokens.remote(req.to_chat())
        except HTTPError as e:
            res = ApiError(e.status, e.message)
        if isinstance(res, ApiError):
            return JSONResponse(MESSAGES.error(res.status, res.message), status_code=res.status)
        return JSONResponse(res)

    @app.post("/v1/responses", openapi_extra=_body("ResponsesRequest"))
    async def responses(self, request: Request) -> Response:
        return await self._submit(request, RESPONSES)

    @app.post("/v1/chat/completions", openapi_extra=_body("ChatCompletionRequest"))
    @app.post("/chat/completions", include_in_schema=False)
    async def chat_completions(self, request: Request) -> Response:
        return await self._submit(request, CHAT)

    # ---- llama-server's utility endpoints ----------------------------------------------------

    async def _utility(self, request: Request, method: str) -> Response:
        self._check_auth(request)
        body = await self._json(request)
        res = await getattr(self.engine, method).remote(body)
        if isinstance(res, ApiError):
            return err_response(res.status, res.message)
        return JSONResponse(res)

    @app.post("/tokenize", openapi_extra=_body("TokenizeRequest"))
    async def tokenize(self, request: Request) -> Response:
        return await self._utility(request, "tokenize")

    @app.post("/detokenize", openapi_extra=_body("DetokenizeRequest"))
    async def detokenize(self, request: Request) -> Response:
        return await self._utility(request, "detokenize")

    @app.post("/apply-template", openapi_extra=_body("ApplyTemplateRequest"))
    async def apply_template(self, request: Request) -> Response:
        return await self._utility(request, "apply_template")

    @app.get("/props")
    async def props(self, request: Request) -> Response:
        self._check_auth(request)
        return JSONResponse(await self.engine.props.remote())

    @app.get("/v1/models")
    @app.get("/models", include_in_schema=False)
    async def models(self, request: Request) -> Response:
        """The served model under each of its names (any other name serves it too), with
        llama-server's ``meta``."""
        self._check_auth(request)
        try:
            meta = (await asyncio.wait_for(self.engine.info.remote(), timeout=10.0)).get("meta")
        except Exception:  # the engine is restarting: the list without meta
            meta = None
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "pipeline-groups",
                 **({"meta": meta} if meta else {})} for name in self.model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    @app.get("/v1/health", include_in_schema=False)
    async def health(self) -> Response:
        # the ingress serves nothing while its output stream from the engine is down (the
        # engine replica died and Serve is replacing it): say so at once, even when the new
        # replica would answer info() within the timeout below
        reconnecting = self._discover_task is not None and not self._connected.is_set()
        self._ensure_pump()
        if reconnecting:
            return JSONResponse({"status": "reconnecting"}, status_code=503)
        try:
            info = await asyncio.wait_for(self.engine.info.remote(), timeout=2.0)
        except Exception:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        if not info.get("healthy"):
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/slots")
    async def slots(self, request: Request) -> Response:
        """Every engine replica's slots (each names its replica)."""
        self._check_auth(request)
        return JSONResponse([s for part in await self._each_replica("slots") for s in part])

    async def _each_replica(self, method: str) -> list[Any]:
        """``method`` on every engine replica this ingress holds a stream to (else on any)."""
        targets: list[str | None] = list(self._streams) or [None]
        return list(await asyncio.gather(*(getattr(self.engine, method).remote(replica=r) for r in targets)))

    @app.post("/slots/{slot_id}")
    async def slot_action(self, slot_id: int, request: Request, action: str = "", replica: str | None = None) -> Response:
        """``replica`` (from /slots) picks the engine replica; needed when there are several."""
        self._check_auth(request)
        if replica is None and len(self._streams) > 1:
            return err_response(400, f"{len(self._streams)} engine replicas: add ?replica=<id> (see /slots)", "replica")
        raw = await self._read_body(request)
        body = await self._json(request, raw) if raw else {}
        filename = body.get("filename")
        if filename is not None and not isinstance(filename, str):
            return err_response(400, "filename must be a string")
        res = await self.engine.slot_action.remote(slot_id, action, filename, replica=replica)
        if isinstance(res, ApiError):
            return err_response(res.status, res.message)
        return JSONResponse(res)

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        self._check_auth(request)
        text = merge_exposition([*await self._each_replica("metrics_text"), self._ingress_metrics()])
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json(self, request: Request) -> Response:
        self._check_auth(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(self, request: Request) -> Response:
        self._check_auth(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @app.get("/redoc", include_in_schema=False)
    async def redoc(self, request: Request) -> Response:
        self._check_auth(request)
        return get_redoc_html(openapi_url="/openapi.json", title=app.title)

