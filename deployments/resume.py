"""Resuming a request whose engine replica failed it for a fault, where it was.

A fault is the replica's, never the client's: its output stream ended (the replica's process
died), its engine failed the request with a 503 (a group died with its stage, or the
frozen-stage watchdog fired). The ingress then sends each unfinished choice again, as a
continuation (``ResumeSpec.continuation``, an ``EngineRequest``): the original prompt's token
ids and every token the choice emitted, the budget less them, the same settings; on the replica
that takes it the grammar and the held-back text are advanced over those tokens
(``Engine.accept``), so the client's stream or
collected answer goes on with no token lost or repeated. A restarting replica's 503 and a
replica that is gone are waited through, for ``resume_wait_s``.

Bounds: ``resume_limit`` resumes per choice; a request that two replicas failed is not resumed
again (it must not take replicas down one after another); a request whose client has gone
(released) never is; a request's own errors (4xx) and a shutdown's are not faults.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from deployments.api.values import Submitted
from deployments.router import Route
from deployments.streams import STREAM_LOST, IngressStreams, Pending, detached
from engine.types import Failure, Fault, Output
from observability.resume import ResumeMetrics

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 1.0  # between a resume's tries while no replica takes it


@dataclass(frozen=True)
class ResumeSettings:
    limit: int = 3  # resumes per choice; 0: none
    wait_s: float = 120.0  # how long a resume waits for a replica to take it


def fault_cause(o: Output) -> Fault | None:
    """The fault that ended ``o``'s request, to resume it from (its value the resume metrics'
    label); None: nothing to resume (it goes on or finished, or failed by its own error, a
    shutdown or a timeout)."""
    return o.fault if isinstance(o, Failure) and o.fault.resumable else None


class Resumer:
    """An ingress replica's resumes: which outputs are faults, and the continuations sent."""

    def __init__(self, engine: Any, out: IngressStreams, settings: ResumeSettings) -> None:
        self.engine, self.out, self.settings = engine, out, settings
        self.metrics = ResumeMetrics()
        self.tasks: set[asyncio.Task] = set()

    def for_client(self, p: Pending, o: Output) -> list[Output]:
        """What ``o`` gives the client of ``p``: nothing (an output of an engine request a
        choice no longer runs as, or a fault being resumed), or the output as its choice's."""
        i = p.ids.get(o.request_id)
        if i is None:
            return []
        c = p.choices[i]
        if c.done or o.request_id != c.engine_id:
            return []
        if c.paused_at is not None:
            self.metrics.paused(time.monotonic() - c.paused_at)
            c.paused_at = None
        cause = None if c.given_up else fault_cause(o)
        if cause is not None:
            if c.resuming:  # its continuation's submit has not returned: that one goes on
                return []
            refusal = self._refusal(p, i)
            if c.replica is not None:
                p.lost_on.add(c.replica)
            if refusal is None:
                self.metrics.resumed(cause)
                log.warning("resuming %s choice %d after %d tokens (%s: %s)", p.rid, i, len(c.tokens), cause, o.message)
                self._start(p, i)
                return []
            if refusal[0] != "closed":
                self.metrics.failed(refusal[0])
            o = o._replace(message=f"{o.message} ({refusal[1]})")
        seen = p.seen(o)
        return [] if seen is None else [seen]

    def _refusal(self, p: Pending, i: int) -> tuple[str, str] | None:
        """Why choice ``i`` of ``p`` is not resumed (the metric's reason and the client's
        words), or None: it is."""
        c = p.choices[i]
        if p.closed:
            return "closed", "its client has gone"
        if p.resume_from is None:
            return "unresumable", "it cannot be resumed"
        if c.resumes >= self.settings.limit:
            return "limit", f"resumed {c.resumes} times, resume_limit {self.settings.limit}"
        if len(p.lost_on | ({c.replica} if c.replica else set())) >= 2:
            return "replicas", "two engine replicas failed it; it is not resumed on a third"
        return None

    def _start(self, p: Pending, i: int) -> None:
        c = p.choices[i]
        c.resumes += 1
        c.base = len(c.tokens)
        c.paused_at = time.monotonic()
        c.resuming = True
        task = detached(self._resume(p, i))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _resume(self, p: Pending, i: int) -> None:
        """Send choice ``i`` of ``p`` on as a continuation, to whichever replica takes it
        within ``resume_wait_s``; else it fails with why."""
        c = p.choices[i]
        deadline = time.monotonic() + self.settings.wait_s
        cont = p.resume_from.continuation(i, c.tokens)
        eid = f"{p.rid}.{i}.r{c.resumes}"
        self.out.attempt(p, i, eid)
        why, backoff = "", 0.1
        try:
            while not p.closed:
                left = deadline - time.monotonic()
                conns = await self.out.wait_connected(left) if left > 0 else None
                if conns is None or p.closed:
                    break
                try:
                    res = await self.engine.submit.remote(conns, replace(cont, id=eid),
                                                          route=resume_route(conns, p.lost_on))
                except Exception as e:  # the replica it reached is gone: another, or the new one
                    res, why = None, f"the engine is not available: {type(e).__name__}"
                if isinstance(res, Submitted):
                    if p.closed:
                        await self._cancel(eid, res.replica)
                        return
                    if res.conn in self.out.streams.values():
                        c.conn, c.replica, c.resuming = res.conn, res.replica, False
                        return
                    await self._cancel(eid, res.replica)  # its stream ended meanwhile: again
                    eid = f"{eid}x"
                    self.out.attempt(p, i, eid)
                elif res is not None:
                    why = res.message
                    if res.status not in (429, 503):  # the continuation's own error: no replica takes it
                        c.resuming, c.given_up = False, True
                        self.metrics.failed("unresumable")
                        p.queue.put_nowait(Failure(eid, Fault.REPLICA_LOST, f"{STREAM_LOST} (not resumed: {why})"))
                        return
                try:
                    await asyncio.wait_for(self.out.changes().wait(), min(backoff, max(0.0, deadline - time.monotonic())))
                except TimeoutError:
                    pass
                backoff = min(backoff * 2, MAX_BACKOFF_S)
        except Exception as e:  # never leave the client waiting
            log.exception("resume of %s failed", p.rid)
            why = f"the resume failed: {type(e).__name__}"
        c.resuming = False
        if p.closed:
            return
        c.given_up = True
        self.metrics.failed("wait")
        wait = f"no engine replica took it within resume_wait_s {self.settings.wait_s:g}"
        p.queue.put_nowait(Failure(eid, Fault.REPLICA_LOST, f"{STREAM_LOST} (not resumed: {wait}{'; ' + why if why else ''})"))

    async def _cancel(self, eid: str, replica: str | None) -> None:
        try:
            await self.engine.cancel.remote(eid, 1, replica=replica)
        except Exception:  # the replica is gone: nothing to cancel
            pass


def resume_route(conns: dict[str, str], lost_on: set[str]) -> Route:
    """Where a continuation may go: the replicas the ingress holds a stream to but those that
    failed its request. A replica that failed (its stage lost, its group dead) still holds its
    stream until Serve's health check replaces it, and with no request left it looks the least
    busy: routed there, a continuation would be refused and retried for seconds while another
    pair is idle. With no other replica, the one there is (it restarts and serves again)."""
    return Route(tuple(r for r in conns if r not in lost_on) or tuple(conns), ())
