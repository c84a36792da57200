"""Slots: the state of one sequence of a group's context, and how a slot is chosen.

A ``Slot``'s mutable state belongs to its group's thread. The scheduler chooses among idle
slots from ``SlotView`` snapshots that the group publishes when it releases a slot.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from engine.sampling import SamplerChain
from engine.text import TextStream
from engine.types import Request


class SlotState(enum.Enum):
    IDLE = "idle"
    PROMPT = "processing_prompt"
    GENERATING = "generating"


@dataclass(frozen=True)
class SlotView:
    """An immutable snapshot of a slot, published by its group."""

    id: int
    group: int
    seq_id: int
    state: str
    n_cached: int
    request_id: str | None
    cached_tokens: np.ndarray = field(repr=False, compare=False)


@dataclass(eq=False)
class Slot:
    id: int
    group: int
    seq_id: int
    cache_tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the sequence
    state: SlotState = SlotState.IDLE
    req: Request | None = None
    sampler: SamplerChain | None = None
    on_backend: bool = False  # the sampler chain is attached to the context (backend sampling)
    text: TextStream | None = None
    n_prompt_done: int = 0  # prompt tokens in the KV (reused + evaluated)
    n_reused: int = 0
    n_generated: int = 0
    last_token: int = -1
    t_start: float = 0.0
    t_first_token: float = 0.0
    last_used: float = field(default_factory=time.monotonic)

    def view(self) -> SlotView:
        return SlotView(
            id=self.id,
            group=self.group,
            seq_id=self.seq_id,
            state=self.state.value,
            n_cached=len(self.cache_tokens),
            request_id=self.req.id if self.req else None,
            cached_tokens=np.asarray(self.cache_tokens, dtype=np.int32),
        )


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def choose_slot(
    idle: list[SlotView],
    prompt: np.ndarray,
    last_used: dict[int, float],
    similarity: float,
) -> SlotView:
    """Longest common prefix with the slot's cached tokens, else least recently used."""
    if not idle:
        raise ValueError("no idle slot")
    best, best_lcp = None, 0
    for v in idle:
        lcp = common_prefix(v.cached_tokens, prompt)
        if lcp > best_lcp:
            best, best_lcp = v, lcp
    if best is not None and len(prompt) and best_lcp / len(prompt) >= similarity:
        return best
    return min(idle, key=lambda v: (last_used.get(v.id, 0.0), v.id))
