"""What reaches a pipeline group's thread: the messages of its inbox (principle 1 of the design:
a start, a cancel, a slot's save, restore or erase, a stop), and a slot operation's refusal."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from engine.types import Request


@dataclass
class StartMsg:
    request: Request


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
