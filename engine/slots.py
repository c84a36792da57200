"""Slots: the state of one sequence of a group's context, and how a slot is chosen.

A ``Slot``'s mutable state belongs to its group's thread; a request runs on it between
``Slot.start`` and ``Slot.finish`` (the one place a slot is reset). The scheduler chooses among
idle slots from ``SlotView`` snapshots that the group publishes when a slot starts or ends.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.prefix import common_prefix
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
    # slots that wait for this slot's prompt to reach ``share`` tokens and take a copy of its
    # KV (n > 1 followers, and requests that share its prefix); the leader such a slot waits for
    forks: list[Slot] = field(default_factory=list)
    leader: Slot | None = None
    share: int = 0  # a waiting slot: how many of its leader's tokens it takes
    joins: bool = False  # an n > 1 follower: it samples its first token from its leader's row
    spec: SpecState = field(default_factory=SpecState)  # speculative decoding's back-off

    @property
    def waiting(self) -> bool:
        return self.leader is not None

    def start(self, r: Request, sampler: SamplerChain, n_reused: int, *, leader: Slot | None = None,
              share: int = 0, joins: bool = False) -> None:
        """Run ``r`` here: its KV holds ``n_reused`` prompt tokens (or, with a leader, will hold
        the first ``share`` of the leader's once they are computed)."""
        assert self.state is SlotState.IDLE, f"slot {self.id} is busy"
        self.req = r
        self.sampler = sampler
        self.text = TextStream(r.params.stop)
        self.n_prompt_done = self.n_reused = n_reused
        self.n_generated = 0
        self.last_token = -1
        self.t_start = time.monotonic()
        self.t_first_token = 0.0
        self.saw_newline = False
        self.spec.reset()
        self.state = SlotState.PROMPT
        self.leader, self.share, self.joins = leader, share, joins
        if leader is not None:
            leader.forks.append(self)

    def took(self, n: int) -> None:
        """A waiting slot got its leader's first ``n`` tokens (0: it evaluates them itself).
        An n > 1 follower's prompt counts as evaluated, not as reused from a cache."""
        if self.leader is not None:
            self.leader.forks.remove(self)
        self.leader, self.share = None, 0
        self.n_prompt_done = n
        if not self.joins:
            self.n_reused = n
        self.joins = False

    def finish(self) -> None:
        """Back to idle: the request, its sampler and its links go; the KV stays."""
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        # slots waiting for this one evaluate their prompt themselves; this one leaves its leader
        for f in self.forks:
            f.leader, f.share = None, 0
        self.forks = []
        if self.leader is not None:
            self.leader.forks.remove(self)
            self.leader, self.share = None, 0
        self.joins = False
        self.text = None
        self.req = None
        self.state = SlotState.IDLE
        self.last_used = time.monotonic()

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


# A prefix this close to the longest one counts as equal, so that the less busy group wins.
NEAR_PREFIX = 0.9


def choose_slot(
    idle: list[SlotView],
    prompt: np.ndarray,
    last_used: dict[int, float],
    similarity: float,
    busy: dict[int, set[int]] | None = None,
    held: dict[int, int] | None = None,
    min_shared: int = 1,
) -> SlotView:
    """The slot for a new prompt.

    Longest common prefix with the slot's own cached tokens when it covers at least
    ``similarity`` of the prompt; among near-equal prefixes (and when no prefix is good
    enough) the group with fewer busy slots, so that the groups share the load at any
    concurrency; then the slot that keeps the group's busy sequence ids consecutive (one
    micro-batch per step, see engine/batching.py); then least recently used.
    ``busy`` maps a group to the sequence ids of its busy slots.

    ``held`` (groups that share prefixes between their slots) maps a group to the longest
    prefix of the prompt that any of its slots holds or is computing (``group_prefixes``).
    When that is at least ``min_shared`` tokens and clearly longer than any idle slot's own, it is weighed against balance: a
    group holding it counts one busy slot fewer, so it takes the request unless it is
    already busier than another group by two or more.
    """
    if not idle:
        raise ValueError("no idle slot")
    busy = busy or {}
    n = len(prompt)

    def n_busy(v: SlotView) -> int:
        return len(busy.get(v.group, ()))

    def new_runs(v: SlotView) -> int:
        seqs = busy.get(v.group, set())
        return 1 - (v.seq_id - 1 in seqs) - (v.seq_id + 1 in seqs)

    def rest(v: SlotView) -> tuple:
        return (new_runs(v), last_used.get(v.id, 0.0), v.id)

    def enough(k: int) -> bool:
        return k > 0 and n > 0 and k / n >= similarity

    lcp = {v.id: common_prefix(v.cached_tokens, prompt) for v in idle}
    best = max(lcp.values())
    in_group = {v.group: h if (h := (held or {}).get(v.group, 0)) >= min_shared else 0 for v in idle}
    best_held = max(in_group.values())
    if enough(best) and best >= NEAR_PREFIX * best_held:
        near = [v for v in idle if lcp[v.id] >= NEAR_PREFIX * best]
        return min(near, key=lambda v: (n_busy(v), -lcp[v.id], *rest(v)))
    if enough(best_held):
        def weighed(v: SlotView) -> tuple:
            h = in_group[v.group]
            return (n_busy(v) - (h >= NEAR_PREFIX * best_held), -h, -lcp[v.id], *rest(v))

        return min(idle, key=weighed)
    return min(idle, key=lambda v: (n_busy(v), *rest(v)))
