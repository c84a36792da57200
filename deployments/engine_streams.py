"""The output streams' engine half: which of an engine replica's streams each request's outputs
go to (one long-lived stream per ingress replica; ``deployments.streams`` is the ingress's half
and says why)."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.types import Failure, Fault, Output

log = logging.getLogger(__name__)


CLOSE = object()  # ends an output stream


class Conn:
    """One output stream to one ingress replica: its queue and the requests it carries."""

    def __init__(self, ingress_id: str, conn_id: str) -> None:
        self.ingress_id, self.id = ingress_id, conn_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.requests: set[str] = set()


class EngineStreams:
    """An engine replica's streams: which stream each request's outputs go to."""

    def __init__(self, observe: Callable[[Output], None], cancel: Callable[[str], Any]) -> None:
        self.owner: dict[str, Conn] = {}  # request id -> the stream its outputs go to
        self.conns: dict[str, Conn] = {}  # connection id -> stream
        self._observe, self._cancel = observe, cancel

    def deliver(self, outs: list[Output]) -> None:
        """One step's outputs, each to its request's stream (on the event loop)."""
        per_conn: dict[Conn, list[Output]] = defaultdict(list)
        for o in outs:
            conn = self.owner.get(o.request_id)
            if o.finish_reason is not None:
                self.owner.pop(o.request_id, None)
                if conn is not None:
                    conn.requests.discard(o.request_id)
            self._observe(o)
            if conn is not None:
                per_conn[conn].append(o)
        for conn, items in per_conn.items():
            conn.queue.put_nowait(items)

    def route(self, conn_id: str, ids: list[str]) -> Conn | None:
        """Send the outputs of ``ids`` by stream ``conn_id``; None: that stream is gone."""
        conn = self.conns.get(conn_id)
        if conn is not None:
            for m in ids:
                self.owner[m] = conn
                conn.requests.add(m)
        return conn

    def drop(self, conn: Conn, ids: list[str]) -> None:
        for m in ids:
            self.owner.pop(m, None)
            conn.requests.discard(m)

    async def serve(self, ingress_id: str, conn_id: str, hello: Any) -> AsyncIterator[Any]:
        """The stream ``conn_id``: ``hello``, then lists of outputs until it is closed; when it
        ends, its requests are cancelled."""
        conn = self.conns[conn_id] = Conn(ingress_id, conn_id)
        q = conn.queue
        try:
            yield hello
            while True:
                batch = await q.get()
                if batch is CLOSE:
                    return
                while not q.empty():
                    more = q.get_nowait()
                    if more is CLOSE:
                        yield batch
                        return
                    batch.extend(more)
                yield batch
        finally:
            if self.conns.get(conn_id) is conn:
                del self.conns[conn_id]
            for rid in list(conn.requests):
                self.owner.pop(rid, None)
                self._cancel(rid)
            conn.requests.clear()

    def cut_all(self, reason: str, fault: Fault) -> int:
        """End every request with a 503 towards its client (``fault``: what failed it), and
        close every stream (Serve's drain of this replica must not wait on them)."""
        cut = list(self.owner.items())
        for rid, conn in cut:
            conn.requests.discard(rid)
            conn.queue.put_nowait([Failure(rid, fault, reason)])
        self.owner.clear()
        for conn in self.conns.values():
            conn.queue.put_nowait(CLOSE)
        return len(cut)
