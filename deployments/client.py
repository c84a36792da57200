"""The ingress's engine client: one generating request's round trip to the engine replicas, from
its submission to its last output, and nothing of HTTP.

``EngineClient.generate`` makes an API request's prompt here (its template, its tokens:
``deployments.prompts``, on this client's threads, never beside the engine's group threads),
submits the ``EngineRequest`` on this ingress's output stream from a replica
(``deployments.streams``), registered first so that no output can come for an unknown
request, and returns a ``Generation``: what the shaper needs (``answer``), the replica that took
it, and its outputs as an async iterator of lists (one list per step while the reader keeps up),
each as its choice's: a fault is resumed on another replica (``deployments.resume``), a
timeout is the request's 504. ``Generation.close`` (or the iterator's end) releases the
request: whatever of it has not finished is cancelled in the engine, and it is never resumed
after; ``EngineClient.abort`` is that for a request id.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from deployments.api.base import Answer, member_ids
from deployments.api.values import Prepared, ResumeSpec
from deployments.errors import CLIENT_ERRORS, ApiError
from deployments.prompts import Makers, PromptMaker
from deployments.resume import Resumer, ResumeSettings
from deployments.router import Route, prefix_hashes, routing_text
from deployments.streams import IngressStreams, Pending, detached
from engine.types import Delta, Failure, Fault, Output

log = logging.getLogger(__name__)

OFFLOAD_BYTES = 64 * 1024  # bodies larger than this are parsed and hashed off the event loop
PREPARE_THREADS = 2  # prompts made at once (a template's rendering and a tokenizer's run release no GIL)
LARGE_BODY_BYTES = 256 * 1024  # larger bodies' prompts are made on a thread of their own, one at a time


async def sized(pool: ThreadPoolExecutor, n_bytes: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` for a body of ``n_bytes``: inline when small, on ``pool``'s threads when large
    (the loop delivers every stream's tokens meanwhile; large bodies wait their turn there)."""
    return fn(*args) if n_bytes < OFFLOAD_BYTES else await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


@dataclass
class Generation:
    """A submitted request: its id, what its answer's shaper reads, the replica that took it,
    and its outputs (``outputs()``, once)."""

    rid: str
    answer: Answer
    replica: str
    stream: bool
    pending: Pending
    client: EngineClient

    def outputs(self) -> AsyncIterator[list[Output]]:
        return self.client.outputs(self.rid, self.pending)

    @property
    def finished(self) -> bool:
        """Every choice's last output has come."""
        return self.pending.finished

    async def close(self) -> None:
        await self.client.abort(self.rid)


class EngineClient:
    def __init__(self, engine: Any, connect_timeout_s: float, request_timeout_s: float | None,
                 resume: ResumeSettings, bodies: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.request_timeout_s = request_timeout_s
        self.out = IngressStreams(engine, connect_timeout_s)
        self.resumer = Resumer(engine, self.out, resume)
        self.bodies = bodies
        self.makers = Makers()
        self._prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
        self._prepare_large = ThreadPoolExecutor(1, thread_name_prefix="prepare-large")

    async def maker(self) -> PromptMaker:
        """The prompt maker of the served model (made once, from the first replica's ``info``)."""
        if (m := self.makers.ready) is not None:
            return m
        try:
            info = await asyncio.wait_for(self.engine.info.remote(), timeout=30.0)
        except Exception as e:  # no replica serves yet
            raise ApiError(503, f"the engine is not available (starting or restarting); retry ({type(e).__name__})") \
                from None
        try:
            return await asyncio.get_running_loop().run_in_executor(self._prepare, self.makers.get, info)
        except Exception as e:  # the GGUF is not on this node at the engine's path, or unreadable
            log.error("the ingress could not load the model's vocabulary from %s: %r", info.get("model_path"), e)
            raise ApiError(503, f"the ingress cannot read the model's vocabulary ({info.get('model_path')!r}: "
                           f"{type(e).__name__}); the model file must be on the ingress's node at the engine's path") \
                from None

    async def run(self, fn: Callable[..., Any], n_bytes: int, *args: Any) -> Any:
        """``fn(*args)`` (a prompt's making, an API call's run) on this client's threads for a body
        of ``n_bytes``; the client's errors as an ``ApiError`` raised."""
        pool = self._prepare_large if n_bytes > LARGE_BODY_BYTES else self._prepare
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except ApiError:
            raise
        except CLIENT_ERRORS as e:  # RequestError, a template's error, what a wrong value raises: the client's 400
            raise ApiError(400, str(e)[:1000] or type(e).__name__) from None

    async def call(self, api_req: Any, n_bytes: int) -> Any:
        """An API call that needs only the model's vocabulary and template (``api_req.run(maker)``:
        tokenize, detokenize, apply a template, count tokens), here."""
        return await self.run(api_req.run, n_bytes, await self.maker())

    async def generate(self, api_req: Any, n_bytes: int, id_prefix: str, model_name: str) -> Generation:
        """Make ``api_req``'s prompt (an API module's request, its body ``n_bytes``) and submit it;
        raises ``ApiError`` (the client's error met while its prompt was made, the engine's refusal)."""
        req = api_req.served_as()  # what the engine runs
        maker = await self.maker()
        rid = id_prefix + uuid.uuid4().hex
        prepared: Prepared = await self.run(req.prepare, n_bytes, maker, rid)
        er = prepared.request
        conns = await self.out.connection()
        p = self.out.register(rid, req.n)
        try:
            route = Route(tuple(conns), tuple(await sized(self.bodies, n_bytes, prefix_hashes, routing_text(req),
                                                           getattr(er, "cache_salt", ""))))
            res = await self.engine.submit.remote(conns, er, route=route, n_bytes=n_bytes)
        except BaseException:
            self.out.forget(rid, req.n)
            # the client left (or the call failed) while the engine may have taken it: cancel
            # there too, or it generates what nobody reads (a cancel of an unknown id is a no-op)
            detached(self.cancel(rid, req.n))
            raise
        if isinstance(res, ApiError):
            self.out.forget(rid, req.n)
            raise res
        res = replace(res, echo=prepared.echo, tools=prepared.tools, reasoning=prepared.reasoning,
                      resume=ResumeSpec.of(er, res))
        p.taken(res)  # its stream, its replica, its prompt's ids; echo: completions' prompt text comes first
        if p.conn not in self.out.streams.values():  # its stream ended while it was submitted
            self.out.fail_stream(p.conn)
        return Generation(rid, Answer(rid, model_name, api_req, req, res), res.replica, bool(req.stream), p, self)

    async def outputs(self, rid: str, p: Pending) -> AsyncIterator[list[Output]]:
        """The request's outputs until its last, as lists of what has arrived since the last
        read (one list per step while the client keeps up, several steps when it falls
        behind), each as its choice's (a fault is resumed, not passed on: ``Resumer.for_client``);
        cancels the request in the engine if abandoned."""
        deadline = time.monotonic() + self.request_timeout_s if self.request_timeout_s else None
        q, for_client = p.queue, self.resumer.for_client
        try:
            if p.echo:
                yield [Delta(m, p.echo, 0) for m in member_ids(rid, p.n)]
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    o = await asyncio.wait_for(q.get(), timeout)
                except TimeoutError:
                    yield [Failure(rid, Fault.TIMEOUT, f"request timed out after {self.request_timeout_s} s")]
                    return
                batch = for_client(p, o)
                while not p.finished and not q.empty():
                    batch += for_client(p, q.get_nowait())
                if batch:
                    yield batch
                if p.finished:
                    return
        finally:
            await self.abort(rid)

    async def abort(self, rid: str) -> None:
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
            detached(self.cancel(rid, p.n, p.replica))  # the request as first submitted, its family whole
        for c in p.choices:
            if c.resumes and not c.done and c.replica is not None:
                detached(self.cancel(c.engine_id, 1, c.replica))

    async def cancel(self, rid: str, n: int = 1, replica: str | None = None) -> None:
        try:
            await self.engine.cancel.remote(rid, n, replica=replica)
        except Exception:  # the engine is gone; nothing to cancel
            pass

    async def close(self) -> None:
        await self.out.close()
        self._prepare.shutdown(wait=False)
        self._prepare_large.shutdown(wait=False)
