"""The HTTP ingress: serves every endpoint of every API module (``deployments.api``), with one
collect loop and one SSE loop for every generating endpoint, the request checks (the guard in
front, then the key, the body, the model name), health, metrics and the API's documentation.

A generating request is read into its API's request model, submitted to an engine replica
on this ingress's output stream from it (``deployments.streams``), and answered by its
endpoint's shaper, whole or streamed; every error in the endpoint's own shape. A client that
goes away cancels its request in the engine.
"""

import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.background import BackgroundTask

from deployments import api
from deployments.api.base import (
    Answer,
    ApiError,
    Call,
    ErrorShape,
    Generate,
    dumps,
    member_ids,
    openai_error,
    parse_body,
    read_request,
)
from deployments.direct import DirectServer, HttpLimits
from deployments.guard import Guard, GuardSettings
from deployments.resume import Resumer, ResumeSettings
from deployments.router import Route, prefix_hashes, routing_text
from deployments.streams import IngressStreams, Pending, detached
from engine.types import SHUTTING_DOWN, FinishReason, Output
from observability.metrics import merge_exposition
from observability.process import rss_bytes
from observability.stacks import start_from_env

log = logging.getLogger(__name__)

# no ``from __future__ import annotations`` here: Serve rewrites the signatures of the class's
# routes, and FastAPI must see ``Request`` itself, not its name, in them
# the documentation routes are the ingress's own, behind the API key like every route
app = FastAPI(title="pipeline-groups OpenAI-compatible API", version="0.1.0",
              docs_url=None, redoc_url=None, openapi_url=None)

ERROR_SHAPES: dict[str, ErrorShape] = {p: ep.error for ep in api.ENDPOINTS for p in ep.paths}


def _guard_settings() -> GuardSettings | None:
    ing = _ingress(required=False)
    return ing.guard if ing is not None else None


app.add_middleware(Guard, settings_of=_guard_settings)

MAX_FIELD_NAMES = 256  # distinct ignored field names counted (a client cannot grow the table without bound)
OFFLOAD_BYTES = 64 * 1024  # bodies larger than this are parsed off the event loop
BODY_THREADS = 1  # threads that parse large bodies: Python holds the GIL, so more would only take the loop's turns
DIRECT_STOP_S = 20.0  # direct ingress: how long a stopping replica's running requests get

_REF = "#/components/schemas/{model}"
_BODY_MODELS = {ep.request.__name__: ep.request for ep in api.ENDPOINTS}


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


def err_response(status: int, message: str, param: str | None = None, headers: dict | None = None,
                 shape: ErrorShape = openai_error) -> JSONResponse:
    return JSONResponse(shape(status, message, param), status_code=status, headers=headers)


@app.exception_handler(ApiError)
async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    return err_response(e.status, e.message, e.param, e.headers, ERROR_SHAPES.get(request.url.path, openai_error))


@app.exception_handler(Exception)
async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    """Whatever else fails is the server's fault: a 500 in the route's error shape, logged with
    its traceback and counted."""
    log.error("request to %s failed: %r", request.url.path, e, exc_info=e)
    ing = _ingress(required=False)
    if ing is not None:
        ing.internal_errors += 1
    return err_response(500, f"internal error: {type(e).__name__}",
                        shape=ERROR_SHAPES.get(request.url.path, openai_error))


def _error_status(o: Output) -> tuple[int, str]:
    """The HTTP status and message of a request's failed last output. A request is only
    ever "cancelled" towards a client that is still there when the server cut it."""
    if o.finish_reason is FinishReason.CANCELLED:
        return 503, SHUTTING_DOWN
    return (o.status or 500), (o.error or "generation failed")


async def _sized(pool: ThreadPoolExecutor, n_bytes: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` for a body of ``n_bytes``: inline when small, on ``pool``'s threads when large
    (the loop delivers every stream's tokens meanwhile; large bodies wait their turn there)."""
    return fn(*args) if n_bytes < OFFLOAD_BYTES else await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


async def take_body(request: Request) -> bytes:
    """The request's body, read once and not kept on the request (starlette's ``body()`` would
    cache it on the request object, which a stream holds to its end)."""
    chunks = [chunk async for chunk in request.stream() if chunk]
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _until_gone(request: Request, work: Any) -> Response:
    """``work``'s response, unless the client goes away first: then ``work`` is cancelled
    (its request with it) and nobody reads the 499 left in its place."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    await asyncio.gather(task, return_exceptions=True)  # its cleanup (the engine's cancel) has run
    return Response(status_code=499)


class Answering(JSONResponse):
    """A JSON answer written with ``api.base.dumps``: never NaN or Infinity."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode()


_CURRENT: list[Any] = []  # an Ingress made outside Serve (tests)


WEB = Path(__file__).with_name("web")
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
_FILES = {p.name: p for p in WEB.iterdir() if p.suffix in _TYPES} if WEB.is_dir() else {}


def _static(name: str) -> Response:
    path = _FILES.get(name)  # a name of the shipped files, never a path a request makes
    if path is None:
        raise ApiError(404, f"no file {name[:100]!r}")
    return Response(path.read_bytes(), media_type=_TYPES[path.suffix],
                    headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                             "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"})


def _ingress(required: bool = True) -> "Ingress | None":
    """The Ingress of this replica: the routes below are plain functions, and Serve pickles the
    class by value (a global its methods set is not the one a route reads): ask Serve."""
    try:
        return serve.get_replica_context().servable_object
    except Exception:  # outside a Serve replica
        if _CURRENT:
            return _CURRENT[-1]
    if required:
        raise ApiError(503, "the ingress is starting")
    return None


# ---- every API module's endpoints, as routes ---------------------------------------------------


def _body_doc(model: type) -> dict:
    """The route reads the raw body itself (to answer bad JSON with 400), so declare it here."""
    ref = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _attach(ep: Generate | Call) -> None:
    if isinstance(ep, Generate):
        async def endpoint(request: Request) -> Response:
            return await _ingress().generate(request, ep)
    else:
        async def endpoint(request: Request) -> Response:
            return await _ingress().call(request, ep)
    endpoint.__name__ = ep.request.__name__.removesuffix("Request").lower() or "endpoint"
    for i, path in enumerate(ep.paths):
        app.add_api_route(path, endpoint, methods=["POST"], include_in_schema=i == 0, summary=ep.summary or None,
                          openapi_extra=_body_doc(ep.request))


def _attach_route(method: str, paths: tuple[str, ...], handler: Callable) -> None:
    async def endpoint(request: Request) -> Response:
        ing = _ingress()
        ing.check_auth(request)
        return await handler(ing, request)
    endpoint.__name__ = handler.__name__
    endpoint.__doc__ = handler.__doc__
    for i, path in enumerate(paths):
        app.add_api_route(path, endpoint, methods=[method], include_in_schema=i == 0)


for _ep in api.ENDPOINTS:
    _attach(_ep)
for _method, _paths, _handler in api.ROUTES:
    _attach_route(_method, _paths, _handler)


MAX_ONGOING = 2048  # requests in flight per ingress replica, through Serve's proxy or not


@serve.deployment(name="ingress", max_ongoing_requests=MAX_ONGOING, graceful_shutdown_timeout_s=30)
@serve.ingress(app)
class Ingress:
    async def __init__(
        self,
        engine: Any,
        model_names: list[str],
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        max_body_bytes: int = 8 * 1024 * 1024,
        connect_timeout_s: float = 10.0,
        strict_request_fields: bool = False,
        guard: dict[str, Any] | None = None,
        http: tuple[str, int] | None = None,
        http_limits: dict[str, Any] | None = None,
        resume_limit: int = 3,
        resume_wait_s: float = 120.0,
    ) -> None:
        """``http``: the address and port this replica serves HTTP on itself (direct ingress,
        ``deployments.direct``: Serve runs no proxy), within ``http_limits`` (``HttpLimits``'
        fields); None: behind Serve's proxy. ``resume_limit``, ``resume_wait_s``: how a request
        its engine replica failed for a fault is resumed (``deployments.resume``)."""
        self.engine = engine
        self.model_names = model_names
        self.strict = strict_request_fields
        self.ignored_fields: dict[str, int] = {}  # field name -> requests that sent it (each logged once)
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
        self.out = IngressStreams(engine, connect_timeout_s)
        self.resumer = Resumer(engine, self.out, ResumeSettings(resume_limit, resume_wait_s))
        self.bodies = ThreadPoolExecutor(BODY_THREADS, thread_name_prefix="ingress-bodies")
        self.internal_errors = 0  # 500s: the server's own faults
        self.guard = GuardSettings(max_body_bytes=max_body_bytes, keyless=not api_key, max_requests=MAX_ONGOING,
                                   error_shape=lambda path: ERROR_SHAPES.get(path, openai_error),
                                   **{k: tuple(v) if isinstance(v, list) else v for k, v in (guard or {}).items()})
        _CURRENT[:] = [self]
        self.http = (DirectServer(app, *http, HttpLimits(**(http_limits or {})), refused=self.guard.refused)
                     if http else None)
        self._stacks = start_from_env("ingress")  # a developer's profile of the host path

    @property
    def streams(self) -> dict[str, str]:
        return self.out.streams

    def tables(self) -> dict:
        """Sizes of the per-request tables (a leak shows here)."""
        return {"pending": len(self.out.pending), "resuming": len(self.resumer.tasks),
                "connected": self.out.connected.is_set(),
                "rss_bytes": rss_bytes(os.getpid()), "streams": dict(self.out.streams),
                "known": sorted(self.out.known()), "ignored_fields": len(self.ignored_fields)}

    async def __del__(self) -> None:
        """Serve's destructor: stop serving HTTP (running requests get their time), then end
        this replica's output streams at the engines."""
        if self.http is not None:
            await self.http.stop(DIRECT_STOP_S)
        await self.out.close()
        if self._stacks is not None:
            self._stacks.stop()

    # ---- the request checks ------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        if not self.api_key:
            return
        h = request.headers.get("authorization", "")
        # Anthropic's clients send the key as x-api-key
        token = h[7:] if h[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not token or not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)")

    async def body_json(self, request: Request, raw: bytes | None = None) -> dict | None:
        """The body (``raw``, else read now) as a JSON object (the guard has read it in time and
        within its size); None: no body."""
        if raw is None:
            raw = await take_body(request)
        if not raw:
            return None
        return await _sized(self.bodies, len(raw), parse_body, raw)

    def _check_model(self, name: str | None) -> None:
        """Any name serves the one model, as llama-server does (clients left at their default,
        ``gpt-4o-mini``, work); with ``strict_request_fields`` an unknown name is OpenAI's 404."""
        if self.strict and name and name not in self.model_names:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_names[0]!r}", "model")

    def _validate(self, model_cls: type, body: dict) -> Any:
        req, unknown = read_request(model_cls, body, self.strict)
        for name in unknown:
            if name not in self.ignored_fields:
                log.warning("ignoring the unknown request field %r (logged once; set strict_request_fields to "
                            "refuse unknown fields)", name)
            if name in self.ignored_fields or len(self.ignored_fields) < MAX_FIELD_NAMES:
                self.ignored_fields[name] = self.ignored_fields.get(name, 0) + 1
        return req

    async def read(self, request: Request, model_cls: type) -> tuple[Any, int]:
        """The request's body as ``model_cls``, checked (auth, JSON, fields), and the body's
        size; raises ``ApiError``. Neither the body nor its parsed form is kept past this."""
        self.check_auth(request)
        raw = await take_body(request)
        n_bytes = len(raw)
        body = await self.body_json(request, raw)
        del raw
        if body is None:
            raise ApiError(400, "the request needs a JSON body")
        req = await _sized(self.bodies, n_bytes, self._validate, model_cls, body)
        del body
        self._check_model(getattr(req, "model", None))
        return req, n_bytes

    def answer_of(self, res: Any) -> Response:
        """An engine call's result as an answer: its error, or the result."""
        if isinstance(res, ApiError):
            raise res
        return Answering(res)

    async def each_replica(self, call: Callable[[Any, str | None], Any]) -> list[Any]:
        """``call(engine, replica)`` on every engine replica this ingress holds a stream to (else on any)."""
        targets: list[str | None] = list(self.out.streams) or [None]
        return list(await asyncio.gather(*(call(self.engine, r) for r in targets)))

    # ---- calls: a body, one engine call, one answer ------------------------------------------

    async def call(self, request: Request, ep: Call) -> Response:
        req, n_bytes = await self.read(request, ep.request)
        try:
            res = await ep.call(self.engine, req, n_bytes)
        except ApiError:
            raise
        except Exception as e:  # the engine replica is restarting
            raise ApiError(503, f"the engine is not available: {type(e).__name__}") from None
        if isinstance(res, ApiError):
            raise res
        return Answering(ep.answer(res, req, self.model_names[0]))

    # ---- generating requests -----------------------------------------------------------------

    async def generate(self, request: Request, ep: Generate) -> Response:
        """One generating request of endpoint ``ep``: read, submit, answer with its shaper. Once
        the engine has taken it, the request's text is dropped: the shaper keeps what its answer
        needs, and a stream holds only its outputs."""
        api_req, n_bytes = await self.read(request, ep.request)
        req = api_req.served_as()  # what the engine runs
        conns = await self.out.connection()
        rid = ep.id_prefix + uuid.uuid4().hex
        p = self.out.register(rid, req.n)
        try:
            route = Route(tuple(conns), tuple(await _sized(self.bodies, n_bytes, prefix_hashes, routing_text(req))))
            res = await self.engine.submit.remote(conns, rid, req, route=route, n_bytes=n_bytes)
        except BaseException:
            self.out.forget(rid, req.n)
            # the client left (or the call failed) while the engine may have taken it: cancel
            # there too, or it generates what nobody reads (a cancel of an unknown id is a no-op)
            detached(self._cancel(rid, req.n))
            raise
        if isinstance(res, ApiError):
            self.out.forget(rid, req.n)
            raise res
        p.taken(res)  # its stream, its replica, its prompt's ids; echo: completions' prompt text comes first
        if p.conn not in self.out.streams.values():  # its stream ended while it was submitted
            self.out.fail_stream(p.conn)
        try:
            shaper = ep.shaper(Answer(rid, self.model_names[0], api_req, req, res))
            stream = req.stream
            del api_req, req, res
            if stream:
                resp: Response = StreamingResponse(
                    self._guarded(rid, self._sse(rid, p, shaper, ep), shaper.failed), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                    background=BackgroundTask(self._release, rid))  # also when the client is gone before it starts
            elif self.http is not None:  # no proxy to cancel this call when its client leaves
                resp = await _until_gone(request, self._collect(rid, p, shaper, ep))
            else:
                resp = await self._collect(rid, p, shaper, ep)
        except BaseException:  # nobody will read its outputs: the engine stops generating them
            await self._release(rid)
            raise
        resp.headers["x-engine-replica"] = p.replica  # which engine replica (pair) served it
        return resp

    async def _collect(self, rid: str, p: Pending, shaper: Any, ep: Generate) -> Response:
        lasts: dict[str, Output] = {}
        async for batch in self._outputs(rid, p):
            shaper.add(batch)
            lasts.update((o.request_id, o) for o in batch if o.finish_reason is not None)
        failed = next((o for o in lasts.values() if o.finish_reason.failed), None)  # one failed choice fails it
        if failed is not None:
            e = ApiError(*_error_status(failed))  # its Retry-After as every error's
            return err_response(e.status, e.message, headers=e.headers, shape=ep.error)
        if not p.finished:  # the wait timed out (504) before every choice's last output came
            return err_response(504, f"request timed out after {self.request_timeout_s} s", shape=ep.error)
        return Answering(shaper.final())

    async def _sse(self, rid: str, p: Pending, shaper: Any, ep: Generate) -> AsyncIterator[bytes]:
        opening = shaper.opening()
        if opening:
            yield opening
        async for batch in self._outputs(rid, p):
            out = shaper.events(batch)
            failed = next((o for o in batch if o.finish_reason is not None and o.finish_reason.failed), None)
            if failed is not None:
                yield out + shaper.failed(*_error_status(failed))
                return
            if p.finished:  # every choice's last output has come (_outputs counts them)
                yield out + shaper.closing()
                return
            if out:
                yield out

    async def _guarded(self, rid: str, events: AsyncIterator[bytes],
                       failed: Callable[[int, str], bytes]) -> AsyncIterator[bytes]:
        """A stream that ends with an error event in the endpoint's own shape (``failed``, the
        shaper's), not a dropped connection, when shaping an event fails after the first byte,
        and releases its request however it ends."""
        try:
            async for chunk in events:
                yield chunk
        except Exception as e:
            log.exception("stream of %s failed", rid)
            self.internal_errors += 1
            message = f"the stream failed: {type(e).__name__}"
            try:
                yield failed(500, message)
            except Exception:  # the shaper itself is what failed
                yield b"data: " + json.dumps(openai_error(500, message)).encode() + b"\n\n"
        finally:
            await self._release(rid)

    async def _release(self, rid: str) -> None:
        """Forget a request (every choice, whatever it ran as); cancel in the engine what of it
        has not finished. It is never resumed after this."""
        p = self.out.pending.get(rid)
        if p is None:
            return
        p.closed = True
        self.out.forget_all(p)
        if p.finished:
            return
        if any(c.engine_id == m and not c.done for c, m in zip(p.choices, member_ids(rid, p.n), strict=True)):
            detached(self._cancel(rid, p.n, p.replica))  # the request as first submitted, its family whole
        for c in p.choices:
            if c.resumes and not c.done and c.replica is not None:
                detached(self._cancel(c.engine_id, 1, c.replica))

    async def _cancel(self, rid: str, n: int = 1, replica: str | None = None) -> None:
        try:
            await self.engine.cancel.remote(rid, n, replica=replica)
        except Exception:  # the engine is gone; nothing to cancel
            pass

    async def _outputs(self, rid: str, p: Pending) -> AsyncIterator[list[Output]]:
        """The request's outputs until its last, as lists of what has arrived since the last
        read (one list per step while the client keeps up, several steps when it falls
        behind), each as its choice's (a fault is resumed, not passed on: ``Resumer.take``);
        cancels the request in the engine if abandoned."""
        deadline = time.monotonic() + self.request_timeout_s if self.request_timeout_s else None
        q, take = p.queue, self.resumer.take
        try:
            if p.echo:
                yield [Output(m, p.echo, 0) for m in member_ids(rid, p.n)]
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    o = await asyncio.wait_for(q.get(), timeout)
                except TimeoutError:
                    yield [Output(rid, "", 0, FinishReason.ERROR, error=f"request timed out after {self.request_timeout_s} s",
                                  status=504)]
                    return
                batch = take(p, o)
                while not p.finished and not q.empty():
                    batch += take(p, q.get_nowait())
                if batch:
                    yield batch
                if p.finished:
                    return
        finally:
            await self._release(rid)

    # ---- the server's own routes -------------------------------------------------------------

    @app.get("/health")
    @app.get("/v1/health", include_in_schema=False)
    async def health(self) -> Response:
        # the ingress serves nothing while its output stream from the engine is down (the
        # engine replica died and Serve is replacing it): say so at once, even when the new
        # replica would answer info() within the timeout below
        reconnecting = self.out.discover_task is not None and not self.out.connected.is_set()
        self.out.ensure()
        if reconnecting:
            return JSONResponse({"status": "reconnecting"}, status_code=503)
        try:
            info = await asyncio.wait_for(self.engine.info.remote(), timeout=2.0)
        except Exception:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        if not info.get("healthy"):
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        self.check_auth(request)
        parts = await self.each_replica(lambda engine, replica: engine.metrics_text.remote(replica=replica))
        text = merge_exposition([*parts, self._ingress_metrics(), self.resumer.metrics.render()])
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def _ingress_metrics(self) -> bytes:
        """The ingress's own series: request fields it ignored, by name; requests the guard
        refused, by status; the server's own faults."""
        lines = [b"# HELP pgroups_ignored_request_fields_total Requests that carried a field this server does not "
                 b"know (ignored; strict_request_fields refuses them).",
                 b"# TYPE pgroups_ignored_request_fields_total counter"]
        for name, n in sorted(self.ignored_fields.items()):
            label = json.dumps(name)[1:-1].replace("\\'", "'")
            lines.append(f'pgroups_ignored_request_fields_total{{field="{label}"}} {n}'.encode())
        lines += [b"# HELP pgroups_http_refused_total Requests and connections the HTTP layer refused before their "
                  b"route, by status (403 host or origin, 408 head or body too slow, 413 body too large, 415 not "
                  b"JSON, 429 per-client bound, 431 head too large, 503 in all).",
                  b"# TYPE pgroups_http_refused_total counter"]
        lines += [f'pgroups_http_refused_total{{status="{k}"}} {v}'.encode() for k, v in sorted(self.guard.refused.items())]
        lines += [b"# HELP pgroups_http_internal_errors_total Answers that were the server's own fault (500; each "
                  b"logged with its traceback).",
                  b"# TYPE pgroups_http_internal_errors_total counter",
                  f"pgroups_http_internal_errors_total {self.internal_errors}".encode()]
        return b"\n".join(lines) + b"\n"

    @app.get("/", include_in_schema=False)
    async def page(self) -> Response:
        """The page (deployments/web): a chat and the pipeline's live view. Static, so served
        without the key; every call it makes asks for it (held in the browser's memory only)."""
        return _static("index.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def page_file(self, name: str) -> Response:
        return _static(name)

    @app.get("/pipeline")
    async def pipeline(self, request: Request) -> Response:
        """The live figures of every engine replica (the page's pipeline view polls it): stages
        and their busy share since the last poll, groups and their slots, tokens per second
        and TTFT over the last minute, the topology and why."""
        self.check_auth(request)
        parts = await self.each_replica(lambda engine, replica: engine.pipeline.remote(replica=replica))
        topo = parts[0]["topology"] if parts else {"topology": "?", "reason": ""}
        return JSONResponse({"topology": topo, "replicas": parts})

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json(self, request: Request) -> Response:
        self.check_auth(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(self, request: Request) -> Response:
        self.check_auth(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @app.get("/redoc", include_in_schema=False)
    async def redoc(self, request: Request) -> Response:
        self.check_auth(request)
        return get_redoc_html(openapi_url="/openapi.json", title=app.title)
