"""The third part of a step: from logits to ``Output``s. It reports prompt progress where
asked, samples every row of the plan (over a small thread pool when there are several),
verifies drafts, then, per slot, detokenises, checks stop strings and limits, and returns
what the step gives (``Processed``): the outputs to send, the requests that end, the slots
that began generating.

It makes no decision about the KV but one: a rejected draft's tokens leave the slot's
sequence (through the prefix cache). Ending a request is the group's (``finish``), which
frees what the slot held and publishes it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from engine.cache.prefix import PrefixCache
from engine.planner import Plan, Row
from engine.runner import Runner
from engine.sampling import token_logprobs
from engine.slots import Slot, SlotState
from engine.text.matcher import GrammarDeadEnd
from engine.text.tokenizer import Tokenizer
from engine.types import Delta, Failure, Fault, Finish, FinishReason, Output
from observability.profiler import GroupProfiler


@dataclass(frozen=True)
class Ending:
    """A request that ends this step: why, its last text and the figures of its final output
    (the group ends it: the processor never frees a slot)."""

    reason: FinishReason | Fault  # a fault: the request fails
    text: str
    figures: dict


@dataclass
class Processed:
    """What one step gave: ``outputs`` to send (prompt progress, new text), the requests that
    end (``endings``: their slot and why) and the slots that began generating (``began``)."""

    outputs: list[Output]
    endings: list[tuple[Slot, Ending]]
    began: list[Slot]
    n_sampled: int


def final_output(s: Slot, reason: FinishReason | Fault, text: str, *, message: str = "", n_tokens: int = 0,
                 logprobs: tuple | None = None, tokens: tuple[int, ...] = (), stop_word: str | None = None
                 ) -> Finish | Failure:
    """The last output of the request on slot ``s``, with its figures: a ``Finish`` with its
    reason, or a ``Failure`` when ``reason`` is a fault (``message`` the client's words)."""
    r = s.req
    figures = {
        "prompt_tokens": len(r.prompt_tokens), "completion_tokens": s.n_generated, "cached_tokens": s.n_reused,
        "t_first_token": (s.t_first_token - r.t_arrival) if s.t_first_token else 0.0,
        "t_queue": s.t_start - r.t_arrival, "t_end": time.monotonic() - r.t_arrival,
        "logprobs": logprobs, "tokens": tokens, "slot": s.id,
    }
    if isinstance(reason, Fault):
        return Failure(r.id, reason, message, text, n_tokens, **figures)
    return Finish(r.id, text, n_tokens, reason, stop_word=stop_word, **figures)


def progress_output(s: Slot) -> Delta:
    """llama-server's prompt progress of a slot, after a prompt chunk: (processed, total,
    cached, milliseconds since the slot started)."""
    r = s.req
    ms = int((time.monotonic() - s.t_start) * 1000)
    return Delta(r.id, "", 0, progress=(s.n_prompt_done, len(r.prompt_tokens), s.n_reused, ms))


class OutputProcessor:
    def __init__(self, index: int, tokenizer: Tokenizer, runner: Runner, prof: GroupProfiler,
                 n_threads: int) -> None:
        self.tok = tokenizer
        self.runner = runner
        self.prefix: PrefixCache = runner.prefix
        self.prof = prof
        self.n_threads = n_threads
        self.pool = (ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix=f"pgroup{index}-sample")
                     if n_threads > 1 else None)
        self._row_errors: dict[int, tuple[str, Fault]] = {}  # slot id -> why its sampler failed this step
        self._row_logprobs: dict[int, list] = {}  # slot id -> this step's token logprobs, in order

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def process(self, plan: Plan, logits: np.ndarray | None) -> Processed:
        """The step's outputs, after ``plan.advance``: progress, then every row sampled,
        verified and turned into text (timed as sample, then detok and stop)."""
        with self.prof.timed("sample"):
            outs = [progress_output(e.slot) for e in plan.entries
                    if e.slot.state is SlotState.PROMPT and e.slot.req.params.return_progress]
            tokens = self.sample(plan, logits)
            self.verify(plan, tokens)
        endings: list[tuple[Slot, Ending]] = []
        began: list[Slot] = []
        for r, toks in zip(plan.rows, tokens, strict=True):
            s = r.slot
            was_prompt = s.state is SlotState.PROMPT
            got = self.emit(s, toks)
            if isinstance(got, Ending):
                endings.append((s, got))
                continue
            if got is not None:
                outs.append(got)
            if was_prompt and s.state is SlotState.GENERATING:
                began.append(s)
        return Processed(outs, endings, began, sum(len(t) for t in tokens))

    # ---- sampling ---------------------------------------------------------------------------

    def sample(self, plan: Plan, logits: np.ndarray | None) -> list[list[int]]:
        """Every row's tokens, in the plan's row order."""
        rows = plan.rows
        if not rows:
            return []
        if logits is None:  # backend sampling: read back what the graph sampled
            return [self._backend_row(r) for r in rows]
        n = len(rows)
        if self.pool is None or n < 2:
            return [self._sample_slot(r, logits) for r in rows]
        k = min(self.n_threads, n)
        bounds = [n * j // k for j in range(k + 1)]

        def work(lo: int, hi: int) -> list[list[int]]:
            return [self._sample_slot(rows[i], logits) for i in range(lo, hi)]

        futs = [self.pool.submit(work, bounds[j], bounds[j + 1]) for j in range(1, k)]
        out = work(bounds[0], bounds[1])
        for f in futs:
            out.extend(f.result())
        return out

    def _backend_row(self, r: Row) -> list[int]:
        s = r.slot
        if s.on_backend:
            tok = self.runner.sampled_token(r.batch_idx)
            s.sampler.accept(tok)
            return [tok]
        return [self._sample_row(s, self.runner.logits_row(r.batch_idx))]

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
            self._row_errors[s.id] = (f"the output cannot continue under the request's grammar: {e}", Fault.REQUEST)
            return -1
        except Exception as e:
            self._row_errors[s.id] = (f"sampling failed: {e}", Fault.INTERNAL)
            return -1
        k = s.req.params.logprobs
        if k is not None:  # only the rows that ask pay for it
            post = s.sampler.post
            lp, top = post if post is not None else token_logprobs(row, tok, k)
            piece = self.tok.piece
            self._row_logprobs.setdefault(s.id, []).append(
                (piece(tok, special=False), lp, tuple((piece(t, special=False), v) for t, v in top)))
        return tok

    # ---- drafts -----------------------------------------------------------------------------

    def verify(self, plan: Plan, tokens: list[list[int]]) -> None:
        """After the drafted rows' verification: the KV of the draft tokens that were not
        accepted leaves their sequences; the profiler counts drafted and accepted."""
        drafts = drafted = accepted = 0
        for r, toks in zip(plan.rows, tokens, strict=True):
            if not r.draft:
                continue
            s, draft = r.slot, r.draft
            n = 0
            # the last token of the step is the next step's input, never in the KV yet
            while n < len(draft) and n < len(toks) - 1 and toks[n] == draft[n]:
                n += 1
            if n < len(draft):
                self.prefix.cut(s, r.pos0 + 1 + n)  # the row's last token and the accepted drafts
            s.spec.record(len(draft), n)
            drafts += 1
            drafted += len(draft)
            accepted += n
        if drafted:
            self.prof.add_spec(drafts, drafted, accepted)

    # ---- post-processing --------------------------------------------------------------------

    def emit(self, s: Slot, toks: list[int]) -> Output | Ending | None:
        """Account for the tokens sampled for slot ``s`` this step; returns what to send, or
        the ``Ending`` of a request that ends (the group makes its final output)."""
        prof = self.prof
        t0 = time.perf_counter()
        r = s.req
        lp_rows = self._row_logprobs.pop(s.id, None) if self._row_logprobs else None
        texts: list[str] = []
        emitted: list[int] = []
        lps: list = []

        def done(reason: FinishReason | Fault, tail: str, n: int, **kw: object) -> Ending:
            return Ending(reason, "".join(texts) + tail,
                          {"n_tokens": n, "tokens": tuple(emitted), "logprobs": tuple(lps) or None, **kw})

        if r.n_predict == 0:  # llama-server's n_predict 0: the prompt is evaluated (and cached), nothing generated
            return done(FinishReason.LENGTH, "", 0)

        for i, tok in enumerate(toks):
            if tok < 0:
                message, fault = self._row_errors.pop(s.id, ("sampling failed", Fault.INTERNAL))
                return done(fault, s.text.flush(), len(emitted), message=message)
            s.n_generated += 1
            s.last_token = tok
            if s.n_generated == 1:
                s.t_first_token = time.monotonic()
                s.state = SlotState.GENERATING
            if self.tok.is_eog(tok):  # never with ignore_eos: the sampler bans these tokens then
                prof.add("detok", time.perf_counter() - t0)
                # the end-of-generation token is not text; what was held back is. It is one of
                # the tokens generated, as llama-server's return_tokens gives them
                emitted.append(tok)
                return done(FinishReason.STOP, s.text.flush(), len(emitted))
            piece = self.tok.piece(tok, special=tok in s.req.preserved)
            t1 = time.perf_counter()
            prof.add("detok", t1 - t0)
            texts.append(s.text.feed(piece))
            t0 = time.perf_counter()
            prof.add("stop", t0 - t1)
            if s.text.stopped_by is not None:
                emitted.append(tok)
                return done(FinishReason.STOP, "", len(emitted), stop_word=s.text.stopped_by)
            emitted.append(tok)
            if lp_rows is not None:
                lps.append(lp_rows[i])
            if s.n_generated >= r.n_predict or _past_time_limit(s, piece):
                return done(FinishReason.LENGTH, s.text.flush(), len(emitted))
        return Delta(r.id, "".join(texts), len(emitted), logprobs=tuple(lps) or None, tokens=tuple(emitted))


def _past_time_limit(s: Slot, piece: bytes) -> bool:
    """llama-server's ``t_max_predict_ms``: the generation ran past it, counted from the first
    token, and has a newline (an editor's completion ends at a line, not mid-word)."""
    limit = s.req.params.t_max_predict_ms
    if not limit:
        return False
    s.saw_newline = s.saw_newline or b"\n" in piece
    return s.saw_newline and (time.monotonic() - s.t_first_token) * 1000.0 > limit
