"""The errors a request can meet, by what the client is told (no native import here)."""

from __future__ import annotations


class RequestError(ValueError):
    """The request cannot be served as asked (HTTP 400)."""


class QueueFullError(RuntimeError):
    """Every slot is busy and the wait queue is full (HTTP 429)."""


class NativeError(RuntimeError):
    """A llama.cpp call failed; ``rc`` is its return code where it has one."""

    def __init__(self, message: str, rc: int = 0) -> None:
        super().__init__(message)
        self.rc = rc
