"""The KV prefix: which tokens each sequence of a group's context holds, and what a new prompt
may reuse of them.

A group's ``PrefixCache`` is the only writer of its slots' ``cache_tokens`` (the tokens whose
KV is in the slot's sequence) and the only caller of the context's sequence operations on
their behalf. A new prompt reuses, in this order of preference:

- its own slot's cached prefix (what llama-server does), or
- a longer prefix held by *another* slot of the group, idle or busy: its KV is copied on the
  device (``llama_memory_seq_cp``; on the peer the RPC server copies its own buffers, nothing
  crosses the link), or
- a prefix another slot of the group is computing right now: the new slot waits until that
  slot's prompt has got there, then copies it, instead of evaluating it a second time, or
- a prefix kept in the group's prompt cache (engine/cache/prompt_cache.py): what a slot held before
  another request took it, saved as a copy into one of the group's extra sequences first.

What may be reused is bounded by the model: a sliding-window model keeps only the last
``n_swa`` positions in its window layers, so a prefix is reusable only while the positions it
attends over are still there (``window_holds``); a recurrent or hybrid model's state cannot be
cut at a position, so its slots share nothing and it takes a prompt cache entry back only whole
(``whole_only``). For both, the prompt cache keeps a checkpoint of a slot's state at the end of
its prompt (``checkpoint``): the next turn of a chat whose template renders the last answer
otherwise (a reasoning model dropping its thinking) goes on from there, not from nothing.

The scheduler sees the same facts from outside (the slots' published cached tokens and the
prompts it handed out): ``group_prefixes`` tells it how much of a prompt each group already
holds or is computing, which it weighs against balance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.cache import positions
from engine.cache.tokens import common_prefix, reusable
from engine.errors import NativeError

if TYPE_CHECKING:
    from engine.cache.prompt_cache import PromptCache
    from engine.config import EngineConfig
    from engine.native.context import Context
    from engine.native.model import Model
    from engine.slots import Slot


def window_holds(ctx: Context, n_swa: int, seq_id: int, n: int, shifts: positions.Shifts = ()) -> bool:
    """Whether the first ``n`` tokens of a sequence (``shifts``: where they sit) can be
    continued: a sliding-window cache dropped the oldest positions, and the next token attends
    over the ``n_swa`` before it."""
    return n <= 0 or ctx.seq_pos_min(seq_id) <= max(0, positions.position(shifts, n) - n_swa)


def keep_prefix(ctx: Context, n_swa: int, seq_id: int, cached: list[int], n_keep: int,
                shifts: positions.Shifts | None = None) -> int:
    """Keep the first ``n_keep`` of a sequence's ``cached`` tokens in its KV and drop the rest
    (``cached`` and their ``shifts``, where they sit, are cut to match); none when the window
    dropped positions that prefix attends over, or the KV cannot be cut there (a recurrent
    state). Returns how many were kept."""
    shifts = [] if shifts is None else shifts
    if n_keep > 0 and not window_holds(ctx, n_swa, seq_id, n_keep, shifts):
        n_keep = 0
    if n_keep < len(cached):
        if not ctx.seq_rm(seq_id, positions.position(shifts, n_keep), -1):
            ctx.seq_rm(seq_id, 0, -1)
            n_keep = 0
        del cached[n_keep:]
        positions.cut(shifts, n_keep)
    return n_keep


def sharing_on(config: EngineConfig, model: Model) -> bool:
    """Whether an engine's slots share prefixes: asked for, with prompt caching, and a model
    whose state can be cut at a position (not recurrent or hybrid)."""
    return config.share_prefix and config.cache_prompt and not model.recurrent


@dataclass(frozen=True, slots=True)
class Reuse:
    """What a new prompt reuses: ``own`` tokens of its slot's own KV, or ``shared`` tokens of
    ``source``'s, which its KV holds now (``ready``) or will once its prompt gets there."""

    own: int = 0
    source: Slot | None = None
    shared: int = 0
    ready: bool = False

    @property
    def n(self) -> int:
        return self.shared if self.source is not None else self.own


class PrefixCache:
    """The KV prefix of one group's sequences (its thread only)."""

    def __init__(self, ctx: Context, *, n_swa: int, unified: bool, shareable: bool, share_min: int,
                 kept: PromptCache | None = None, whole_only: bool = False, checkpoints: bool = False) -> None:
        """``whole_only``: the state cannot be cut (recurrent); ``checkpoints``: keep a copy of
        each prompt's state at its end (models that cannot reuse any prefix of a longer KV)."""
        self.ctx = ctx
        self.kept = kept if kept is not None and len(kept) else None
        self.whole_only = whole_only
        self.checkpoints = checkpoints and self.kept is not None
        self.n_swa = n_swa
        self.unified = unified  # one KV stream: a copy is metadata, and may take a range
        self.shareable = shareable  # not for recurrent or hybrid models
        self.share_min = max(1, share_min)
        self.n_copied = 0  # prefix tokens copied from another sequence instead of evaluated
        # histories moved from another group's context (engine/cache/move.py): requests, the
        # prompt tokens they took, the state's bytes read there and written here; and sent out
        self.n_moved_in = self.n_moved_tokens = self.n_moved_bytes = self.n_moved_out = 0
        # stream copies llama.cpp has queued for the next decode: destination -> source sequence
        self.pending: dict[int, int] = {}
        # recurrent sequences whose rejected drafts were taken back and whose next decode has
        # not run: llama.cpp restores their state from its snapshot in that decode, so until
        # then a copy of their cells would carry the state with the rejected tokens in it (one
        # left here after its state is gone costs a refused copy, never a wrong one)
        self.rolled_back: set[int] = set()

    # ---- what a prompt may reuse (no writes) ------------------------------------------------

    def plan(self, slot: Slot, prompt: list[int], others: list[Slot], *, own: bool, share: bool,
             salt: str = "") -> Reuse:
        """The best reuse for ``prompt`` on ``slot``; ``others`` are the group's other slots.
        The last prompt token is always evaluated (its logits give the first token). Only KV
        written under the request's ``salt`` is reused."""
        p = np.asarray(prompt, np.int32)
        cap = len(prompt) - 1
        n_own = reusable(slot.cache_tokens, p, cap) if own and slot.cache_tokens and slot.cache_salt == salt else 0
        if n_own and not self._can_keep(slot, n_own):
            n_own = 0  # what the slot holds cannot be cut back there: a window dropped it, or a recurrent state
        best = Reuse(own=n_own)
        if not share or cap <= 0:
            return best
        need = n_own + self.share_min
        for o in [*(others if self.shareable else ()), *(self.kept.held() if self.kept else ())]:
            if o is slot or o.leader is not None or o.cache_salt != salt:
                continue  # a follower's KV is its leader's to give; another salt's is not this one's
            n = reusable(o.cache_tokens, p, cap) if o.cache_tokens else 0
            if self.whole_only and n != len(o.cache_tokens):
                continue
            if n >= need and n > best.n and window_holds(self.ctx, self.n_swa, o.seq_id, n, o.cache_shifts):
                best = Reuse(own=n_own, source=o, shared=n, ready=True)
            if o.req is not None and o.n_prompt_done < len(o.req.prompt_tokens) and o.req.cache_salt == salt:
                # a prompt on its way: worth waiting for when it gives clearly more
                m = reusable(o.req.prompt_tokens, p, cap)
                if m >= need and m >= best.n + self.share_min:
                    best = Reuse(own=n_own, source=o, shared=m, ready=o.n_prompt_done >= m)
        return best

    def best_held(self, prompt: list[int], salt: str, slots: list[Slot], min_n: int) -> Slot | None:
        """The group's sequence (a slot's, busy or idle, or a prompt cache entry's) whose KV
        holds the longest prefix of ``prompt`` written under ``salt``: the whole state where it
        cannot be cut, never one a queued copy has yet to fill; None below ``min_n`` tokens.
        What another group would take (engine/cache/move.py)."""
        p = np.asarray(prompt, np.int32)
        cap = len(prompt) - 1
        best, n_best = None, 0
        for o in [*slots, *(self.kept.held() if self.kept else ())]:
            if not o.cache_tokens or o.cache_salt != salt or o.seq_id in self.pending:
                continue
            n = reusable(o.cache_tokens, p, cap)
            if self.whole_only and n != len(o.cache_tokens):
                continue
            if n >= max(min_n, 1) and n > n_best and window_holds(self.ctx, self.n_swa, o.seq_id, n, o.cache_shifts):
                best, n_best = o, n
        return best

    def moves(self) -> tuple[int, int, int, int]:
        """Histories taken from other groups (requests, prompt tokens, bytes), and given them."""
        return self.n_moved_in, self.n_moved_tokens, self.n_moved_bytes, self.n_moved_out

    def _can_keep(self, slot: Slot, n: int) -> bool:
        if self.whole_only and n != len(slot.cache_tokens):
            return False
        return window_holds(self.ctx, self.n_swa, slot.seq_id, n, slot.cache_shifts)

    def due(self, waiter: Slot) -> bool:
        """Whether the prefix a waiting slot takes from its leader is in the leader's KV."""
        return waiter.leader is not None and len(waiter.leader.cache_tokens) >= waiter.n_from_leader

    # ---- writes -----------------------------------------------------------------------------

    def keep(self, slot: Slot, n: int) -> int:
        """Keep the first ``n`` tokens of the slot's own KV; returns how many it kept."""
        return keep_prefix(self.ctx, self.n_swa, slot.seq_id, slot.cache_tokens, n, slot.cache_shifts)

    def reuse_from(self, src: Slot, dst: Slot, n: int) -> bool:
        """``copy`` for a new prompt: counts what it reused (from another slot, or from the
        prompt cache: a restore)."""
        if not self.copy(src, dst, n):
            return False
        if self.kept is not None and self.kept.owns(src):
            self.kept.hit(src, n)
        else:
            self.n_copied += n
        return True

    def missed(self) -> None:
        """A prompt starts with nothing reused (counted by the prompt cache, where there is one)."""
        if self.kept is not None:
            self.kept.missed()

    def save(self, slot: Slot, n_keep: int, source: Slot | None = None, slots: list[Slot] = ()) -> bool:
        """Before the slot keeps only its first ``n_keep`` tokens (and takes ``source``'s):
        save all it holds into the prompt cache, when that is worth it (``slots``: the group's,
        whose KV makes an entry's redundant). Returns whether it did."""
        kept = self.kept
        if kept is None or not kept.worth_saving(slot.cache_tokens, n_keep):
            return False
        return self._store(slot, slots, source)

    def checkpoint(self, slot: Slot, slots: list[Slot] = ()) -> bool:
        """The slot's prompt is complete (its first token sampled, not yet in its KV): keep a
        copy of its state at this position, where the model cannot go back to it otherwise."""
        if not self.checkpoints or not self.kept.worth_saving(slot.cache_tokens, 0):
            return False
        return self._store(slot, slots)

    def _store(self, slot: Slot, slots: list[Slot], source: Slot | None = None) -> bool:
        """Copy all the slot's KV into a prompt cache entry (never ``source``'s, about to be
        read, nor one a queued copy reads)."""
        kept = self.kept
        busy = set(self.pending.values())
        if source is not None:
            busy.add(source.seq_id)
        entry, evicted = kept.victim(slot.cache_tokens, busy, [o.cache_tokens for o in slots if o is not slot])
        if entry is None:
            return False
        held = bool(entry.cache_tokens)
        if not self.copy(slot, entry, len(slot.cache_tokens)):
            return False
        kept.saved(entry, evicted, held)
        return True

    def copy(self, src: Slot, dst: Slot, n: int) -> bool:
        """Give ``dst`` the first ``n`` tokens of ``src``'s KV (dropping what ``dst`` held);
        False when the window no longer holds them (``dst`` is then empty). With one stream
        per sequence llama.cpp copies the whole stream at the start of the next decode, and
        the copy is cut at ``n`` here; with one shared stream the cells are shared."""
        n = min(n, len(src.cache_tokens))
        self.ctx.seq_rm(dst.seq_id, 0, -1)
        dst.cache_tokens.clear()
        dst.cache_shifts.clear()
        if n <= 0 or src.seq_id in self.rolled_back or not window_holds(self.ctx, self.n_swa, src.seq_id, n, src.cache_shifts):
            return False
        end = positions.position(src.cache_shifts, n)
        if self.unified:
            self.ctx.seq_cp(src.seq_id, dst.seq_id, 0, end)
        else:
            self.ctx.seq_cp(src.seq_id, dst.seq_id)
            self.pending[dst.seq_id] = src.seq_id
            if n < len(src.cache_tokens) and not self.ctx.seq_rm(dst.seq_id, end, -1):
                self.ctx.seq_rm(dst.seq_id, 0, -1)
                return False
        dst.cache_tokens.extend(src.cache_tokens[:n])
        dst.cache_shifts.extend(positions.kept(src.cache_shifts, n))
        dst.cache_salt = src.cache_salt
        return True

    def applied(self) -> None:
        """A decode ran: llama.cpp made the queued copies at its start."""
        self.pending.clear()

    def settle(self, slot: Slot) -> None:
        """A slot goes idle: if its copy is still queued, its KV is forgotten, so that nothing
        written to the source before the next decode can reach it unseen."""
        if self.pending.pop(slot.seq_id, None) is not None:
            self.drop(slot)

    def copying_from(self, slot: Slot) -> bool:
        """Whether a queued copy will read the slot's KV at the next decode."""
        return slot.seq_id in self.pending.values()

    def extend(self, slot: Slot, tokens: list[int], n_pos: int | None = None) -> None:
        """The decode that just ran put ``tokens`` in the slot's KV (its request's salt's, now):
        text, or with ``n_pos`` a medium's rows that take that many positions."""
        slot.cache_tokens.extend(tokens)
        self.rolled_back.discard(slot.seq_id)
        if n_pos is not None:
            positions.after_medium(slot.cache_shifts, len(slot.cache_tokens), len(tokens), n_pos)
        if slot.req is not None:
            slot.cache_salt = slot.req.cache_salt

    def cut(self, slot: Slot, n: int) -> None:
        """Drop everything from index ``n`` on (rejected draft tokens)."""
        if not self.ctx.seq_rm(slot.seq_id, positions.position(slot.cache_shifts, n), -1):
            raise NativeError(f"removing the tokens of sequence {slot.seq_id} after {n} failed", -1)
        if self.whole_only:
            self.rolled_back.add(slot.seq_id)
        del slot.cache_tokens[n:]
        positions.cut(slot.cache_shifts, n)

    def drop(self, slot: Slot) -> int:
        """Forget the slot's KV; returns how many tokens it held."""
        n = len(slot.cache_tokens)
        self.ctx.seq_rm(slot.seq_id, 0, -1)
        slot.cache_tokens.clear()
        slot.cache_shifts.clear()
        return n

    def load(self, slot: Slot, tokens: list[int], shifts: positions.Shifts = ()) -> None:
        """The slot's KV was restored (from a file, or another group's) and holds ``tokens``
        (of no salt), at the positions ``shifts`` says."""
        slot.cache_tokens[:] = tokens
        slot.cache_shifts[:] = shifts
        slot.cache_salt = ""


def group_prefixes(held: list[tuple[int, np.ndarray]], prompt: np.ndarray) -> dict[int, int]:
    """For each group, the longest prefix of ``prompt`` that one of its slots holds in its KV
    or is computing: ``held`` lists (group, tokens) for every slot's cached tokens and every
    running request's prompt. What a request sent there would not evaluate again."""
    out: dict[int, int] = {}
    for g, toks in held:
        n = common_prefix(toks, prompt) if len(toks) else 0
        if n > out.get(g, 0):
            out[g] = n
    return out
