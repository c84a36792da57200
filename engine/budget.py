"""Chunked prefill: how many prompt tokens a step may carry while other streams decode.

A step that evaluates a prompt chunk beside generating rows makes every one of those streams
wait for the chunk, and so does every other group's next step behind it on the shared stages.
llama-server fills the batch up to ``n_batch``, so a long prompt stretches the others' gaps
by its chunk's whole cost. Cut too small, the chunk starves the prompt instead: a step's fixed
part (the rows, reading the weights) then dominates and the prompt crawls. The budget serves
both sides. Decodes come first; the long prompts' chunk ``k`` is then the largest of

- ``k_gap``: the largest chunk whose step lasts at most ``gap_factor`` times a step of the same
  rows without it, so the others' token gap grows by at most that factor; and
- ``k_rate``: the smallest chunk at which the prompt progresses at least ``min_rate`` of the
  rate the whole batch would give it (its idle rate, on an idle server), so it is never
  starved: ``k / seconds(rows, k) >= min_rate * capacity / seconds(rows, capacity)``.

Where both hold the streams get the larger chunk's gap and the prompt more than its floor;
where they conflict (a prompt token costs the stages a fair share of a row, as on a CPU) the
prompt's floor wins and the gap grows past ``gap_factor``, but never past ``1 / (1 - min_rate)``
times: where a small chunk costs much more a token than a large one, the floor alone would ask
for chunks near the whole batch, seconds of stall for every stream. The step's seconds come
from a cost model fitted to the steps themselves (engine/cost.py): a line in the generating
rows, plus a per-token cost by chunk size (a chunk of 8 costs more a token than one of 256).
A prompt gets at least ``chunk_min`` tokens a step.

Chunks do not save the decoding streams any time in all (the prompt's tokens cost the stages
as much or more, cut: on a CPU a token of a chunk up to 64 costs 1.5 to 1.8 times one of a
whole batch, mostly in ggml's flash attention, which takes query rows one at a time below
64): they spread the wait over many steps, so no stream stalls for a whole chunk, and the
prompt pays for it with its first token, later by the extra steps and the dearer tokens.
That is worth it while the streams decoding outnumber the prompts waiting (one long prompt
beside many streams); when they do not (a burst of prompts, the first of which has begun to
decode), the prompts go in large chunks: the largest the model prices at ``burst_step_s``
(the whole batch where it fits, as on a GPU; never under ``BURST_MIN``), so that a request
arriving meanwhile waits at most about that long for the step in flight, where a whole
batch of a CPU takes seconds. One prompt alone goes whole, as on llama-server.

A short prompt (at most ``prefill_long_tokens`` to evaluate) is not queued behind long ones:
it claims a step's prompt tokens first (engine/planner.py, ``prompt_order``), and while one
waits for its first token in any group, the steps of every group carry at most
``beside_short`` tokens of long prompts, so that the short one's step, and the other groups'
steps beside it on the shared stages, are quick. A long prompt held back ``aging`` steps in a
row is exempt, so a stream of short prompts never starves it.

One budget and one cost model are shared by the engine's groups (they run the same model on
the same stages); each group writes its own step times and its counts of generating rows, of
prompts waiting and of short prompts among them, and reads the others'. Every reading and
writing method holds the budget's lock: the groups' threads write the shared lists and the
cost model's sums (read-modify-write) on the step's path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.cost import StepCost

# a burst's chunk is never smaller: on a CPU a prompt token costs a step 6 to 8 ms in chunks up to
# 64 tokens and 4 to 4.6 ms from 128 (bench-long's cost cell; ggml's flash attention)
BURST_MIN = 128


class PrefillBudget:
    def __init__(self, n_groups: int, gap_factor: float | None, min_rate: float = 0.0, chunk_min: int = 8,
                 beside_short: int | None = None, cost: StepCost | None = None,
                 burst_step_s: float | None = None) -> None:
        self.gap_factor = gap_factor  # None: off (llama-server's behaviour)
        self.burst_step_s = burst_step_s  # None: a burst's steps are whole batches
        self.min_rate = min_rate  # 0: the gap bound alone
        self.chunk_min = max(1, chunk_min)
        self.beside_short = beside_short  # None: long prompts fill the step beside short ones
        self.cost = cost or StepCost()
        self.decoding = [0] * n_groups  # generating rows per group, after its last step
        self.prompting = [0] * n_groups  # prompts with tokens to evaluate per group, likewise
        self.short = [0] * n_groups  # short prompts among them (published when one starts too)
        self.carrying = [0] * n_groups  # prompt tokens of each group's step in flight
        self.overlapped = [False] * n_groups  # its step in flight ran beside another group's prompt tokens
        self._lock = threading.Lock()

    def publish(self, group: int, decoding: int, prompting: int, short: int) -> None:
        """``group``'s counts after its step: generating rows, prompts waiting, short ones among them."""
        with self._lock:
            self.decoding[group], self.prompting[group], self.short[group] = decoding, prompting, short

    def expected(self, n_rows: int, n_prompt: int) -> float | None:
        """Seconds the cost model expects a step of ``n_rows`` generating rows and ``n_prompt``
        prompt tokens to take (None: no such step learnt yet)."""
        with self._lock:
            return self.cost.step(n_rows, n_prompt)

    def begin(self, group: int, n_prompt: int) -> None:
        """``group``'s step with ``n_prompt`` prompt tokens starts. A step of another group in
        flight meanwhile waits for this one's chunk on the shared stages, and so does one that
        starts while this one runs: such a step says what a chunk costs the others, not what a
        decode step costs, and is kept out of the decode line (``observe``). Counted into the
        line, those slowed steps would raise the reference the gap bound multiplies, so the
        chunks would grow, slow the others' steps more, and grow again."""
        with self._lock:
            self.carrying[group] = n_prompt
            self.overlapped[group] = any(k for g, k in enumerate(self.carrying) if g != group)
            if n_prompt:
                for g in range(len(self.overlapped)):
                    if g != group:
                        self.overlapped[g] = True

    def end(self, group: int) -> bool:
        """``group``'s step is over (run or failed); whether it ran beside another's prompt tokens."""
        with self._lock:
            return self._end(group)

    def _end(self, group: int) -> bool:
        overlapped, self.overlapped[group] = self.overlapped[group], False
        self.carrying[group] = 0
        return overlapped

    def observe(self, n_rows: int, n_prompt: int, seconds: float, group: int = 0) -> None:
        """A step of ``group`` ran for ``seconds``: ``n_prompt`` prompt tokens beside ``n_rows``
        generating rows. A decode step that ran beside another group's chunk is not learnt from."""
        with self._lock:
            if self._end(group) and n_prompt == 0:
                return
            self.cost.observe(n_rows, n_prompt, seconds)

    def tokens(self, group: int, n_generating: int, capacity: int, n_prompting: int = 1) -> int:
        """The most prompt tokens the next step of ``group`` may carry (its own generating rows
        ``n_generating`` and prompts waiting ``n_prompting``; the batch holds ``capacity``)."""
        with self._lock:
            return self._tokens(group, n_generating, capacity, n_prompting)

    def _tokens(self, group: int, n_generating: int, capacity: int, n_prompting: int) -> int:
        others = [g for g in range(len(self.decoding)) if g != group]
        decoding = n_generating + sum(self.decoding[g] for g in others)
        prompting = n_prompting + sum(self.prompting[g] for g in others)
        if self.gap_factor is None or capacity <= self.chunk_min:
            return capacity
        if decoding <= prompting:
            return self.burst(n_generating, capacity) if prompting > 1 else capacity
        return self.chunk(n_generating, max((self.decoding[g] for g in others), default=0), capacity)

    def chunk(self, rows: int, other_rows: int, capacity: int) -> int:
        """The chunk beside ``rows`` generating rows of its own group (``other_rows``: the most
        another group has, whose gap is bounded when the group has none)."""
        cost, lo = self.cost, self.chunk_min
        ref = self.cost.base(rows or other_rows)  # the step whose gap is bounded, without prompt tokens
        if ref is None or cost.per_token(lo) is None:
            return lo  # nothing learnt yet: the smallest chunk teaches the model
        assert self.gap_factor is not None

        def step(k: int) -> float:
            return cost.step(rows, k) or 0.0

        k_gap = self._within(rows, capacity, self.gap_factor * ref)
        if self.min_rate <= 0:
            return k_gap
        full = capacity / max(step(capacity), 1e-9)  # the rate the whole batch would give it
        k_rate = _first(lo, capacity, lambda k: k / max(step(k), 1e-9) >= self.min_rate * full) or capacity
        # the rate bound stretches the others' gap at most to what it costs where a prompt token
        # costs the same in any chunk: 1 / (1 - min_rate) times. Where small chunks cost much
        # more a token than large ones (a CPU), the rate bound alone would ask for chunks near
        # the whole batch and stall every stream for seconds, for little more rate
        if self.min_rate < 1:
            cap = max(self.gap_factor, 1 / (1 - self.min_rate))
            k_rate = min(k_rate, self._within(rows, capacity, cap * ref))
        return max(k_gap, k_rate)

    def burst(self, rows: int, capacity: int) -> int:
        """A burst's chunk beside ``rows`` generating rows: the largest whose step the model prices
        at most ``burst_step_s``, but never under ``BURST_MIN`` tokens (a slow device's bound would
        otherwise cut the burst into chunks that cost much more a token); the whole batch where it
        fits, or where nothing is learnt yet (its step teaches the model what a large chunk costs)."""
        if self.burst_step_s is None or self.cost.step(rows, capacity) is None:
            return capacity
        return max(self._within(rows, capacity, self.burst_step_s), min(capacity, BURST_MIN))

    def _within(self, rows: int, capacity: int, seconds: float) -> int:
        """The largest chunk, at least ``chunk_min``, whose step beside ``rows`` generating rows
        the model prices at most ``seconds``."""
        lo = self.chunk_min
        return _last(lo, capacity, lambda k: (self.cost.step(rows, k) or 0.0) <= seconds) or lo

    def long_cut(self, group: int, n_short: int) -> int | None:
        """The most tokens of long prompts the next step of ``group`` may carry beside short
        prompts (``n_short`` wait in this group): ``beside_short`` while one waits in any group,
        else None (no cut)."""
        if self.beside_short is None:
            return None
        with self._lock:
            if n_short or any(k for g, k in enumerate(self.short) if g != group):
                return self.beside_short
        return None


def _last(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The largest k in [lo, hi] with ``ok(k)``, for ``ok`` true up to a point and false after."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _first(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The smallest k in [lo, hi] with ``ok(k)``, for ``ok`` false up to a point and true after."""
    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo
