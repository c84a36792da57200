"""A pipeline group: one llama_context, its batch, its samplers and the thread that owns them.

Only the group's thread touches its context, its batch and its slots' mutable state
(principle 1 of the design). Everything else reaches it as a message in ``inbox`` and is
handled between two decode steps: a new request, a cancel, a slot save/restore/erase.
One step is: build the batch (decode rows of generating slots first, then prompt chunks up
to ``n_batch``), decode, read the logits once (the only synchronise of the step), sample
every row (optionally over a small thread pool), then detokenise, check stop strings and
hand the step's outputs to the sink in one call.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.batching import Entry, count_ubatches, order_entries
from engine.config import EngineConfig
from engine.grammar import GrammarDeadEnd
from engine.native import Batch, Context, Model, NativeError
from engine.sampling import SamplerChain, token_logprobs
from engine.slots import Slot, SlotState, SlotView, common_prefix
from engine.speculative import ModelDrafter, NgramDrafter
from engine.text import TextStream
from engine.tokenizer import Tokenizer
from engine.types import SHUTTING_DOWN, FinishReason, Output, Request
from observability.profiler import GroupProfiler

log = logging.getLogger(__name__)

Sink = Callable[[list[Output]], None]


@dataclass
class StartMsg:
    request: Request


@dataclass
class CancelMsg:
    request_id: str


@dataclass
class SlotOpMsg:
    action: str  # "save" | "restore" | "erase"
    slot_id: int
    path: Path | None
    reply: Future


class _StopMsg:
    pass


@dataclass(slots=True)
class Row:
    """A slot sampled this step: the batch index and the logits row of its first output, and
    the draft verified on the rows after it (empty without speculation)."""

    slot: Slot
    batch_idx: int
    logits_idx: int
    draft: list[int]
    pos0: int


class PipelineGroup:
    def __init__(
        self,
        index: int,
        model: Model,
        tokenizer: Tokenizer,
        config: EngineConfig,
        slots: list[Slot],
        sink: Sink,
        on_release: Callable[[SlotView, bool], None],
        draft_model: Model | None = None,
    ) -> None:
        self.index = index
        self.model = model
        self.tok = tokenizer
        self.config = config
        self.slots = slots
        self._by_id = {s.id: s for s in slots}
        self.sink = sink
        self.on_release = on_release
        self.n_vocab = model.n_vocab
        n_batch = max(config.n_batch, len(slots))
        self.ctx = Context(
            model,
            n_ctx=config.n_ctx_per_group,
            n_seq_max=len(slots),
            n_batch=n_batch,
            n_ubatch=config.n_ubatch,
            n_threads=config.local_threads(),
            kv_unified=config.kv_unified,
            swa_full=config.swa_full,
            flash_attn=config.flash_attn,
        )
        self.n_ctx_slot = self.ctx.n_ctx_seq
        self.batch = Batch(n_batch)
        self.spec = config.speculative
        self.drafter: NgramDrafter | ModelDrafter | None = None
        try:
            if self.spec is not None and self.spec.max_rows > 0:
                if self.spec.type == "ngram":
                    self.drafter = NgramDrafter(self.spec)
                else:
                    self.drafter = ModelDrafter(
                        self.spec, draft_model, n_ctx=config.n_ctx_per_group, n_seq=len(slots), n_batch=n_batch,
                        n_threads=self.spec.draft_threads or config.local_threads(), flash_attn=config.flash_attn)
        except BaseException:  # this group is never handed out: its context goes with it
            self.ctx.close()
            raise
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        n_pool = config.sample_threads_per_group()
        self.n_sample_threads = n_pool
        self.pool = (
            ThreadPoolExecutor(max_workers=n_pool, thread_name_prefix=f"pgroup{index}-sample")
            if n_pool > 1
            else None
        )
        self.prof = GroupProfiler(index, kv_total=self.ctx.n_ctx, enabled_log=config.profile)
        self.active: list[Slot] = []
        self._row_errors: dict[int, tuple[str, int]] = {}  # slot id -> why its sampler failed this step, status
        self._row_logprobs: dict[int, list] = {}  # slot id -> this step's token logprobs, in order
        self.alive = True
        self.error: str | None = None
        # when the decode in progress began (time.monotonic), 0.0 between decodes: a decode
        # that never returns (a frozen peer) is seen from outside by this
        self.decode_since = 0.0
        # when the step in progress began, 0.0 between steps: a step stuck in native code
        # (decode, a sampler, a grammar mask) past the engine's step budget is seen by this
        self.step_since = 0.0
        self._thread = threading.Thread(target=self._run, name=f"pgroup-{index}", daemon=True)

    # ---- lifecycle (any thread) -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self.inbox.put(_StopMsg())
            self._thread.join(timeout)

    def close(self) -> None:
        """Free native state; only after ``stop``."""
        if self._thread.is_alive():
            raise RuntimeError("group thread still running")
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for s in self.slots:
            if s.sampler is not None:
                s.sampler.close()
                s.sampler = None
        if self.drafter is not None:
            self.drafter.close()
        self.ctx.close()

    # ---- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        if self.config.local_cpus:
            # pid 0 is this thread; ggml's compute threads, created from it, inherit the mask
            os.sched_setaffinity(0, self.config.local_cpus)
        try:
            while True:
                t0 = time.perf_counter()
                if not self.active:
                    msg = self.inbox.get()
                    if not self._handle(msg):
                        return
                while True:
                    try:
                        msg = self.inbox.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(msg):
                        return
                self.prof.add("wait", time.perf_counter() - t0)
                if self.active:
                    self.step_since = time.monotonic()
                    self._step()
                    self.step_since = 0.0
        except BaseException as e:  # the group is dead: fail what it holds, never hang callers
            log.exception("pipeline group %d died", self.index)
            self.alive = False
            self.error = f"pipeline group {self.index} failed: {e}"
            outs = []
            for s in list(self.active):
                outs.append(self._finish(s, FinishReason.ERROR, "", error=self.error, status=503, release=False))
            self._drain_after_death(outs)

    def _drain_after_death(self, outs: list[Output]) -> None:
        if outs:
            self.sink(outs)
        # hand the slots back so that waiting requests come here and fail instead of hanging
        for s in self.slots:
            self.on_release(s.view(), True)
        while True:
            msg = self.inbox.get()
            if isinstance(msg, _StopMsg):
                return
            if isinstance(msg, StartMsg):
                r = msg.request
                self.sink([Output(r.id, "", 0, FinishReason.ERROR, len(r.prompt_tokens), error=self.error, status=503)])
                self.on_release(self._by_id[r.slot_id].view(), True)
            elif isinstance(msg, SlotOpMsg):
                msg.reply.set_exception(RuntimeError(self.error))

    def _handle(self, msg: object) -> bool:
        if isinstance(msg, StartMsg):
            try:
                self._begin(msg.request)
            except Exception as e:  # this request cannot start; the group goes on
                log.exception("group %d: request %s failed to start", self.index, msg.request.id)
                outs = []
                for m in msg.request.family:
                    s = self._by_id[m.slot_id]
                    if s.req is m and s in self.active:
                        outs.append(self._finish(s, FinishReason.ERROR, "", error=f"request failed to start: {e}"))
                        continue
                    # the slot may still hold the previous request's figures: report this one's
                    s.req = m
                    s.n_generated = s.n_reused = 0
                    s.t_start, s.t_first_token = time.monotonic(), 0.0
                    outs.append(self._finish(s, FinishReason.ERROR, "", error=f"request failed to start: {e}"))
                self.sink(outs)
        elif isinstance(msg, CancelMsg):
            for s in self.active:
                if s.req is not None and s.req.id == msg.request_id:
                    out = self._finish(s, FinishReason.CANCELLED, "")
                    self.sink([out])
                    break
        elif isinstance(msg, SlotOpMsg):
            # a caller that gave up cancelled the future: the action must not run late
            if msg.reply.set_running_or_notify_cancel():
                try:
                    msg.reply.set_result(self._slot_op(msg))
                except Exception as e:
                    msg.reply.set_exception(e)
        elif isinstance(msg, _StopMsg):
            outs = [self._finish(s, FinishReason.ERROR, "", error=SHUTTING_DOWN, status=503, release=False)
                    for s in list(self.active)]
            if outs:
                self.sink(outs)
            return False
        return True

    def _begin(self, r: Request) -> None:
        leader = self._begin_one(r)
        for f in r.followers:
            # its own sampler and text from now; its prompt's KV comes from the leader
            fs = self._begin_one(f, leader)
            leader.forks.append(fs)

    def _begin_one(self, r: Request, leader: Slot | None = None) -> Slot:
        s = self._by_id[r.slot_id]
        assert s.state is SlotState.IDLE, f"slot {s.id} is busy"
        tokens = r.prompt_tokens
        n_keep = 0
        if leader is None and self.config.cache_prompt and r.cache_prompt and s.cache_tokens:
            n_keep = common_prefix(np.asarray(s.cache_tokens, np.int32), np.asarray(tokens, np.int32))
        # the last prompt token is always evaluated
        n_keep = self.ctx.keep_prefix(s.seq_id, s.cache_tokens, min(n_keep, len(tokens) - 1))
        s.req = r
        backend = self.config.backend_sampling
        s.sampler = SamplerChain(r.params, self.n_vocab, self.config.seed, force_chain=backend,
                                 banned=self.tok.eog_tokens if r.params.ignore_eos else (),
                                 vocab=self.model.vocab, grammar=r.grammar)
        s.sampler.accept_prompt(tokens)
        # a family samples on the host: its followers' first token comes from the leader's row
        if backend and s.sampler.offloadable and not r.followers and leader is None:
            s.on_backend = self.ctx.set_sampler(s.seq_id, s.sampler.ptr)
        s.text = TextStream(r.params.stop)
        s.n_prompt_done = n_keep
        s.n_reused = n_keep
        s.n_generated = 0
        s.last_token = -1
        s.t_start = time.monotonic()
        s.t_first_token = 0.0
        s.saw_newline = False
        s.spec.reset()
        s.state = SlotState.PROMPT
        s.leader = leader
        self.active.append(s)
        self.on_release(s.view(), False)
        return s

    def _drafts(self, gen: list[Slot]) -> dict[int, list[int]]:
        """This step's drafts (slot id -> tokens) for the generating slots ``gen``, when the
        group speculates this step."""
        d, sc = self.drafter, self.spec
        if d is None or self.config.backend_sampling:  # rows sampled in the graph give one token
            return {}
        if not gen or len(gen) > sc.max_rows:
            return {}
        rows = []
        for s in gen:
            if not s.req.params.speculative:
                continue
            # the last verified row is the request's last token: never draft past n_predict
            limit = min(sc.n_max, s.req.n_predict - s.n_generated - 1, self.n_ctx_slot - len(s.cache_tokens) - 1)
            if limit >= sc.n_min and s.spec.wants():
                rows.append((s, [*s.cache_tokens, s.last_token], limit))
        if not rows:
            return {}
        t0 = time.perf_counter()
        try:
            drafts = d.draft(rows)
        except NativeError as e:  # the draft context failed: this step goes on without drafts
            log.warning("group %d: drafting failed: %s", self.index, e)
            d.reset()
            return {}
        finally:
            self.prof.add("draft", time.perf_counter() - t0)
        return {s.id: dr for (s, _, _), dr in zip(rows, drafts, strict=True) if len(dr) >= sc.n_min}

    def _plan(self, gen: list[Slot], drafts: dict[int, list[int]]) -> list[Entry]:
        """This step's work: every generating slot's last token (and its draft, if any), then
        prompt chunks up to ``n_batch`` (in the order the slots became busy), laid out by
        sequence id."""
        entries: list[Entry] = []
        free = self.batch.capacity - len(gen)
        for s in gen:
            draft = drafts.get(s.id, ())[:free]
            free -= len(draft)
            entries.append(Entry(s, s.seq_id, len(s.cache_tokens), [s.last_token, *draft], True, list(draft)))
        for s in self.active:
            if s.state is not SlotState.PROMPT or free == 0 or s.leader is not None:
                continue
            p = s.req.prompt_tokens
            chunk = p[s.n_prompt_done : s.n_prompt_done + free]
            free -= len(chunk)
            entries.append(Entry(s, s.seq_id, s.n_prompt_done, chunk, s.n_prompt_done + len(chunk) == len(p)))
        return order_entries(entries)

    def _step(self) -> None:
        """One step in five phases on this thread: draft, plan the batch, execute it, sample
        (and verify) its rows, post-process (detokenise, stop strings, finish) and send."""
        prof = self.prof
        gen = [s for s in self.active if s.state is SlotState.GENERATING]
        drafts = self._drafts(gen)
        t0 = time.perf_counter()
        entries = self._plan(gen, drafts)
        rows = self._fill_batch(entries)
        n_tokens = self.batch.n_tokens
        n_ubatches = count_ubatches(entries, self.ctx.n_ubatch, self.config.kv_unified)
        t1 = time.perf_counter()
        prof.add("batch", t1 - t0)
        if not self._execute(entries):
            return
        t2 = time.perf_counter()
        backend = self.config.backend_sampling
        n_logits = sum(1 + len(r.draft) for r in rows)
        logits = self.ctx.logits(n_logits, self.n_vocab) if rows and not backend else None
        t3 = time.perf_counter()
        prof.add("sync", t3 - t2)
        progress = []
        for e in entries:  # the KV now holds the entries' tokens
            s = e.slot
            s.cache_tokens.extend(e.tokens)
            if s.state is SlotState.PROMPT:
                s.n_prompt_done += len(e.tokens)
                if s.req.params.return_progress:
                    progress.append(self._progress(s))
        self._fork(rows)
        if not rows:
            tokens = []
        elif backend:
            tokens = self._sample_backend(rows)
        else:
            tokens = self._sample(rows, logits)
        t4 = time.perf_counter()
        prof.add("sample", t4 - t3)
        drafted = accepted = 0
        for r, toks in zip(rows, tokens, strict=True):
            if r.draft:
                n_acc = self._verified(r, toks)
                drafted += len(r.draft)
                accepted += n_acc
        if drafted:
            prof.add_spec(drafted, accepted)
        outs = progress + [o for r, toks in zip(rows, tokens, strict=True) if (o := self._process(r.slot, toks)) is not None]
        t5 = time.perf_counter()
        if outs:
            self.sink(outs)
        prof.add("send", time.perf_counter() - t5)
        n_busy = len(self.active) + sum(1 for o in outs if o.finish_reason)
        prof.end_step(sum(len(t) for t in tokens), n_tokens, n_busy,
                      sum(len(s.cache_tokens) for s in self.slots), n_ubatches)

    def _verified(self, r: Row, toks: list[int]) -> int:
        """After a drafted row's verification: drop the KV of the draft tokens that were not
        accepted; returns how many were."""
        s, draft = r.slot, r.draft
        n = 0
        # the last token of the step is the next step's input, never in the KV yet
        while n < len(draft) and n < len(toks) - 1 and toks[n] == draft[n]:
            n += 1
        if n < len(draft):
            keep = r.pos0 + 1 + n  # the row's last token and the accepted drafts
            if not self.ctx.seq_rm(s.seq_id, keep, -1):
                raise NativeError(f"removing rejected draft tokens of sequence {s.seq_id} failed", -1)
            del s.cache_tokens[keep:]
        s.spec.record(len(draft), n)
        return n

    def _fill_batch(self, entries: list[Entry]) -> list[Row]:
        """The batch of this step's entries; returns the rows sampled this step, in the batch
        order of their logits."""
        b = self.batch
        b.clear()
        rows: list[Row] = []
        n_out = 0
        for e in entries:
            n_logits = (1 + len(e.draft)) if e.out else 0
            i0 = b.add(e.tokens, e.pos0, e.seq_id, n_logits)
            if e.out:
                rows.append(Row(e.slot, i0 + len(e.tokens) - 1 - len(e.draft), n_out, e.draft, e.pos0))
                n_out += n_logits
        return rows

    def _execute(self, entries: list[Entry]) -> bool:
        """Decode the batch; False when it failed (its requests have ended with an error)."""
        t1, c1 = time.perf_counter(), time.thread_time()
        self.decode_since = time.monotonic()
        try:
            self.ctx.decode(self.batch)
        except NativeError as e:
            self.decode_since = 0.0
            self._fail_batch([en.slot for en in entries], str(e))
            if e.rc < 0:
                # a compute failure (e.g. the RPC stage went away): the context cannot be
                # trusted any more; the group stops and the engine reports itself unhealthy
                raise
            return False
        self.decode_since = 0.0
        self.prof.add("decode", time.perf_counter() - t1)
        # CPU time of this thread in decode: the local stage's compute when it runs on the CPU
        self.prof.add("decode_cpu", time.thread_time() - c1)
        return True

    def _fork(self, rows: list[Row]) -> None:
        """Leaders whose prompt is now in the KV hand it to their followers: each follower's
        sequence gets a copy and joins this step's rows on its leader's logits."""
        for i in range(len(rows)):
            s = rows[i].slot
            if not s.forks or s.n_prompt_done < len(s.req.prompt_tokens):
                continue
            for f in s.forks:
                self.ctx.seq_cp(s.seq_id, f.seq_id)
                f.cache_tokens[:] = s.cache_tokens
                f.n_prompt_done = len(f.req.prompt_tokens)
                f.leader = None
                rows.append(Row(f, rows[i].batch_idx, rows[i].logits_idx, [], rows[i].pos0))
            s.forks = []

    def _sample(self, rows: list[Row], logits: np.ndarray) -> list[list[int]]:
        n = len(rows)
        if self.pool is None or n < 2:
            return [self._sample_slot(r, logits) for r in rows]
        k = min(self.n_sample_threads, n)
        bounds = [n * j // k for j in range(k + 1)]

        def work(lo: int, hi: int) -> list[list[int]]:
            return [self._sample_slot(rows[i], logits) for i in range(lo, hi)]

        futs = [self.pool.submit(work, bounds[j], bounds[j + 1]) for j in range(1, k)]
        out = work(bounds[0], bounds[1])
        for f in futs:
            out.extend(f.result())
        return out

    def _sample_slot(self, r: Row, logits: np.ndarray) -> list[int]:
        """A row's tokens: one, or with a draft, one per verified position until the first
        sampled token that differs from the draft (that one included). Each token is
        accepted by the chain before the next position is sampled."""
        s, draft = r.slot, r.draft
        out = []
        for i in range(len(draft) + 1):
            tok = self._sample_row(s, logits[r.logits_idx + i])
            out.append(tok)
            if i == len(draft) or tok != draft[i] or self.tok.is_eog(tok):
                break
        return out

    def _sample_row(self, s: Slot, row: np.ndarray) -> int:
        """One row's token, accepted by the slot's chain, or -1 when its sampler fails (e.g. a
        grammar that no token of the vocabulary can continue): that request ends with an
        error, the group goes on."""
        try:
            tok = s.sampler.sample(row)
            s.sampler.accept(tok)
        except GrammarDeadEnd as e:  # the request's own grammar: its client's error
            self._row_errors[s.id] = (f"the output cannot continue under the request's grammar: {e}", 400)
            return -1
        except Exception as e:
            self._row_errors[s.id] = (f"sampling failed: {e}", 500)
            return -1
        k = s.req.params.logprobs
        if k is not None:  # only the rows that ask pay for it
            post = s.sampler.post
            lp, top = post if post is not None else token_logprobs(row, tok, k)
            piece = self.tok.piece
            self._row_logprobs.setdefault(s.id, []).append(
                (piece(tok, special=False), lp, tuple((piece(t, special=False), v) for t, v in top)))
        return tok

    def _sample_backend(self, rows: list[Row]) -> list[list[int]]:
        """Rows sampled in the graph are read back; the others sample from their logits row."""
        out = []
        for r in rows:
            s = r.slot
            if s.on_backend:
                tok = self.ctx.sampled_token(r.batch_idx)
                s.sampler.accept(tok)
                out.append([tok])
            else:
                out.append([self._sample_row(s, self.ctx.logits_row(r.batch_idx, self.n_vocab))])
        return out

    def _process(self, s: Slot, toks: list[int]) -> Output | None:
        """Account for the tokens sampled for slot ``s`` this step; returns what to send."""
        prof = self.prof
        t0 = time.perf_counter()
        r = s.req
        lp_rows = self._row_logprobs.pop(s.id, None) if self._row_logprobs else None
        texts: list[str] = []
        emitted: list[int] = []
        lps: list = []

        def done(reason: FinishReason, tail: str, n: int, **kw: object) -> Output:
            return self._finish(s, reason, "".join(texts) + tail, n_tokens=n, tokens=tuple(emitted), **kw)

        if r.n_predict == 0:  # llama-server's n_predict 0: the prompt is evaluated (and cached), nothing generated
            return done(FinishReason.LENGTH, "", 0)

        for i, tok in enumerate(toks):
            if tok < 0:
                error, status = self._row_errors.pop(s.id, ("sampling failed", 500))
                return done(FinishReason.ERROR, s.text.flush(), len(emitted), error=error, status=status,
                            logprobs=tuple(lps) or None)
            s.n_generated += 1
            s.last_token = tok
            if s.n_generated == 1:
                s.t_first_token = time.monotonic()
                s.state = SlotState.GENERATING
            if self.tok.is_eog(tok):  # never with ignore_eos: the sampler bans these tokens then
                prof.add("detok", time.perf_counter() - t0)
                # the end-of-generation token is not text; what was held back is
                return done(FinishReason.STOP, s.text.flush(), len(emitted) + 1, logprobs=tuple(lps) or None)
            piece = self.tok.piece(tok, special=False)
            t1 = time.perf_counter()
            prof.add("detok", t1 - t0)
            texts.append(s.text.feed(piece))
            t0 = time.perf_counter()
            prof.add("stop", t0 - t1)
            if s.text.stopped_by is not None:
                emitted.append(tok)
                return done(FinishReason.STOP, "", len(emitted), logprobs=tuple(lps) or None,
                            stop_word=s.text.stopped_by)
            emitted.append(tok)
            if lp_rows is not None:
                lps.append(lp_rows[i])
            if s.n_generated >= r.n_predict or self._past_time_limit(s, piece):
                return done(FinishReason.LENGTH, s.text.flush(), len(emitted), logprobs=tuple(lps) or None)
        return Output(r.id, "".join(texts), len(emitted), logprobs=tuple(lps) or None, tokens=tuple(emitted))

    @staticmethod
    def _progress(s: Slot) -> Output:
        """llama-server's prompt progress of a slot, after a prompt chunk: (processed, total,
        cached, milliseconds since the slot started)."""
        r = s.req
        ms = int((time.monotonic() - s.t_start) * 1000)
        return Output(r.id, "", 0, progress=(s.n_prompt_done, len(r.prompt_tokens), s.n_reused, ms))

    @staticmethod
    def _past_time_limit(s: Slot, piece: bytes) -> bool:
        """llama-server's ``t_max_predict_ms``: the generation ran past it, counted from the first
        token, and has a newline (an editor's completion ends at a line, not mid-word)."""
        limit = s.req.params.t_max_predict_ms
        if not limit:
            return False
        s.saw_newline = s.saw_newline or b"\n" in piece
        return s.saw_newline and (time.monotonic() - s.t_first_token) * 1000.0 > limit

    def _finish(
        self,
        s: Slot,
        reason: FinishReason,
        text: str,
        *,
        error: str | None = None,
        status: int = 0,
        n_tokens: int = 0,
        release: bool = True,
        logprobs: tuple | None = None,
        tokens: tuple[int, ...] = (),
        stop_word: str | None = None,
    ) -> Output:
        r = s.req
        now = time.monotonic()
        out = Output(
            request_id=r.id,
            text=text,
            n_tokens=n_tokens,
            finish_reason=reason,
            prompt_tokens=len(r.prompt_tokens),
            completion_tokens=s.n_generated,
            cached_tokens=s.n_reused,
            error=error,
            t_first_token=(s.t_first_token - r.t_arrival) if s.t_first_token else 0.0,
            t_queue=s.t_start - r.t_arrival,
            t_end=now - r.t_arrival,
            status=status,
            logprobs=logprobs,
            tokens=tokens,
            stop_word=stop_word,
            slot=s.id,
        )
        if s.on_backend:
            self.ctx.set_sampler(s.seq_id, None)
            s.on_backend = False
        if s.sampler is not None:
            s.sampler.close()
            s.sampler = None
        # n > 1 before the prompt was shared: a leader's followers evaluate it themselves; a
        # follower leaves its leader's list
        for f in s.forks:
            f.leader = None
        s.forks = []
        if s.leader is not None:
            s.leader.forks.remove(s)
            s.leader = None
        s.text = None
        s.req = None
        s.state = SlotState.IDLE
        s.last_used = now
        if s in self.active:
            self.active.remove(s)
        if release:
            self.on_release(s.view(), True)
        return out

    def _fail_batch(self, failed: list[Slot], err: str) -> None:
        log.error("group %d: decode failed: %s", self.index, err)
        outs = []
        for s in failed:
            # the sequence's KV is now unknown: drop it
            self.ctx.seq_rm(s.seq_id, 0, -1)
            s.cache_tokens.clear()
            outs.append(self._finish(s, FinishReason.ERROR, "", error=f"decode failed: {err}"))
        self.sink(outs)

    # ---- slot operations (group thread) -----------------------------------------------------

    def _slot_op(self, m: SlotOpMsg) -> dict:
        s = self._by_id[m.slot_id]
        if s.state is not SlotState.IDLE:
            raise SlotBusyError(f"slot {s.id} is busy")
        t0 = time.perf_counter()
        if m.action == "erase":
            n = len(s.cache_tokens)
            self.ctx.seq_rm(s.seq_id, 0, -1)
            s.cache_tokens.clear()
            res = {"id_slot": s.id, "n_erased": n}
        elif m.action == "save":
            n_bytes = self.ctx.seq_save(str(m.path), s.seq_id, s.cache_tokens)
            res = {
                "id_slot": s.id,
                "filename": m.path.name,
                "n_saved": len(s.cache_tokens),
                "n_written": n_bytes,
            }
        elif m.action == "restore":
            if not m.path.is_file():
                raise FileNotFoundError(f"no saved slot file {m.path.name}")
            self.ctx.seq_rm(s.seq_id, 0, -1)
            s.cache_tokens.clear()
            try:
                toks = self.ctx.seq_load(str(m.path), s.seq_id, self.n_ctx_slot)
            except BaseException:
                # the slot's cache is gone: the scheduler must not choose it for its old prefix
                self.ctx.seq_rm(s.seq_id, 0, -1)
                self.on_release(s.view(), False)
                raise
            s.cache_tokens.extend(toks)
            res = {
                "id_slot": s.id,
                "filename": m.path.name,
                "n_restored": len(toks),
                "n_read": os.path.getsize(m.path),
            }
        else:
            raise ValueError(f"unknown slot action {m.action!r}")
        res["timings"] = {"ms": (time.perf_counter() - t0) * 1000.0}
        s.last_used = time.monotonic()
        self.on_release(s.view(), False)
        return res


class SlotBusyError(RuntimeError):
    pass
