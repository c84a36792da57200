"""The HTTP ingress: routes every endpoint of every API module (``deployments.api``) and the
server's own, checks each request (the guard in front, then the key, the body, the model name)
and renders answers: one collect loop and one SSE loop for every generating endpoint, every
error in the endpoint's own shape, streams included.

A generating request is read into its API's request model and handed to the engine client
(``deployments.client``), which owns its round trip (submission, outputs, resume, cancel); the
endpoint's shaper turns the outputs into the answer. A client that goes away cancels its
request in the engine.
"""

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.background import BackgroundTask

from deployments import api, openapi
from deployments.answers import Answering, collect, guarded, install_error_handlers, sse, until_gone
from deployments.api.base import ApiError, Call, ErrorShape, Generate, openai_error
from deployments.client import EngineClient
from deployments.direct import DirectServer, HttpLimits
from deployments.guard import Guard, GuardSettings
from deployments.reader import RequestReader
from deployments.resume import ResumeSettings
from deployments.static import static
from observability.ingress_metrics import IngressMetrics
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


BODY_THREADS = 1  # threads that parse large bodies: Python holds the GIL, so more would only take the loop's turns
DIRECT_STOP_S = 20.0  # direct ingress: how long a stopping replica's running requests get
app.add_middleware(Guard, settings_of=lambda: getattr(_ingress(required=False), "guard", None))
openapi.install(app, [ep.request for ep in api.ENDPOINTS])
install_error_handlers(app, lambda path: ERROR_SHAPES.get(path, openai_error),
                       lambda: (ing := _ingress(required=False)) is not None and ing._internal())
_CURRENT: list[Any] = []  # an Ingress made outside Serve (tests)


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
                          openapi_extra=openapi.body_doc(ep.request))


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


@serve.deployment(name="ingress", max_ongoing_requests=MAX_ONGOING, graceful_shutdown_timeout_s=30,
                  graceful_shutdown_wait_loop_s=0.25)
@serve.ingress(app)
class Ingress:
    async def __init__(
        self,
        engine: Any,
        model_names: list[str],
        api_key: str | list[str] | None = None,
        request_timeout_s: float | None = None,
        max_body_bytes: int = 8 * 1024 * 1024,
        connect_timeout_s: float = 10.0,
        strict_request_fields: bool = False,
        cache_salt_by_key: bool = False,
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
        self.request_timeout_s = request_timeout_s
        self.bodies = ThreadPoolExecutor(BODY_THREADS, thread_name_prefix="ingress-bodies")
        self.reader = RequestReader(api_key, strict_request_fields, model_names, self.bodies, cache_salt_by_key)
        self.check_auth, self.body_json, self.read = self.reader.check_auth, self.reader.body_json, self.reader.read
        self.ignored_fields = self.reader.ignored_fields
        self.client = EngineClient(engine, connect_timeout_s, request_timeout_s,
                                   ResumeSettings(resume_limit, resume_wait_s), self.bodies)
        self.out, self.resumer = self.client.out, self.client.resumer
        self.internal_errors = 0  # 500s: the server's own faults
        self.guard = GuardSettings(max_body_bytes=max_body_bytes, keyless=not api_key, max_requests=MAX_ONGOING,
                                   error_shape=lambda path: ERROR_SHAPES.get(path, openai_error),
                                   **{k: tuple(v) if isinstance(v, list) else v for k, v in (guard or {}).items()})
        self.own_metrics = IngressMetrics(lambda: self.ignored_fields, lambda: self.guard.refused,
                                          lambda: self.internal_errors)
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
        await self.client.close()
        if self._stacks is not None:
            self._stacks.stop()

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
            res = await (self.client.call(req, n_bytes) if ep.call is None else ep.call(self.engine, req, n_bytes))
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
        g = await self.client.generate(api_req, n_bytes, ep.id_prefix, self.model_names[0])
        del api_req
        try:
            shaper = ep.shaper(g.answer)
            del g.answer
            if g.stream:
                resp: Response = StreamingResponse(
                    guarded(g, sse(g, shaper), shaper.failed, self._internal), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                    background=BackgroundTask(g.close))  # also when the client is gone before it starts
            elif self.http is not None:  # no proxy to cancel this call when its client leaves
                resp = await until_gone(request, collect(g, shaper, ep.error, self.request_timeout_s))
            else:
                resp = await collect(g, shaper, ep.error, self.request_timeout_s)
        except BaseException:  # nobody will read its outputs: the engine stops generating them
            await g.close()
            raise
        resp.headers["x-engine-replica"] = g.replica  # which engine replica (pair) served it
        return resp

    def _internal(self) -> None:
        self.internal_errors += 1

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
        text = merge_exposition([*parts, self.own_metrics.render(), self.resumer.metrics.render()])
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", include_in_schema=False)
    async def page(self) -> Response:
        """The page (deployments/web): a chat and the pipeline's live view. Static, so served
        without the key; every call it makes asks for it (held in the browser's memory only)."""
        return static("index.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def page_file(self, name: str) -> Response:
        return static(name)

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
        return openapi.swagger(app)

    @app.get("/redoc", include_in_schema=False)
    async def redoc(self, request: Request) -> Response:
        self.check_auth(request)
        return openapi.redoc(app)
