"""Speculative decoding of one pipeline group: who drafts, and how a draft is verified.

A generating row that drafts ``k`` tokens puts ``[last, d1 .. dk]`` in the group's batch with
logits for all ``k + 1`` positions. Verification samples the rows in order with the
request's own sampler chain, accepting each sampled token before the next row is sampled,
and stops after the first sampled token that differs from the draft: every token is drawn
from the target distribution given the tokens before it, exactly as without speculation
(greedy gives the same text; a seeded request the same tokens, since the chain draws one
random number per emitted token either way). The KV of the rejected draft tokens is removed.

Drafters (one per group, used only by the group's thread):

- ``NgramDrafter``: prompt lookup. The last ``n`` tokens of the row's history (prompt and
  output) are looked up earlier in the same history, longest ``n`` first, most recent match
  first; what followed the match is the draft. No model, no KV.
- ``ModelDrafter``: a small model with the target's vocabulary, one context per group on the
  local device. Its KV follows the target's tokens by common prefix (so prefix reuse and slot
  restores need no special case); each draft step decodes one token per drafting row, greedy,
  and a row stops drafting when the draft model's probability of its pick falls under
  ``p_min``.

Speculation is skipped when it loses: when the group has more generating rows than
``max_rows`` (a batch that already fills the device gains nothing from longer rows), and per
row after drafts that were all rejected (backing off 1, 2, 4 ... up to 32 steps).
"""

from __future__ import annotations

import logging

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.cache.prefix import keep_prefix
from engine.cache.tokens import common_prefix
from engine.config import SpeculativeConfig

log = logging.getLogger(__name__)

def ngram_draft(history: np.ndarray, n_min: int, n_max: int, limit: int) -> list[int]:
    """Up to ``limit`` tokens that followed the most recent earlier occurrence of the
    history's last ``n`` tokens (``n`` from ``n_max`` down to ``n_min``), up to the first row of
    a medium (a negative id, engine/media.py), which is never a token."""
    h = history
    L = len(h)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # windows starting before L - n: every earlier occurrence, not the suffix itself
        win = sliding_window_view(h[: L - 1], n)
        hits = np.flatnonzero((win == h[L - n :]).all(axis=1))
        if len(hits):
            i = int(hits[-1]) + n
            cont = h[i : i + limit]
            rows = np.flatnonzero(cont < 0)
            return (cont[: rows[0]] if len(rows) else cont).tolist()
    return []


class NgramDrafter:
    kind = "ngram"

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg

    def draft(self, rows: list[tuple[object, list[int], int]]) -> list[list[int]]:
        """``rows``: (slot, history, limit); one draft per row."""
        c = self.cfg
        return [ngram_draft(np.asarray(h, np.int32), c.ngram_min, c.ngram_max, lim) for _, h, lim in rows]

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


class ModelDrafter:
    """One draft context per group (the draft model is loaded once per engine).

    A draft model whose state cannot be cut (recurrent or hybrid: a small Qwen3.5 for a large
    one) never puts a draft in a slot's own sequence: that sequence follows the row's history
    alone, and each step's drafts after the first are decoded in a scratch sequence of its own
    (``seq + n_seq``), a copy of the slot's taken at the row's last token (in device memory: the
    recurrent state's cell, and the KV's cells in one shared stream) and dropped after. Without
    it the sequence could not go back past the drafts, and the history would be evaluated again
    at every step."""

    kind = "draft"

    def __init__(self, cfg: SpeculativeConfig, model: object, *, n_ctx: int, n_seq: int, n_batch: int,
                 n_threads: int, flash_attn: bool | None) -> None:
        from engine.native.batch import Batch
        from engine.native.context import Context

        self.cfg = cfg
        self.model = model
        self.n_vocab = model.n_vocab
        self.n_seq = n_seq
        self.scratch = bool(model.recurrent)
        # scratch sequences: one stream (a copy is metadata), room for every row's drafts beside
        n_more = n_seq * (cfg.n_max + 1) if self.scratch else 0
        self.ctx = Context(model, n_ctx=n_ctx + n_more, n_seq_max=n_seq * (1 + self.scratch), n_batch=n_batch,
                           n_ubatch=n_batch, n_threads=n_threads, flash_attn=flash_attn, kv_unified=self.scratch)
        self.batch = Batch(n_batch)
        self.tokens: list[list[int]] = [[] for _ in range(n_seq)]  # per sequence: tokens in the KV
        self.n_fed = 0  # tokens decoded, drafts included (what the drafter costs)

    def _sync(self, seq: int, history: list[int]) -> list[int]:
        """Trim the sequence's KV to its common prefix with ``history``; returns the tokens of
        ``history`` still to feed (at least the last one, whose logits give the first draft)."""
        have = self.tokens[seq]
        k = min(common_prefix(np.asarray(have, np.int32), np.asarray(history, np.int32)), len(history) - 1)
        return history[keep_prefix(self.ctx, self.model.n_swa, seq, have, k):]

    def _decode(self) -> None:
        self.n_fed += self.batch.n_tokens
        self.ctx.decode(self.batch)

    def draft(self, rows: list[tuple[object, list[int], int]]) -> list[list[int]]:
        cfg, b = self.cfg, self.batch
        drafts: list[list[int]] = [[] for _ in rows]
        feeds = [(i, s.seq_id, self._sync(s.seq_id, h)) for i, (s, h, _) in enumerate(rows)]
        # catch up: every token but the last of each row, chunked, no logits
        b.clear()
        for _, seq, feed in feeds:
            toks, pos = feed[:-1], len(self.tokens[seq])
            while toks:
                if b.free == 0:
                    self._decode()
                    b.clear()
                part = toks[: b.free]
                b.add(part, pos, seq, False)
                self.tokens[seq].extend(part)
                toks, pos = toks[len(part):], pos + len(part)
        if b.free < len(rows):
            self._decode()
            b.clear()
        # (row, the slot's sequence, the sequence decoded, token, position): the row's last
        # token goes into the slot's sequence, which keeps it (it is the history's)
        live = [(i, seq, seq, feed[-1], len(self.tokens[seq])) for i, seq, feed in feeds]
        used: list[int] = []
        try:
            while live:
                for _, seq, at, tok, pos in live:
                    b.add([tok], pos, at, True)
                    if at == seq:
                        self.tokens[seq].append(tok)
                self._decode()
                b.clear()
                logits = self.ctx.logits(len(live), self.n_vocab)
                nxt = []
                for j, (i, seq, at, _, pos) in enumerate(live):
                    row = logits[j]
                    t = int(np.argmax(row))
                    if cfg.p_min > 0.0:
                        p = 1.0 / float(np.exp(row - row[t]).sum())
                        if p < cfg.p_min:
                            continue
                    drafts[i].append(t)
                    if len(drafts[i]) < rows[i][2]:
                        if self.scratch and at == seq:  # the drafts go on in a copy
                            at = seq + self.n_seq
                            self.ctx.seq_cp(seq, at)
                            used.append(at)
                        nxt.append((i, seq, at, t, pos + 1))
                live = nxt
        finally:
            for at in used:
                self.ctx.seq_rm(at, 0, -1)
        return drafts

    def reset(self) -> None:
        """Forget every sequence (after a failed decode, the KV is not what ``tokens`` says)."""
        for seq, toks in enumerate(self.tokens):
            self.ctx.seq_rm(seq, 0, -1)
            if self.scratch:
                self.ctx.seq_rm(seq + self.n_seq, 0, -1)
            toks.clear()

    def close(self) -> None:
        self.ctx.close()


def load_draft_model(cfg: SpeculativeConfig, target: object) -> object:
    """The draft model on the local device, checked against the target's vocabulary."""
    from engine.native.devices import local_device_name
    from engine.native.model import Model

    m = Model(cfg.model, devices=[local_device_name()])
    if m.n_vocab != target.n_vocab:
        m.close()
        raise ValueError(f"the draft model's vocabulary has {m.n_vocab} tokens, the target's {target.n_vocab}: "
                         "a draft model must share the target's tokenizer")
    return m
