"""Multi-token prediction (MTP) drafting: the model's own next-token head drafts for its group.

A model trained with MTP layers ("nextn": Qwen3.5-MTP, GLM-4.5, MiMo, Hunyuan...) predicts
token ``p + 2`` from the token at ``p + 1`` and the hidden state the trunk computed at ``p``.
llama.cpp runs those layers in a context of their own (``LLAMA_CONTEXT_TYPE_MTP``) made from
the same model, with its own KV (the MTP layers' only). Each group owns one, beside its
target context, on the local device: the hidden state comes out of the local stage with the
logits, so nothing extra crosses the link to the peer.

What the drafter keeps in step with the target, per sequence of the group (a slot's
``seq_id``), as ``common/speculative.cpp``'s ``draft-mtp`` does:

- **the mirror**: after every target decode, each batch token is decoded in the MTP context
  too, at the same position, with the target's hidden state of the position before it
  (``pairs``): MTP cell ``p`` holds ``(x_p, h_{p-1})``. The last row's state waits for the
  next token (``pending``). Every cut, copy and removal the prefix cache makes goes through
  ``PairedKv``: both contexts hold the same positions, and a sequence's carried state is
  the one of the position it now ends at.
- **the draft**: one row per drafting sequence, its last sampled token at the next position
  with ``pending``; each drafted token goes back in with the MTP head's own output state (one
  head, reused), until ``n_max`` or until the pick's probability falls under ``p_min``. The
  draft's cells are removed again: the target verifies the draft and the mirror writes what
  it decoded.
- **after verification**: the rejected tokens' KV leaves both contexts through the prefix
  cache, so the carried state is the last accepted position's.

Where the state of the position a sequence now ends at is not at hand (a prefix cut or copied
at a position the last decode did not compute) it is zero: that row's draft may be rejected more often; the output never
changes, since every draft is verified. A sequence whose MTP KV does not end where the
target's does drafts nothing; after a failure (the MTP KV forgotten) or a slot restored from a
file saved without it, the mirror writes the positions that follow, and the MTP layers attend
over those only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from engine.cache import positions
from engine.config import SpeculativeConfig
from engine.errors import NativeError
from engine.native.batch import Batch
from engine.native.context import Context
from engine.native.model import Model

if TYPE_CHECKING:
    from engine.planner import Plan
    from engine.slots import Slot

log = logging.getLogger(__name__)


def require_mtp(model: Model) -> None:
    """Refuse ``speculative: {type: mtp}`` for a model without MTP layers, by name."""
    if model.n_layer_nextn <= 0:
        raise ValueError(f"speculative type 'mtp' needs a model with MTP (nextn) layers; {model.path} has none "
                         "(its GGUF sets no <arch>.nextn_predict_layers): use type ngram or draft")


def pairs(entries: list[tuple[int, int, int]], h: np.ndarray, pending: dict[int, np.ndarray],
          zero: np.ndarray) -> np.ndarray:
    """The hidden state each batch row is paired with in the MTP context: the target's state
    of the row before it in the same sequence, or, for a sequence's first row, its
    ``pending`` state. ``entries``: (seq, batch offset, n tokens), contiguous per sequence."""
    out = np.empty_like(h)
    for seq, o, n in entries:
        out[o] = pending.get(seq, zero)
        out[o + 1 : o + n] = h[o : o + n - 1]
    return out


class PairedKv:
    """The KV operations of a group's target context, applied to its MTP context too (the
    prefix cache's view of the pair; what is read comes from the target), and the state each
    sequence carries into its next MTP row, kept for the position it ends at."""

    def __init__(self, target: Context, mtp: Context) -> None:
        self.target, self.mtp = target, mtp
        self.pending: dict[int, np.ndarray] = {}  # seq -> the state of its last position
        # the last target decode: its states, and where each sequence's rows were
        self.h = np.zeros((0, 0), np.float32)
        self.rows: dict[int, tuple[int, int, int]] = {}  # seq -> (batch offset, first position, n)

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        self.mtp.seq_rm(seq_id, p0, p1)
        ok = self.target.seq_rm(seq_id, p0, p1)
        if p1 < 0:  # the prefix cache cuts only what a sequence holds: it now ends at p0 - 1
            self._ends_at(seq_id, p0 - 1)
        return ok

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.mtp.seq_cp(src, dst, p0, p1)
        self.target.seq_cp(src, dst, p0, p1)
        # up to where it was copied, the destination holds the source's tokens and states
        if src in self.rows:
            self.rows[dst] = self.rows[src]
        if p1 >= 0:
            self._ends_at(dst, p1 - 1)
        elif src in self.pending:
            self.pending[dst] = self.pending[src]

    def seq_pos_min(self, seq_id: int) -> int:
        return self.target.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.target.seq_pos_max(seq_id)

    def _ends_at(self, seq: int, pos: int) -> None:
        """The target's state at ``pos`` when the last decode computed it, else none (zero)."""
        row = self.rows.get(seq)
        if row is not None and row[1] <= pos < row[1] + row[2]:
            self.pending[seq] = self.h[row[0] + pos - row[1]]
        else:
            self.pending.pop(seq, None)
            if pos < 0:
                self.rows.pop(seq, None)


class MtpDrafter:
    """One MTP context per group, against the group's target context."""

    kind = "mtp"

    def __init__(self, cfg: SpeculativeConfig, model: Model, target: Context, *, n_ctx: int, n_seq: int,
                 n_batch: int, n_ubatch: int, n_threads: int, flash_attn: bool | None, kv_unified: bool) -> None:
        self.cfg = cfg
        self.target = target
        self.n_vocab = model.n_vocab
        self.n_embd = model.n_embd_out
        self.ctx = Context(model, n_ctx=n_ctx, n_seq_max=n_seq, n_batch=n_batch, n_ubatch=n_ubatch,
                           n_threads=n_threads, flash_attn=flash_attn, kv_unified=kv_unified, mtp=True)
        try:
            target.set_embeddings_nextn(masked=False)  # a state for every batch token
            self.ctx.set_embeddings_nextn(masked=True)  # a state for every drafted row
        except BaseException:
            self.ctx.close()
            raise
        self.kv = PairedKv(target, self.ctx)
        self.batch = Batch(n_batch, self.n_embd)
        self.zero = np.zeros(self.n_embd, np.float32)

    # ---- after each target decode -------------------------------------------------------------

    def observe(self, plan: Plan) -> None:
        """Mirror the batch the target just decoded into the MTP context."""
        kv = self.kv
        entries, o = [], 0
        for e in plan.entries:
            entries.append((e.seq_id, o, len(e.tokens)))
            o += len(e.tokens)
        starts = [positions.position(e.slot.cache_shifts, e.pos0) for e in plan.entries]  # text: consecutive
        kv.rows = {seq: (off, p0, n) for (seq, off, n), p0 in zip(entries, starts, strict=True)}
        if o == 0:
            return
        kv.h = self.target.embeddings_nextn(o, self.n_embd).copy()
        states = pairs(entries, kv.h, kv.pending, self.zero)
        b = self.batch
        b.clear()
        for (seq, off, n), e, p0 in zip(entries, plan.entries, starts, strict=True):
            b.add(e.tokens, p0, seq, False, states[off : off + n])
            kv.pending[seq] = kv.h[off + n - 1]
        try:
            self.ctx.decode(b)
        except NativeError as err:  # the group goes on without drafts for these sequences
            log.warning("MTP mirror failed: %s", err)
            self.reset()

    # ---- drafting -----------------------------------------------------------------------------

    def draft(self, rows: list[tuple[Slot, list[int], int]]) -> list[list[int]]:
        """``rows``: (slot, history, limit); one draft per row, greedy from the MTP head."""
        drafts: list[list[int]] = [[] for _ in rows]
        live = []  # (row, seq, token, position, state)
        for i, (s, hist, _) in enumerate(rows):
            pos = len(hist) - 1  # the last token is not in the KV yet
            if self.ctx.seq_pos_max(s.seq_id) != pos - 1:
                continue  # the MTP KV is not where the target's is: no draft
            live.append((i, s.seq_id, hist[-1], pos, self.kv.pending.get(s.seq_id, self.zero)))
        starts = {seq: pos for _, seq, _, pos, _ in live}
        b, p_min = self.batch, self.cfg.p_min
        try:
            while live:
                b.clear()
                for _, seq, tok, pos, h in live:
                    b.add([tok], pos, seq, True, h[None, :])
                self.ctx.decode(b)
                logits = self.ctx.logits(len(live), self.n_vocab)
                nxt = []
                for j, (i, seq, _, pos, _) in enumerate(live):
                    row = logits[j]
                    t = int(np.argmax(row))
                    if p_min > 0.0 and 1.0 / float(np.exp(row - row[t]).sum()) < p_min:
                        continue
                    drafts[i].append(t)
                    if len(drafts[i]) < rows[i][2]:
                        nxt.append((i, seq, t, pos + 1, self.ctx.embeddings_nextn_ith(j, self.n_embd).copy()))
                live = nxt
        finally:
            for seq, pos in starts.items():  # the draft's cells go: the mirror writes what is verified
                self.ctx.seq_rm(seq, pos, -1)
        return drafts

    # ---- slot files ---------------------------------------------------------------------------

    def save(self, path: str, slot: Slot) -> None:
        """The MTP KV of the slot beside its target's file (``<file>.mtp``)."""
        self.ctx.seq_save(path + ".mtp", slot.seq_id, slot.cache_tokens)

    def load(self, path: str, slot: Slot, capacity: int) -> None:
        """The MTP KV saved beside a slot file, into the slot's emptied sequence; without one it
        stays empty and holds only what the mirror writes after it."""
        try:
            self.ctx.seq_load(path + ".mtp", slot.seq_id, capacity)
        except (NativeError, OSError):
            self.ctx.seq_rm(slot.seq_id, 0, -1)

    def reset(self) -> None:
        """Forget every sequence of the MTP context (its KV no longer follows the target's)."""
        self.ctx.clear()
        self.kv.pending.clear()

    def close(self) -> None:
        self.ctx.close()
