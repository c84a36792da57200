"""Outputs for a caller in plain Python: a sink that routes each request's outputs to its own
queue (``OutputQueues``), and a whole answer (``Completion``)."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from engine.types import Output


@dataclass
class Completion:
    text: str
    final: Output
    tokens: list[int] = field(default_factory=list)  # the token ids generated (not the end-of-generation token)


class OutputQueues:
    """A sink that routes each request's outputs to its own ``queue.Queue``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, queue.Queue] = {}

    def register(self, request_id: str) -> queue.Queue:
        q: queue.Queue = queue.Queue()
        with self._lock:
            self._queues[request_id] = q
        return q

    def unregister(self, request_id: str) -> bool:
        """Forget a request; True when it had not finished (the caller should cancel it)."""
        with self._lock:
            q = self._queues.pop(request_id, None)
        return q is not None and not getattr(q, "finished", False)

    def put(self, outs: list[Output]) -> None:
        with self._lock:
            for o in outs:
                q = self._queues.get(o.request_id)
                if q is not None:
                    if o.finish_reason is not None:
                        q.finished = True  # type: ignore[attr-defined]
                    q.put(o)
