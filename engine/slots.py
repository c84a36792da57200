"""Slots: the state of one sequence of a group's context, and how a slot is chosen.

A ``Slot``'s mutable state belongs to its group's thread. The scheduler chooses among idle
slots from ``SlotView`` snapshots that the group publishes when it releases a slot.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.text import TextStream
from engine.types import Request

if TYPE_CHECKING:
    from engine.sampling import SamplerChain

MAX_BACKOFF = 32  # steps a row waits at most before drafting again


class SpecState:
    """A slot's speculation state (its group's thread only)."""

    __slots__ = ("skip", "misses")

    def __init__(self) -> None:
        self.skip = 0  # steps left without drafting
        self.misses = 0  # drafts in a row that were all rejected

    def reset(self) -> None:
        self.skip = self.misses = 0

    def wants(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        if drafted and not accepted:
            self.misses += 1
            self.skip = min(MAX_BACKOFF, 1 << (self.misses - 1))
        elif accepted:
            self.misses = 0


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
    saw_newline: bool = False  # the output has a newline (t_max_predict_ms ends it only after one)
    last_used: float = field(default_factory=time.monotonic)
    # n > 1: a leader's followers that wait for its prompt; a follower's leader
    forks: list[Slot] = field(default_factory=list)
    leader: Slot | None = None
    spec: SpecState = field(default_factory=SpecState)  # speculative decoding's back-off

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


# A prefix this close to the longest one counts as equal, so that the less busy group wins.
NEAR_PREFIX = 0.9


def choose_slot(
    idle: list[SlotView],
    prompt: np.ndarray,
    last_used: dict[int, float],
    similarity: float,
    busy: dict[int, set[int]] | None = None,
) -> SlotView:
    """The slot for a new prompt.

    Longest common prefix with the slot's cached tokens when it covers at least
    ``similarity`` of the prompt; among near-equal prefixes (and when no prefix is good
    enough) the group with fewer busy slots, so that the groups share the load at any
    concurrency; then the slot that keeps the group's busy sequence ids consecutive (one
    micro-batch per step, see engine/batching.py); then least recently used.
    ``busy`` maps a group to the sequence ids of its busy slots.
    """
    if not idle:
        raise ValueError("no idle slot")
    busy = busy or {}

    def n_busy(v: SlotView) -> int:
        return len(busy.get(v.group, ()))

    def new_runs(v: SlotView) -> int:
        seqs = busy.get(v.group, set())
        return 1 - (v.seq_id - 1 in seqs) - (v.seq_id + 1 in seqs)

    def rest(v: SlotView) -> tuple:
        return (new_runs(v), last_used.get(v.id, 0.0), v.id)

    lcp = {v.id: common_prefix(v.cached_tokens, prompt) for v in idle}
    best = max(lcp.values())
    if best > 0 and len(prompt) and best / len(prompt) >= similarity:
        near = [v for v in idle if lcp[v.id] >= NEAR_PREFIX * best]
        return min(near, key=lambda v: (n_busy(v), -lcp[v.id], *rest(v)))
    return min(idle, key=lambda v: (n_busy(v), *rest(v)))
