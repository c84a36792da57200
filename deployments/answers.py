"""How the ingress writes an answer: JSON without NaN, an error in the route's own shape (one
renderer for every ``ApiError`` and for whatever else fails, a 500), the HTTP status of a
request's failed last output, and a generating request's two loops over its outputs: collected
whole (cancelled when its client leaves) or streamed as the endpoint's events, a stream that
fails mid-way ending with the endpoint's own error event."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from deployments.api.base import ApiError, ErrorShape, dumps, openai_error
from deployments.client import Generation
from engine.types import SHUTTING_DOWN, Failure, Fault, Output

log = logging.getLogger(__name__)


class Answering(JSONResponse):
    """A JSON answer written with ``api.base.dumps``: never NaN or Infinity."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode()


def err_response(status: int, message: str, param: str | None = None, headers: dict | None = None,
                 shape: ErrorShape = openai_error) -> JSONResponse:
    return JSONResponse(shape(status, message, param), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, shape_of: Callable[[str], ErrorShape], internal: Callable[[], None]) -> None:
    """Every ``ApiError`` a route raises, in its path's error shape; anything else is the
    server's fault: a 500 in that shape, logged with its traceback and counted (``internal``)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return err_response(e.status, e.message, e.param, e.headers, shape_of(request.url.path))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        log.error("request to %s failed: %r", request.url.path, e, exc_info=e)
        internal()
        return err_response(500, f"internal error: {type(e).__name__}", shape=shape_of(request.url.path))


# The one place a failure becomes an HTTP status: the request's own error is the client's (400),
# the engine's own is a 500, a timeout a 504, and every lost, frozen or stopping stage or replica
# a 503 (retry; the ingress has resumed what it could).
FAULT_STATUS = {Fault.REQUEST: 400, Fault.INTERNAL: 500, Fault.TIMEOUT: 504, Fault.ENGINE: 503,
                Fault.STAGE_FROZEN: 503, Fault.REPLICA_LOST: 503, Fault.SHUTDOWN: 503}


def error_status(o: Output) -> tuple[int, str]:
    """The HTTP status and message of a request's failed last output. A request is only
    ever "cancelled" towards a client that is still there when the server cut it."""
    if isinstance(o, Failure):
        return FAULT_STATUS[o.fault], (o.message or "generation failed")
    return 503, SHUTTING_DOWN


async def until_gone(request: Request, work: Any) -> Response:
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


async def collect(g: Generation, shaper: Any, shape: ErrorShape, timeout_s: float | None) -> Response:
    """The whole answer of ``g``; a failed choice fails it (its Retry-After as every error's)."""
    lasts: dict[str, Output] = {}
    async for batch in g.outputs():
        shaper.add(batch)
        lasts.update((o.request_id, o) for o in batch if o.finish_reason is not None)
    failed = next((o for o in lasts.values() if o.failed), None)  # one failed choice fails it
    if failed is not None:
        e = ApiError(*error_status(failed))
        return err_response(e.status, e.message, headers=e.headers, shape=shape)
    if not g.finished:  # the wait timed out (504) before every choice's last output came
        return err_response(504, f"request timed out after {timeout_s} s", shape=shape)
    return Answering(shaper.final())


async def sse(g: Generation, shaper: Any) -> AsyncIterator[bytes]:
    """``g``'s answer as the endpoint's server-sent events."""
    opening = shaper.opening()
    if opening:
        yield opening
    async for batch in g.outputs():
        out = shaper.events(batch)
        failed = next((o for o in batch if o.failed), None)
        if failed is not None:
            yield out + shaper.failed(*error_status(failed))
            return
        if g.finished:  # every choice's last output has come (outputs() counts them)
            yield out + shaper.closing()
            return
        if out:
            yield out


async def guarded(g: Generation, events: AsyncIterator[bytes], failed: Callable[[int, str], bytes],
                  internal: Callable[[], None]) -> AsyncIterator[bytes]:
    """A stream that ends with an error event in the endpoint's own shape (``failed``, the
    shaper's), not a dropped connection, when shaping an event fails after the first byte
    (counted by ``internal``), and releases its request however it ends."""
    try:
        async for chunk in events:
            yield chunk
    except Exception as e:
        log.exception("stream of %s failed", g.rid)
        internal()
        message = f"the stream failed: {type(e).__name__}"
        try:
            yield failed(500, message)
        except Exception:  # the shaper itself is what failed
            yield b"data: " + json.dumps(openai_error(500, message)).encode() + b"\n\n"
    finally:
        await g.close()
