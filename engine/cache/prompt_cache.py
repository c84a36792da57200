"""The prompt cache of one group: the KV of finished requests kept beyond its slots.

A group's context holds one KV sequence per slot and ``n_entries`` more, each a slot's size.
When a request takes a slot whose KV it does not continue, what the slot held is first copied
into an entry (saved) instead of being dropped; a later prompt that continues an entry's tokens
takes them back as a copy into whatever slot of the group it gets (restored). The group's
``PrefixCache`` makes both copies (engine/cache/prefix.py); this module only keeps the entries'
bookkeeping and chooses which entry a save overwrites:

- an entry that holds nothing, else
- one whose tokens a slot holds too (the source of a restore: the slot now continues them), or
  that the saved tokens supersede (the same conversation a turn earlier): its tokens are, but
  for at most ``slack`` at their end, a prefix of the other's, else
- the least recently used (an eviction).

Where the model cannot take back a prefix of a longer state (a recurrent state, or a sliding
window that dropped it: ``exact``), an entry is redundant only where another holds exactly its
tokens; a checkpoint that a longer state of its conversation continues goes before the least
recently used, since it serves only a turn that renders the history otherwise.

A save comes before the restore that replaces the slot's KV, so it cannot overwrite the entry
being restored; that entry is the next save's first choice instead. So a group with ``n``
slots and ``m`` entries keeps ``n + m - 1`` conversations without evicting any.

Where the KV lives, and why nothing crosses the link: each stage keeps the KV of its own
layers in its own device's memory, and llama.cpp keeps the cells' bookkeeping in the engine's
process. With one KV stream per sequence (the default) a copy between sequences is a copy
between two streams that llama.cpp makes at the start of the next decode: on the peer a ggml
RPC copy command per tensor, which the server carries out in its own memory. With one unified
stream the copied cells are shared and no byte moves at all. Either way the KV of a cached
prompt never travels, unlike a state read and written with ``llama_state_seq_*``.

Only the group's thread calls into a ``PromptCache``; what others read (the entries' tokens,
for the scheduler; the counters, for the metrics) is published as immutable copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from engine.cache.tokens import common_prefix
from engine.slots import Slot

LLAMA_MAX_SEQ = 256  # llama.cpp's bound on a context's sequences (src/llama-cparams.h)


def n_entries_for(budget_bytes: int | None, entry_bytes: int, n_groups: int, n_slots_per_group: int) -> int:
    """Entries per group that ``budget_bytes`` holds, over ``n_groups`` groups, at
    ``entry_bytes`` each (a slot-sized KV sequence over every stage); None: one a slot (as much KV
    again as the slots). Within llama.cpp's bound on a context's sequences."""
    if budget_bytes is None:
        n = n_slots_per_group
    elif budget_bytes <= 0 or entry_bytes <= 0:
        return 0
    else:
        n = budget_bytes // (entry_bytes * n_groups)
    return int(max(0, min(n, LLAMA_MAX_SEQ - n_slots_per_group)))


@dataclass(frozen=True)
class CacheStats:
    """A group's prompt cache figures (counters since start but ``entries`` and ``tokens``)."""

    capacity: int = 0  # entries the group has
    entries: int = 0  # entries holding tokens
    tokens: int = 0  # tokens those entries hold
    saves: int = 0  # slots' KV saved into an entry
    hits: int = 0  # prompts that took a prefix from an entry
    reused: int = 0  # prompt tokens those prompts took from entries
    evictions: int = 0  # entries overwritten while still holding a conversation of their own
    superseded: int = 0  # entries overwritten by a later state of their conversation (or one a slot holds)
    misses: int = 0  # prompts (cache_prompt on) that found nothing to reuse anywhere: evaluated whole


class PromptCache:
    """The entries of one group (its thread only)."""

    def __init__(self, group: int, first_seq_id: int, n_entries: int, *, min_tokens: int, slack: int,
                 exact: bool = False) -> None:
        """``exact``: the model cannot take back a prefix of a longer entry (a recurrent state,
        or a sliding window that dropped it), so an entry is redundant only where another holds
        exactly its tokens, and no slack applies."""
        # an entry is a slot that never runs a request: the prefix cache's copies take it as
        # they take any other sequence of the group
        self.entries = [Slot(id=-(i + 1), group=group, seq_id=first_seq_id + i) for i in range(n_entries)]
        self.min_tokens = max(1, min_tokens)  # fewer tokens than this are not worth an entry
        self.slack = 0 if exact else slack
        self.exact = exact
        self.n_saves = self.n_hits = self.n_reused = self.n_evictions = self.n_superseded = self.n_misses = 0

    def __len__(self) -> int:
        return len(self.entries)

    @staticmethod
    def owns(s: Slot) -> bool:
        """Whether a sequence is an entry (entries have negative slot ids)."""
        return s.id < 0

    def held(self) -> list[Slot]:
        return [e for e in self.entries if e.cache_tokens]

    def worth_saving(self, tokens: list[int], n_kept: int) -> bool:
        """Whether a slot about to keep only ``n_kept`` of its ``tokens`` should save them all
        first: enough would be lost, and no entry holds them already."""
        if not self.entries or len(tokens) - n_kept < self.min_tokens:
            return False
        t = np.asarray(tokens, np.int32)
        return not any((len(e.cache_tokens) == len(t) if self.exact else len(e.cache_tokens) >= len(t))
                       and common_prefix(np.asarray(e.cache_tokens, np.int32), t) == len(t) for e in self.entries)

    def victim(self, tokens: list[int], exclude: set[int], slots: list[list[int]] = ()) -> tuple[Slot | None, bool]:
        """The entry a save of ``tokens`` overwrites, and whether that evicts a conversation;
        entries whose sequence ids are in ``exclude`` (read by a copy not yet made) are not
        taken; ``slots``: what the group's slots hold. None when every entry is excluded."""
        free = [e for e in self.entries if e.seq_id not in exclude]
        if not free:
            return None, False
        empty = next((e for e in free if not e.cache_tokens), None)
        if empty is not None:
            return empty, False
        newer = [np.asarray(x, np.int32) for x in (tokens, *slots) if len(x)]
        mine = {e.seq_id: np.asarray(e.cache_tokens, np.int32) for e in self.entries if e.cache_tokens}

        def continued(e: Slot, by: list[np.ndarray], longer: bool) -> bool:
            """Whether one of ``by`` holds ``e``'s tokens (but for ``slack`` at their end): of
            the same length where only that makes ``e`` redundant, longer for a checkpoint."""
            n = len(e.cache_tokens)
            return any(common_prefix(mine[e.seq_id], t) >= max(1, n - self.slack)
                       and (len(t) > n if longer else len(t) == n or not self.exact) for t in by)

        old = [e for e in free if continued(e, newer, longer=False)]
        if not old and self.exact:
            # a checkpoint that a later state of its conversation continues: worth less than a
            # conversation of its own (it serves only a turn that renders the history otherwise)
            old = [e for e in free if continued(e, newer + [t for k, t in mine.items() if k != e.seq_id], longer=True)]
        if old:
            return min(old, key=lambda e: e.last_used), False
        return min(free, key=lambda e: e.last_used), True

    def saved(self, entry: Slot, evicted: bool, held: bool) -> None:
        """A save went into ``entry``, which ``held`` tokens before: of a conversation of its own
        (``evicted``), or one the save or a slot continues (superseded)."""
        entry.last_used = time.monotonic()
        self.n_saves += 1
        self.n_evictions += evicted
        self.n_superseded += held and not evicted

    def missed(self) -> None:
        """A prompt reused nothing: no entry, no slot of the group held any of it."""
        self.n_misses += 1

    def hit(self, entry: Slot, n: int) -> None:
        entry.last_used = time.monotonic()
        self.n_hits += 1
        self.n_reused += n

    def views(self) -> list[tuple[str, np.ndarray]]:
        """The salt and the tokens of each entry, for the scheduler (copies)."""
        return [(e.cache_salt, np.asarray(e.cache_tokens, np.int32)) for e in self.entries if e.cache_tokens]

    def stats(self) -> CacheStats:
        held = self.held()
        return CacheStats(len(self.entries), len(held), sum(len(e.cache_tokens) for e in held),
                          self.n_saves, self.n_hits, self.n_reused, self.n_evictions, self.n_superseded,
                          self.n_misses)
