"""The output streams between the ingress and the engine replicas: the ingress's half (the
engine's is ``deployments.engine_streams``).

Tokens leave an engine replica in per-step batches: each ingress replica holds one long-lived
stream (the engine's ``outputs``) from each engine replica, carrying the outputs of every
request it submitted there, as many steps as have accumulated since its last read in one
item. A Ray item costs about a millisecond of CPU, so one item per token per request would
cost more than the model on a small box.

Every opening of a stream has its own connection id; a request is submitted on the current
connection and registered in the ingress first, so no output can arrive for an unknown
request, and a stream that ends fails only its own requests in the ingress (a fault, which
``deployments.resume`` resumes) and cancels only its own requests in the engine.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any

from deployments.api.base import ApiError, member_ids
from deployments.router import known_replicas
from engine.types import Delta, Failure, Fault, Output

log = logging.getLogger(__name__)

_BACKGROUND: set[asyncio.Task] = set()  # strong references until done


def detached(coro: Coroutine) -> asyncio.Task:
    """Run ``coro`` outside the HTTP request that asked for it. Serve cancels the handle
    calls made in a request's context when that request ends or its client goes away: the
    shared output stream, or a cancel sent as a client leaves, must not go with it."""
    task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


# ---- the ingress's half --------------------------------------------------------------------------


STREAM_LOST = "the engine replica restarted; retry the request"


class ChoiceInFlight:
    """One choice of a request in flight: the engine request it runs as now (its id, the
    output stream and replica it came by), every token it has emitted to the client so far,
    and its resumes (``deployments.resume``)."""

    __slots__ = ("engine_id", "conn", "replica", "tokens", "base", "done", "resumes", "paused_at", "resuming",
                 "given_up")

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id  # the member id first; a continuation's own id once resumed
        self.conn: str | None = None
        self.replica: str | None = None
        self.tokens: list[int] = []  # emitted so far, over every replica it ran on
        self.base = 0  # of those, the tokens emitted before the engine request it runs as now
        self.done = False  # its last output has come
        self.resumes = 0
        self.paused_at: float | None = None  # since when it waits for its continuation's first output
        self.resuming = False  # a continuation is being submitted
        self.given_up = False  # its fault ends it: no resume left, or no replica took it in time


class Pending:
    """A request's round trip as the ingress holds it: its queue (every choice's outputs, by
    whichever engine request id each runs as), the stream and replica it was submitted on, the
    engine's request as resuming needs it (``resume_from``: its prompt's token ids and settings), and
    per choice what it has emitted (``ChoiceInFlight``). What the client asked and how its answer is
    shaped (each choice's text, logprobs, reasoning split, tool-call parsing) live in the
    endpoint's shaper, which a resume keeps; the text an engine held back for a stop string is
    rebuilt from the tokens on the replica a choice resumes on."""

    __slots__ = ("rid", "queue", "conn", "replica", "finished", "echo", "n", "choices", "ids", "resume_from", "t0",
                 "t_first", "lost_on", "closed", "left")

    def __init__(self, rid: str, n: int = 1) -> None:
        self.rid = rid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.conn: str | None = None  # set once an engine replica took it
        self.replica: str | None = None
        self.finished = False
        self.echo: str | None = None
        self.n = n  # choices
        members = member_ids(rid, n)
        self.choices = [ChoiceInFlight(m) for m in members]
        self.ids: dict[str, int] = {m: i for i, m in enumerate(members)}  # every engine request id -> its choice
        self.resume_from: Any = None  # api.values.ResumeSpec: None, it cannot be resumed
        self.t0 = time.monotonic()
        self.t_first: float | None = None  # when its first token came
        self.lost_on: set[str] = set()  # replicas that failed it
        self.closed = False  # released: never resumed again
        self.left = n  # choices whose last output has not come

    def taken(self, res: Any) -> None:
        """An engine replica took it (``api.values.Submitted``)."""
        self.conn, self.replica, self.echo, self.resume_from = res.conn, res.replica, res.echo, res.resume
        for c in self.choices:
            c.conn, c.replica = res.conn, res.replica

    def seen(self, o: Output) -> Output | None:
        """``o`` as its client's choice's output (its member id, its figures counted over every
        replica it ran on), or None: an output of an engine request the choice no longer runs as."""
        i = self.ids.get(o.request_id)
        if i is None:
            return None
        c = self.choices[i]
        if c.done or o.request_id != c.engine_id:
            return None
        now = time.monotonic()
        c.tokens.extend(o.tokens)
        if self.t_first is None and o.tokens:
            self.t_first = now
        if o.finish_reason is not None:
            c.done = True
            self.left -= 1
            self.finished = self.left == 0
        if not c.resumes:
            return o
        o = o._replace(request_id=self.rid if i == 0 else f"{self.rid}#{i}")
        if not isinstance(o, Delta) and self.resume_from is not None:
            first = (self.t_first - self.t0) if self.t_first is not None else 0.0
            o = o._replace(prompt_tokens=self.resume_from.n_prompt, completion_tokens=o.completion_tokens + c.base,
                           cached_tokens=min(o.cached_tokens, self.resume_from.n_prompt), t_first_token=first,
                           t_end=now - self.t0)
        return o


class IngressStreams:
    """An ingress replica's streams: one per engine replica (pair) that the router knows of;
    before it knows any, one to whichever replica Serve picks. Outputs go to the queue of
    the request they belong to."""

    def __init__(self, engine: Any, connect_timeout_s: float) -> None:
        self.engine = engine
        self.connect_timeout_s = connect_timeout_s
        self.ingress_id = uuid.uuid4().hex
        self.pending: dict[str, Pending] = {}
        self.discover_task: asyncio.Task | None = None
        self.pumps: dict[str | None, asyncio.Task] = {}  # by the replica asked for (None: any)
        self.streams: dict[str, str] = {}  # engine replica id -> the output stream's connection id
        self._opening: dict[str | None, str] = {}  # a pump's stream being opened: its connection id
        self.connected = asyncio.Event()  # at least one output stream is up
        self._changed = asyncio.Event()

    @property
    def _deployment(self) -> str:
        return getattr(self.engine, "deployment_name", "engine")

    def known(self) -> set[str]:
        return known_replicas(self._deployment)

    def ensure(self) -> None:
        if self.discover_task is None or self.discover_task.done():
            self.discover_task = detached(self._discover())

    async def _discover(self) -> None:
        try:  # a first call makes the handle's router, which then learns the replicas
            await asyncio.wait_for(self.engine.info.remote(), self.connect_timeout_s)
        except Exception as e:  # no replica yet: the streams wait for one
            log.info("engine not answering yet: %s", e)
        while True:
            known = self.known()
            if not known:  # a handle without the pair router (or no replica yet): one stream to any
                if None not in self.pumps or self.pumps[None].done():
                    self.pumps[None] = detached(self._pump(None))
            elif self._reaching_any():
                pass  # which replica the first stream reaches shows when it registers: no second one to it
            else:
                for rid in known - set(self.streams):
                    if rid not in self.pumps or self.pumps[rid].done():
                        self.pumps[rid] = detached(self._pump(rid))
                for rid in [r for r in self.pumps if r is not None and r not in known]:
                    self.pumps.pop(rid).cancel()
            await asyncio.sleep(1.0 if self.streams else 0.2)

    def _reaching_any(self) -> bool:
        """Whether the stream to any replica (opened while the router knew none) is still being
        opened: once the router knows replicas, a stream per replica would otherwise be opened
        to the same one and two streams would hold it."""
        anyone = self.pumps.get(None)
        return anyone is not None and not anyone.done() and None in self._opening

    async def _pump(self, target: str | None) -> None:
        """Hold one output stream from an engine replica, with a fresh connection id each time
        it is opened. When a stream ends, only the requests submitted on it fail (503, retry)."""
        backoff = 0.2
        while True:
            known = self.known()
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
                        self.streams[replica] = conn
                        self._change()
                        self._opening.pop(target, None)
                        self.connected.set()
                        backoff = 0.2
                        continue
                    for o in batch:  # Outputs, as the engine made them
                        p = self.pending.get(o.request_id)
                        if p is not None:
                            p.queue.put_nowait(o)
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # the ingress is stopping, or the replica is gone
                    # straight to the replica, not through the router (which no longer lists a
                    # stopping replica): its graceful shutdown would otherwise wait on this call
                    gen.cancel()
                    raise
                log.warning("output stream %s from the engine was cancelled", conn[:8])
            except Exception as e:  # the engine replica died or is being replaced
                log.warning("output stream %s from the engine ended: %s", conn[:8], e)
            finally:
                if self._opening.get(target) == conn:
                    del self._opening[target]
                if replica is not None and self.streams.get(replica) == conn:
                    del self.streams[replica]
                    self._change()
                if not self.streams:
                    self.connected.clear()
            self.fail_stream(conn)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def fail_stream(self, conn: str) -> None:
        """The stream ``conn`` ended: each choice running by it gets a failed last output (a
        fault, which the ingress resumes)."""
        lost = {id(p): p for p in self.pending.values()}
        for p in lost.values():
            for c in p.choices:
                if c.conn == conn and not c.done and not c.resuming:
                    p.queue.put_nowait(Failure(c.engine_id, Fault.REPLICA_LOST, STREAM_LOST))

    def changes(self) -> asyncio.Event:
        """An event set the next time the set of streams changes."""
        return self._changed

    def _change(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_connected(self, timeout: float) -> dict[str, str] | None:
        """The output streams, once at least one is up; None: none came within ``timeout``."""
        self.ensure()
        try:
            await asyncio.wait_for(self.connected.wait(), max(timeout, 0.0))
        except TimeoutError:
            return None
        return dict(self.streams)

    async def connection(self) -> dict[str, str]:
        """The output streams requests can be submitted on, by engine replica."""
        self.ensure()
        if not self.connected.is_set():
            try:
                await asyncio.wait_for(self.connected.wait(), self.connect_timeout_s)
            except TimeoutError:
                raise ApiError(503, "the engine is not available (starting or restarting); retry",
                                headers={"Retry-After": "2"}) from None
        return dict(self.streams)

    def register(self, rid: str, n: int) -> Pending:
        p = Pending(rid, n)
        for m in member_ids(rid, n):
            self.pending[m] = p
        return p

    def forget(self, rid: str, n: int) -> None:
        for m in member_ids(rid, n):
            self.pending.pop(m, None)

    def forget_all(self, p: Pending) -> None:
        """Forget every engine request id a request ran as."""
        for eid in p.ids:
            if self.pending.get(eid) is p:
                del self.pending[eid]

    def attempt(self, p: Pending, choice: int, engine_id: str) -> None:
        """Choice ``choice`` of ``p`` runs as ``engine_id`` from now (registered before it is
        submitted: no output can come for an unknown id); outputs of what it ran as are dropped."""
        self.pending[engine_id] = p
        p.ids[engine_id] = choice
        p.choices[choice].engine_id = engine_id

    async def close(self) -> None:
        """End this replica's streams at the engines (whose graceful shutdown otherwise waits
        out its timeout on them: a caller that goes away does not end a streaming call there).
        Each pump cancels its call at the replica that serves it, directly: a stopping engine
        replica is no longer in the router's list, so a call routed to it would not arrive."""
        tasks = [t for t in [self.discover_task, *self.pumps.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
