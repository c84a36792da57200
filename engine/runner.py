"""The second part of a step: the native side of one group. It owns the group's context, its
batch, its drafter and its prefix cache; it turns a plan into logits (and the KV copies the
plan made due), starts a request as planned (its reuse and its sampler chain), and saves and
loads a slot's KV to and from a file, and reads and writes a history another group takes
(engine/cache/move.py).

Native handles are closed by construction: whatever fails while the runner is built, what was
created before it is freed (the drafter's context, then the group's), and ``close`` frees
them in reverse order of creation, contexts always before the model their engine frees last.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack
from pathlib import Path

import llama_cpp
import numpy as np

from engine.cache import positions
from engine.cache.move import Moved, export_history, take_history
from engine.cache.prefix import PrefixCache, sharing_on
from engine.cache.prompt_cache import PromptCache
from engine.config import EngineConfig
from engine.errors import NativeError
from engine.media import is_media
from engine.native.batch import Batch
from engine.native.context import Context
from engine.native.model import Model
from engine.planner import MediaEntry, Plan, Start
from engine.sampling import SamplerChain
from engine.slots import Slot
from engine.speculation.drafters import ModelDrafter, NgramDrafter
from engine.speculation.mtp import MtpDrafter
from engine.types import Request

log = logging.getLogger(__name__)


class Runner:
    def __init__(self, index: int, model: Model, config: EngineConfig, n_seq: int,
                 draft_model: Model | None = None, n_kept: int = 0) -> None:
        """``n_seq`` slots, and ``n_kept`` more sequences of a slot's size for the prompt cache
        (engine/cache/prompt_cache.py)."""
        self.index = index
        self.n_vocab = model.n_vocab
        self.vocab = model.vocab
        self.seed = config.seed
        self.backend_sampling = config.backend_sampling
        n_batch = max(config.n_batch, n_seq)
        n_all = n_seq + n_kept
        # every sequence, slot or cache entry, gets a slot's share of the KV
        n_ctx = config.n_ctx_per_group // n_seq * n_all if n_kept else config.n_ctx_per_group
        spec = config.speculative
        drafting = spec is not None and spec.max_rows > 0 and not config.backend_sampling
        # a recurrent state takes back a row's rejected drafts from its snapshots, one a token
        # of the row's end, which llama.cpp keeps in one micro-batch with the token before them
        n_rs_seq = spec.n_max if drafting and model.recurrent else 0
        if n_rs_seq and min(config.n_ubatch, n_batch) <= n_rs_seq + 1:
            raise ValueError(f"speculative n_max {n_rs_seq} on a recurrent or hybrid model needs n_ubatch above "
                             f"n_max + 1 (n_ubatch {min(config.n_ubatch, n_batch)}): a row's drafts are taken back "
                             "from its state's snapshots, kept in one micro-batch")
        with ExitStack() as built:
            self.ctx = Context(
                model,
                n_ctx=n_ctx,
                n_seq_max=n_all,
                n_batch=n_batch,
                n_ubatch=config.n_ubatch,
                n_threads=config.local_threads(),
                kv_unified=config.kv_unified,
                swa_full=config.swa_full,
                flash_attn=config.flash_attn,
                n_rs_seq=n_rs_seq,
            )
            built.callback(self.ctx.close)
            self.drafter: NgramDrafter | ModelDrafter | MtpDrafter | None = None
            self.mtp: MtpDrafter | None = None  # the drafter, when it follows the target's KV
            if spec is not None and spec.max_rows > 0:
                if spec.type == "ngram":
                    self.drafter = NgramDrafter(spec)
                elif spec.type == "mtp":
                    # rows sampled in the graph give one token: no drafts, so no MTP context
                    if not config.backend_sampling:
                        self.drafter = self.mtp = MtpDrafter(
                            spec, model, self.ctx, n_ctx=n_ctx, n_seq=n_all, n_batch=n_batch,
                            n_ubatch=config.n_ubatch, n_threads=spec.draft_threads or config.local_threads(),
                            flash_attn=config.flash_attn, kv_unified=config.kv_unified)
                else:
                    self.drafter = ModelDrafter(
                        spec, draft_model, n_ctx=config.n_ctx_per_group, n_seq=n_seq, n_batch=n_batch,
                        n_threads=spec.draft_threads or config.local_threads(), flash_attn=config.flash_attn)
                if self.drafter is not None:
                    built.callback(self.drafter.close)
            self._close = built.pop_all()
        self.batch = Batch(n_batch)
        self.n_embd = int(llama_cpp.llama_model_n_embd_inp(model.ptr))  # a medium's rows (deepstack: wider)
        self._media_batch: Batch | None = None  # made for the first medium, as large as the largest
        self.n_ctx_slot = self.ctx.n_ctx_seq
        self.n_ubatch = self.ctx.n_ubatch
        # a recurrent state cannot go back to a position, nor a sliding window to one it dropped
        cuttable = not model.recurrent and (model.n_swa == 0 or config.swa_full)
        # with MTP, every KV operation of the prefix cache applies to the MTP context too
        self.prefix = PrefixCache(self.mtp.kv if self.mtp else self.ctx, n_swa=model.n_swa, unified=config.kv_unified,
                                  shareable=sharing_on(config, model),
                                  share_min=config.share_min_tokens,
                                  kept=PromptCache(index, n_seq, n_kept, min_tokens=config.share_min_tokens,
                                                   slack=config.share_min_tokens, exact=not cuttable),
                                  whole_only=model.recurrent, checkpoints=not cuttable)
        # when the decode in progress began (time.monotonic), 0.0 between decodes: a decode
        # that never returns (a frozen peer) is seen from outside by this
        self.decode_since = 0.0

    @property
    def capacity(self) -> int:
        return self.batch.capacity

    def close(self) -> None:
        self._close.close()

    def draft(self, rows: list[tuple[Slot, list[int], int]], n_min: int) -> dict[int, list[int]]:
        """Drafts (slot id -> tokens) for ``rows``; none when drafting fails (the draft
        context is reset and the step goes on without)."""
        if self.drafter is None or not rows:
            return {}
        try:
            drafts = self.drafter.draft(rows)
        except NativeError as e:
            log.warning("group %d: drafting failed: %s", self.index, e)
            self.drafter.reset()
            return {}
        return {s.id: dr for (s, _, _), dr in zip(rows, drafts, strict=True) if len(dr) >= n_min}

    def fill(self, plan: Plan) -> None:
        b = self.batch
        b.clear()
        for e in plan.entries:  # an entry's tokens are text, at consecutive positions
            b.add(e.tokens, positions.position(e.slot.cache_shifts, e.pos0), e.seq_id,
                  (1 + len(e.draft)) if e.out else 0)

    def decode(self, plan: Plan) -> None:
        """Decode the filled batch; the prefix cache then holds the plan's tokens, and the
        waiting slots the plan made due have their copies. Raises ``NativeError`` (``rc < 0``:
        a compute failure, the context cannot be trusted)."""
        for m in plan.media:
            self._decode_medium(m)
        if plan.entries:
            self._decode(self.batch)
        for e in plan.entries:
            self.prefix.extend(e.slot, e.tokens)
        if self.mtp is not None:
            self.mtp.observe(plan)
        for c in plan.copies:
            c.done = self.prefix.reuse_from(c.src, c.dst, c.n)

    def _decode_medium(self, m: MediaEntry) -> None:
        """One medium's embedding rows into its slot's KV: a batch of their own (without
        logits), with causal attention off where the projector's rows attend to each other,
        at the positions its projector gives them (M-RoPE: sections of their own)."""
        span, ids = m.span, m.tokens
        sections = span.sections
        b = self._media_batch
        if b is None or (sections is not None and len(b.pos) < b.capacity * len(sections)):
            b = self._media_batch = Batch(self.batch.capacity, self.n_embd, embeddings_only=True,
                                          n_sections=1 if sections is None else len(sections))
        p0 = positions.position(m.slot.cache_shifts, span.start)
        if not span.causal:  # whole in one micro-batch (the engine checked n_ubatch)
            self.ctx.set_causal(False)
        try:
            for i in range(0, span.n, b.capacity):  # a batch takes n_batch rows at most
                b.clear()
                part = slice(i, i + b.capacity)
                b.add(ids[part], p0 + i, m.slot.seq_id, 0, embd=span.embd[part])
                if sections is not None:
                    b.set_sections(span.sections_at(p0, part))
                self._decode(b)
        finally:
            if not span.causal:
                self.ctx.set_causal(True)
        self.prefix.extend(m.slot, ids, span.n_pos)

    def _decode(self, batch: Batch) -> None:
        """One ``llama_decode``, seen from outside while it runs (``decode_since``); the prefix
        cache's queued copies are applied by it."""
        self.decode_since = time.monotonic()
        try:
            self.ctx.decode(batch)
        finally:
            self.decode_since = 0.0
            self.prefix.applied()

    # ---- a request starts ---------------------------------------------------------------------

    def begin(self, st: Start, banned: tuple[int, ...], slots: list[Slot] = ()) -> None:
        """Start ``st.request`` on its slot as planned: the KV it reuses (a copy of a ready
        prefix, or what it keeps of its own), its sampler chain (``banned``: tokens it may not
        sample) fed the prompt, and, with backend sampling, the chain in the graph. What the slot held
        beyond what it keeps is saved into the prompt cache first (``slots``: the group's)."""
        s, r, reuse = st.slot, st.request, st.reuse
        # what the slot holds past what it keeps goes to the prompt cache first
        self.prefix.save(s, reuse.own if reuse.source is None else 0, reuse.source, slots)
        if reuse.source is not None and reuse.ready:
            n_reused = reuse.shared if self.prefix.reuse_from(reuse.source, s, reuse.shared) else 0
        else:
            n_reused = self.prefix.keep(s, reuse.own)
        if not n_reused and r.cache_prompt and st.leader is None and (reuse.source is None or reuse.ready):
            self.prefix.missed()
        sampler = SamplerChain(r.params, self.n_vocab, self.seed, force_chain=self.backend_sampling,
                               banned=banned, vocab=self.vocab, grammar=r.grammar)
        try:
            sampler.accept_prompt([t for t in r.prompt_tokens if t >= 0] if r.media else r.prompt_tokens)
        except BaseException:
            sampler.close()
            raise
        if st.leader is not None:  # an n > 1 follower: the whole prompt, then the leader's row
            s.start(r, sampler, 0, leader=st.leader, n_from_leader=len(r.prompt_tokens), on_leader_row=True)
        elif reuse.source is not None and not reuse.ready:  # a prefix on its way in another slot
            s.start(r, sampler, n_reused, leader=reuse.source, n_from_leader=reuse.shared)
        else:
            s.start(r, sampler, n_reused)
        # a family samples on the host: its followers' first token comes from the leader's row
        if self.backend_sampling and sampler.offloadable and not r.followers and st.leader is None:
            self.attach(s)

    # ---- a slot's KV in a file ------------------------------------------------------------------

    def save_slot(self, s: Slot, path: Path) -> int:
        """Write the slot's KV and tokens to ``path`` (and the MTP context's beside it, and
        where its tokens sit when that is not their index); returns the bytes written."""
        n = self.ctx.seq_save(str(path), s.seq_id, s.cache_tokens)
        if self.mtp is not None:
            self.mtp.save(str(path), s)
        side = _positions_file(path)
        if s.cache_shifts:
            side.write_text(json.dumps(s.cache_shifts))
        else:
            side.unlink(missing_ok=True)
        return n

    def load_slot(self, s: Slot, path: Path) -> int:
        """Replace the slot's KV by the one saved in ``path``; returns how many tokens it holds.
        On failure the slot holds nothing. Media whose positions are not known (a file without
        its positions beside it) are not kept, nor what follows them."""
        self.prefix.drop(s)
        try:
            tokens = self.ctx.seq_load(str(path), s.seq_id, self.n_ctx_slot)
        except BaseException:
            self.prefix.drop(s)
            raise
        side = _positions_file(path)
        shifts = [tuple(e) for e in json.loads(side.read_text())] if side.exists() else []
        self.prefix.load(s, tokens, shifts)
        if tokens and not shifts and self.ctx.seq_pos_max(s.seq_id) != len(tokens) - 1:
            first = next((i for i, t in enumerate(tokens) if is_media(t)), len(tokens))
            self.prefix.keep(s, first)
        if self.mtp is not None:
            self.mtp.load(str(path), s, self.n_ctx_slot)
        return len(s.cache_tokens)

    def export_history(self, slots: list[Slot], prompt: list[int], salt: str, min_n: int) -> Moved | None:
        """For another group: the state of this group's sequence holding the longest prefix of
        ``prompt`` (engine/cache/move.py)."""
        return export_history(self.prefix, self.ctx, self.mtp.ctx if self.mtp else None, slots, prompt, salt, min_n)

    def take_history(self, s: Slot, r: Request, moved: Moved, slots: list[Slot]) -> int:
        """Write another group's ``moved`` state into the slot for ``r`` where it is worth it;
        returns the prompt tokens it gives."""
        return take_history(self.prefix, self.ctx, self.mtp.ctx if self.mtp else None, s, r, moved, slots)

    def erase_slot(self, s: Slot) -> int:
        """Forget the slot's KV; returns how many tokens it held."""
        return self.prefix.drop(s)

    def logits(self, plan: Plan) -> np.ndarray | None:
        """The plan's logits rows, read once (the step's only synchronise); None when its rows
        are sampled in the graph."""
        if not plan.rows or self.backend_sampling:
            return None
        return self.ctx.logits(plan.n_logits, self.n_vocab)

    def attach(self, slot: Slot) -> None:
        """Sample the slot in the graph when its chain can be (backend sampling)."""
        slot.on_backend = self.ctx.set_sampler(slot.seq_id, slot.sampler.ptr)

    def detach(self, slot: Slot) -> None:
        if slot.on_backend:
            self.ctx.set_sampler(slot.seq_id, None)
            slot.on_backend = False

    def sampled_token(self, i: int) -> int:
        return self.ctx.sampled_token(i)

    def logits_row(self, i: int) -> np.ndarray:
        return self.ctx.logits_row(i, self.n_vocab)


def _positions_file(path: Path) -> Path:
    """Beside a slot file: where its tokens sit, when that is not their index."""
    return Path(str(path) + ".positions")
