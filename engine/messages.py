"""What reaches a pipeline group's thread: the messages of its inbox (principle 1 of the design:
a start, a cancel, a slot's save, restore or erase, a history's state for another group,
a stop), and a slot operation's refusal."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from engine.types import Request


@dataclass
class StartMsg:
    request: Request
    # the state of its history another group reads for it (engine/cache/move.py): a Future of
    # a ``Moved`` or None; the request starts once it is there, or without it after a while
    moved: Future | None = None


@dataclass
class ExportMsg:
    """Another group serves a request whose history this group holds: read its state."""

    prompt: list[int]
    salt: str
    reply: Future


@dataclass
class CancelMsg:
    request_id: str


@dataclass
class SlotOpMsg:
    action: str  # "save" | "restore" | "erase"
    slot_id: int
    path: Path | None
    reply: Future


class StopMsg:
    pass


class SlotBusyError(RuntimeError):
    pass
