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

from engine.text.stream import TextStream
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
    cache_salt: str = ""  # the salt of the requests whose KV it holds (only theirs reuse it)


@dataclass(eq=False)
class Slot:
    id: int
    group: int
    seq_id: int
    cache_tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the sequence
    cache_salt: str = ""  # the cache_salt of the requests that wrote that KV: only theirs may reuse it
    # where those tokens sit among the model's positions, where that is not their index (engine/cache/positions.py)
    cache_shifts: list[tuple[int, int]] = field(default_factory=list)
    state: SlotState = SlotState.IDLE
    req: Request | None = None
    sampler: SamplerChain | None = None
    on_backend: bool = False  # the sampler chain is attached to the context (backend sampling)
    text: TextStream | None = None
    n_prompt_done: int = 0  # prompt tokens in the KV (reused + evaluated)
    n_checkpointed: int = 0  # the prompt's position of its last checkpoint (config.checkpoint_every)
    n_reused: int = 0
    n_generated: int = 0
    last_token: int = -1
    t_start: float = 0.0
    t_first_token: float = 0.0
    saw_newline: bool = False  # the output has a newline (t_max_predict_ms ends it only after one)
    last_used: float = field(default_factory=time.monotonic)
    # slots that wait for this slot's prompt to reach their ``n_from_leader`` tokens and take
    # a copy of its KV (n > 1 followers, and requests that share its prefix)
    waiters: list[Slot] = field(default_factory=list)
    leader: Slot | None = None  # the slot this one waits for
    n_from_leader: int = 0  # a waiting slot: how many of its leader's tokens it takes
    # an n > 1 follower: its whole prompt comes from the leader, and its first token is sampled
    # from the leader's row of the step that finishes that prompt
    on_leader_row: bool = False
    spec: SpecState = field(default_factory=SpecState)  # speculative decoding's back-off
    # steps in a row its prompt got fewer tokens than it would have taken first (engine/planner.py)
    n_passed: int = 0

    @property
    def waiting(self) -> bool:
        return self.leader is not None

    def start(self, r: Request, sampler: SamplerChain, n_reused: int, *, leader: Slot | None = None,
              n_from_leader: int = 0, on_leader_row: bool = False) -> None:
        """Run ``r`` here: its KV holds ``n_reused`` prompt tokens (or, with a leader, will hold
        the first ``n_from_leader`` of the leader's once they are computed)."""
        assert self.state is SlotState.IDLE, f"slot {self.id} is busy"
        self.req = r
        self.sampler = sampler
        self.text = r.text if r.text is not None else TextStream(r.params.stop)
        r.text = None
        self.n_prompt_done = self.n_reused = self.n_checkpointed = n_reused
        self.n_generated = 0
        self.last_token = -1
        self.t_start = time.monotonic()
        self.t_first_token = 0.0
        self.saw_newline = False
        self.n_passed = 0
        self.spec.reset()
        self.state = SlotState.PROMPT
        self.leader, self.n_from_leader, self.on_leader_row = leader, n_from_leader, on_leader_row
        if leader is not None:
            leader.waiters.append(self)

    def got_prefix(self, n: int) -> None:
        """A waiting slot got its leader's first ``n`` tokens (0: it evaluates them itself).
        An n > 1 follower's prompt counts as evaluated, not as reused from a cache."""
        if self.leader is not None:
            self.leader.waiters.remove(self)
        self.leader, self.n_from_leader = None, 0
        self.n_prompt_done = n
        if not self.on_leader_row:
            self.n_reused = n
        self.on_leader_row = False

    def finish(self) -> None:
        """Back to idle: the request, its sampler and its links go; the KV stays."""
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        # slots waiting for this one evaluate their prompt themselves; this one leaves its leader
        for w in self.waiters:
            w.leader, w.n_from_leader = None, 0
        self.waiters = []
        if self.leader is not None:
            self.leader.waiters.remove(self)
            self.leader, self.n_from_leader = None, 0
        self.on_leader_row = False
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
            cache_salt=self.cache_salt,
        )
