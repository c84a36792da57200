"""Host-path profiler of one pipeline group.

The group's thread is the only writer of its ``GroupProfiler``; other threads read the
immutable ``ProfileSnapshot`` it publishes after each step (an atomic reference swap), so
reading the figures never races with writing them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, fields

log = logging.getLogger(__name__)

PHASES = ("wait", "draft", "batch", "decode", "sync", "sample", "detok", "stop", "send")


@dataclass(frozen=True)
class ProfileSnapshot:
    group: int = 0
    steps: int = 0
    rows: int = 0  # sampled rows (generated tokens) over all steps
    batch_tokens: int = 0  # tokens decoded (prompt + generated)
    ubatches: int = 0  # micro-batches llama.cpp cut the steps into (each reads all weights)
    busy_slots_sum: int = 0  # sum over steps of slots busy during the step
    kv_used: int = 0  # KV cells holding tokens after the last step
    kv_total: int = 0
    drafts: int = 0  # speculative decoding: rows verified with a draft
    drafted: int = 0  # ... draft tokens verified
    accepted: int = 0  # ... and accepted
    prefix_copied: int = 0  # prompt tokens whose KV was copied from another slot of the group
    # histories moved from another group's context (engine/cache/move.py): requests, their
    # prompt tokens, the states' bytes; and states this group read for another
    moved_in: int = 0
    moved_tokens: int = 0
    moved_bytes: int = 0
    moved_out: int = 0
    # the group's prompt cache (engine/cache/prompt_cache.py): entries it has, hold, and their tokens
    cache_capacity: int = 0
    cache_entries: int = 0
    cache_tokens: int = 0
    cache_saves: int = 0  # ... counters: slots' KV saved into it
    cache_hits: int = 0  # prompts that took a prefix from it
    cache_reused: int = 0  # prompt tokens they took
    cache_evictions: int = 0  # entries overwritten while holding a conversation of their own
    cache_superseded: int = 0  # entries overwritten by a later state of their conversation
    cache_misses: int = 0  # prompts that found nothing to reuse
    wait: float = 0.0
    draft: float = 0.0
    batch: float = 0.0
    decode: float = 0.0
    sync: float = 0.0
    sample: float = 0.0
    detok: float = 0.0
    stop: float = 0.0
    send: float = 0.0
    decode_cpu: float = 0.0  # CPU seconds of the group thread inside llama_decode

    def minus(self, other: ProfileSnapshot) -> ProfileSnapshot:
        vals = {f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)}
        vals["group"] = self.group
        for gauge in ("kv_used", "kv_total", "cache_capacity", "cache_entries", "cache_tokens"):
            vals[gauge] = getattr(self, gauge)
        return ProfileSnapshot(**vals)

    def line(self) -> str:
        s = max(self.steps, 1)
        r = max(self.rows, 1)
        ms = 1000.0
        step = sum(getattr(self, p) for p in PHASES if p != "wait")
        return (
            f"group {self.group}: {self.steps} steps, {self.rows / s:.1f} rows/step, "
            f"{self.ubatches / s:.2f} ubatches/step | per step ms: "
            f"wait {self.wait / s * ms:.2f} batch {self.batch / s * ms:.2f} "
            f"decode {self.decode / s * ms:.2f} sync {self.sync / s * ms:.2f} "
            f"step {step / s * ms:.2f} | per token ms: sample {self.sample / r * ms:.3f} "
            f"detok {self.detok / r * ms:.3f} stop {self.stop / r * ms:.3f} send {self.send / r * ms:.3f}"
            + (f" | draft ms/step {self.draft / s * ms:.2f}, accepted {self.accepted}/{self.drafted}"
               if self.drafted else "")
        )


def _cache_fields(cache: object | None) -> dict[str, int]:
    """A ``CacheStats``' figures as the snapshot's ``cache_*`` fields."""
    return {f"cache_{f.name}": getattr(cache, f.name) for f in fields(cache)} if cache is not None else {}


class GroupProfiler:
    """Accumulates phase times; written only by its group's thread."""

    def __init__(
        self, group: int, kv_total: int = 0, log_every_s: float = 5.0, enabled_log: bool = False,
        cache: object | None = None,
    ) -> None:
        """``cache``: the group's prompt cache's ``CacheStats`` at start (its capacity is read
        before the first step)."""
        self.group = group
        self.kv_total = kv_total
        self._acc = dict.fromkeys((*PHASES, "decode_cpu"), 0.0)
        self._steps = self._rows = self._tokens = self._busy = self._ubatches = 0
        self._drafts = self._drafted = self._accepted = 0
        self.snapshot = ProfileSnapshot(group=group, kv_total=kv_total, **_cache_fields(cache))
        self._log_every = log_every_s
        self._log_enabled = enabled_log
        self._last_log_t = time.monotonic()
        self._last_log_snap = self.snapshot

    @contextmanager
    def timed(self, phase: str, clock: Callable[[], float] = time.perf_counter) -> Iterator[None]:
        """Time the block as ``phase`` (however it ends), by ``clock``."""
        t0 = clock()
        try:
            yield
        finally:
            self.add(phase, clock() - t0)

    def cpu(self, phase: str) -> AbstractContextManager[None]:
        """Count the calling thread's CPU time in the block as ``phase``."""
        return self.timed(phase, time.thread_time)

    def add(self, phase: str, seconds: float) -> None:
        self._acc[phase] += seconds

    def add_spec(self, drafts: int, drafted: int, accepted: int) -> None:
        self._drafts += drafts
        self._drafted += drafted
        self._accepted += accepted

    def end_step(self, rows: int, tokens: int, busy_slots: int, kv_used: int, ubatches: int,
                 copied: int = 0, cache: object | None = None, moved: tuple[int, int, int, int] = (0, 0, 0, 0)) -> None:
        """``copied``: prompt tokens the group's prefix copies have taken so far; ``cache``:
        its prompt cache's ``CacheStats`` (engine/cache/prompt_cache.py); ``moved``: the
        histories it took from other groups (requests, tokens, bytes) and gave them, so far."""
        self._steps += 1
        self._ubatches += ubatches
        self._rows += rows
        self._tokens += tokens
        self._busy += busy_slots
        self.snapshot = ProfileSnapshot(
            group=self.group,
            steps=self._steps,
            rows=self._rows,
            batch_tokens=self._tokens,
            ubatches=self._ubatches,
            busy_slots_sum=self._busy,
            kv_used=kv_used,
            kv_total=self.kv_total,
            drafts=self._drafts,
            drafted=self._drafted,
            accepted=self._accepted,
            prefix_copied=copied,
            moved_in=moved[0], moved_tokens=moved[1], moved_bytes=moved[2], moved_out=moved[3],
            **_cache_fields(cache),
            **self._acc,
        )
        if self._log_enabled:
            now = time.monotonic()
            if now - self._last_log_t >= self._log_every:
                log.info("pipe-prof %s", self.snapshot.minus(self._last_log_snap).line())
                self._last_log_t = now
                self._last_log_snap = self.snapshot
