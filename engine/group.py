"""A pipeline group: one llama_context, its batch, its samplers and the thread that owns them.

Only the group's thread touches its context, its batch and its slots' mutable state
(principle 1 of the design). Everything else reaches it as a message in ``inbox`` and is
handled between two steps: a new request, a cancel, a slot save/restore/erase.

A step is three parts on this thread, each its own unit: the planner (engine/planner.py)
lays out what to compute (decode rows of generating slots first, then prompt chunks up to
the batch's capacity, shortest first, and the KV copies for slots waiting on a prefix) without a native
write; the runner (engine/runner.py) owns the context, batch, drafter and prefix cache and
turns the plan into logits, read once; the output processor (engine/processor.py) samples
every row, verifies drafts, detokenises, checks stops and returns the step's ``Output``s and
the requests that end; the group frees those slots and hands the outputs to the sink in one
call. A request's start is planned and carried out the same way (``plan_start``,
``Runner.begin``); the runner also saves and loads a slot's KV. The group keeps the inbox,
the thread, failure handling and what it publishes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from engine.budget import PrefillBudget
from engine.cache.move import MOVE_WAIT_S, Moved
from engine.config import EngineConfig
from engine.errors import NativeError
from engine.messages import CancelMsg, ExportMsg, SlotBusyError, SlotOpMsg, StartMsg, StopMsg
from engine.native.model import Model
from engine.planner import (
    Plan,
    draft_requests,
    generating,
    n_short,
    plan_start,
    plan_step,
    prompting,
)
from engine.processor import OutputProcessor, final_output
from engine.runner import Runner
from engine.slots import Slot, SlotState, SlotView
from engine.text.tokenizer import Tokenizer
from engine.types import SHUTTING_DOWN, Failure, Fault, FinishReason, Output, Request
from observability.process import name_this_thread
from observability.profiler import GroupProfiler

log = logging.getLogger(__name__)

Sink = Callable[[list[Output]], None]
_WAKE = object()  # a parked request's history arrived (or gave up): look again


class PipelineGroup:
    def __init__(
        self,
        index: int,
        model: Model,
        tokenizer: Tokenizer,
        config: EngineConfig,
        slots: list[Slot],
        sink: Sink,
        publish_slot: Callable[[SlotView, bool], None],
        *,
        budget: PrefillBudget,
        draft_model: Model | None = None,
        n_kept: int = 0,
        on_kept: Callable[[int, list], None] | None = None,
    ) -> None:
        """``n_kept``: entries of the group's prompt cache; ``on_kept(group, tokens)`` hears
        what they hold whenever a save changes it (the scheduler routes by it)."""
        self.index = index
        self.model = model
        self.tok = tokenizer
        self.config = config
        self.slots = slots
        self._by_id = {s.id: s for s in slots}
        self.sink = sink
        self.publish_slot = publish_slot
        self.n_vocab = model.n_vocab
        self.runner = Runner(index, model, config, len(slots), draft_model, n_kept)
        self.on_kept = on_kept
        self.prefix = self.runner.prefix
        self.n_ctx_slot = self.runner.n_ctx_slot
        self.spec = config.speculative
        self.budget = budget  # chunked prefill's, shared by the engine's groups
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        # the slots' cells (the prompt cache's entries are counted apart)
        self.prof = GroupProfiler(index, kv_total=self.n_ctx_slot * len(slots), enabled_log=config.profile,
                                  cache=self.prefix.kept.stats() if self.prefix.kept else None)
        self.processor = OutputProcessor(index, tokenizer, self.runner, self.prof, config.sample_threads_per_group())
        self.active: list[Slot] = []
        # requests waiting for their history's state from another group (engine/cache/move.py),
        # with the time they stop waiting for it; their slots are theirs meanwhile
        self.parked: list[tuple[StartMsg, float]] = []
        # other groups' requests for a history's state: read between steps, once the copies
        # queued for the next decode (a save into the prompt cache) are made
        self.exports: list[ExportMsg] = []
        self.alive = True
        self.error: str | None = None
        # when the step in progress began, 0.0 between steps: a step stuck in native code
        # (decode, a sampler, a grammar mask) past the engine's step budget is seen by this
        self.step_since = 0.0
        # the decode in progress: its generating rows and prompt tokens, which the frozen-stage
        # watchdog prices with the cost model when it looks (deployments/watchdog.py)
        self.decode_rows = (0, 0)
        self._thread = threading.Thread(target=self._run, name=f"pgroup-{index}", daemon=True)
        self._cpu_clock: int | None = None

    @property
    def ctx(self):  # noqa: ANN201 - the runner's context, for diagnostics and tests
        return self.runner.ctx

    @property
    def decode_since(self) -> float:
        return self.runner.decode_since

    def thread_cpu_s(self) -> float | None:
        """CPU seconds the group's thread has run (None: not running): one blocked on a stage
        that does not answer does not advance it; one computing the local stage does."""
        try:
            if self._cpu_clock is None and self._thread.ident is not None:
                self._cpu_clock = time.pthread_getcpuclockid(self._thread.ident)
            return None if self._cpu_clock is None else time.clock_gettime(self._cpu_clock)
        except (OSError, AttributeError):  # the thread ended, or no per-thread clocks here
            return None

    # ---- lifecycle (any thread) -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self.inbox.put(StopMsg())
            self._thread.join(timeout)

    def close(self) -> None:
        """Free native state; only after ``stop``."""
        if self._thread.is_alive():
            raise RuntimeError("group thread still running")
        self.processor.close()
        for s in self.slots:
            if s.sampler is not None:
                s.sampler.close()
                s.sampler = None
        self.runner.close()

    # ---- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        name_this_thread(f"pgroup-{self.index}")
        if self.config.local_cpus:
            # pid 0 is this thread; ggml's compute threads, created from it, inherit the mask
            os.sched_setaffinity(0, self.config.local_cpus)
        try:
            while True:
                t0 = time.perf_counter()
                if not self.active:
                    try:
                        msg = self.inbox.get(timeout=self._park_timeout())
                    except queue.Empty:
                        msg = _WAKE
                    if not self._handle(msg):
                        return
                while True:
                    try:
                        msg = self.inbox.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(msg):
                        return
                if self.parked:
                    self._unpark()
                if self.exports and (not self.prefix.pending or not self.active):
                    self._export()
                self.prof.add("wait", time.perf_counter() - t0)
                if self.active:
                    self.step_since = time.monotonic()
                    self._step()
                    self.step_since = 0.0
                    if self.exports:
                        self._export()
        except BaseException as e:  # the group is dead: fail what it holds, never hang callers
            log.exception("pipeline group %d died", self.index)
            self.alive = False
            self.error = f"pipeline group {self.index} failed: {e}"
            outs = []
            for s in list(self.active):
                outs.append(self._finish(s, Fault.ENGINE, "", message=self.error, release=False))
            parked, self.parked = self.parked, []
            for m in self.exports:
                if m.reply.set_running_or_notify_cancel():
                    m.reply.set_result(None)
            for m, _ in parked:
                outs.append(self._never_started(m.request))
            self._drain_after_death(outs)

    def _drain_after_death(self, outs: list[Output]) -> None:
        if outs:
            self.sink(outs)
        # hand the slots back so that waiting requests come here and fail instead of hanging
        for s in self.slots:
            self.publish_slot(s.view(), True)
        while True:
            msg = self.inbox.get()
            if isinstance(msg, StopMsg):
                return
            if isinstance(msg, StartMsg):
                self.sink([self._never_started(msg.request)])
            elif isinstance(msg, SlotOpMsg):
                msg.reply.set_exception(RuntimeError(self.error))
            elif isinstance(msg, ExportMsg) and msg.reply.set_running_or_notify_cancel():
                msg.reply.set_result(None)

    def _never_started(self, r: Request) -> Failure:
        """A dead group's answer to a request it never started; its slot goes back."""
        self.publish_slot(self._by_id[r.slot_id].view(), True)
        return Failure(r.id, Fault.ENGINE, self.error or "", prompt_tokens=len(r.prompt_tokens))

    def _handle(self, msg: object) -> bool:
        if isinstance(msg, StartMsg):
            if msg.moved is not None and not msg.moved.done():
                # its history's state is on its way from another group: the other slots step on
                self.parked.append((msg, time.monotonic() + MOVE_WAIT_S))
                msg.moved.add_done_callback(lambda _: self.inbox.put(_WAKE))
            else:
                self._start(msg)
        elif isinstance(msg, ExportMsg):
            self.exports.append(msg)
        elif isinstance(msg, CancelMsg):
            self._unpark(msg.request_id)  # a parked request starts (without its history) to end
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
        elif isinstance(msg, StopMsg):
            self._unpark(everything=True)
            outs = [self._finish(s, Fault.SHUTDOWN, "", message=SHUTTING_DOWN, release=False)
                    for s in list(self.active)]
            if outs:
                self.sink(outs)
            return False
        return True

    # ---- a history another group holds (engine/cache/move.py) -------------------------------

    def _park_timeout(self) -> float | None:
        """How long an idle group waits for its inbox: until the first parked request stops
        waiting for its history; forever without one."""
        if not self.parked:
            return None
        return max(0.0, min(t for _, t in self.parked) - time.monotonic())

    def _unpark(self, request_id: str | None = None, *, everything: bool = False) -> None:
        """Start the parked requests whose history arrived, that waited long enough for it,
        or that must start now (``request_id``'s, or ``everything``)."""
        now = time.monotonic()
        due, waiting = [], []
        for m, t in self.parked:
            now_or_never = m.moved.done() or now >= t or everything or m.request.id == request_id
            (due if now_or_never else waiting).append((m, t))
        self.parked = waiting
        for m, _ in due:
            m.moved.cancel()  # a state not read yet is not worth reading any more
            self._start(m)

    def _export(self) -> None:
        """Other groups serve requests whose history this group holds: read the states."""
        exports, self.exports = self.exports, []
        for m in exports:
            if not m.reply.set_running_or_notify_cancel():
                continue  # that request stopped waiting for it
            try:
                m.reply.set_result(self.runner.export_history(self.slots, m.prompt, m.salt, self.config.move_min_tokens))
            except Exception as e:  # the other group evaluates the history itself
                log.exception("group %d: reading a history's state for another group failed", self.index)
                m.reply.set_exception(e)

    def _moved(self, m: StartMsg) -> Moved | None:
        f = m.moved
        if f is None or not f.done() or f.cancelled() or f.exception() is not None:
            return None
        return f.result()

    # ---- a request starts -------------------------------------------------------------------

    def _start(self, msg: StartMsg) -> None:
        try:
            self._begin(msg.request, self._moved(msg))
        except Exception as e:  # this request cannot start; the group goes on
            log.exception("group %d: request %s failed to start", self.index, msg.request.id)
            error = f"request failed to start: {e}"
            outs = []
            for m in msg.request.family:
                s = self._by_id[m.slot_id]
                if s.req is m and s in self.active:
                    outs.append(self._finish(s, Fault.INTERNAL, "", message=error))
                else:  # never started: its slot goes back as it was
                    outs.append(Failure(m.id, Fault.INTERNAL, error, prompt_tokens=len(m.prompt_tokens),
                                        t_end=time.monotonic() - m.t_arrival, slot=s.id))
                    self.publish_slot(s.view(), True)
            self.sink(outs)

    def _begin(self, r: Request, moved: Moved | None = None) -> None:
        n_saves = self._n_saves()
        if moved is not None and self.config.cache_prompt and r.cache_prompt:
            self.runner.take_history(self._by_id[r.slot_id], r, moved, self.slots)
        leader = self._begin_one(r)
        for f in r.followers:
            # its own sampler and text from now; its prompt's KV comes from the leader, and
            # its first token from the leader's logits
            self._begin_one(f, leader)
        self._publish_kept(n_saves)
        self._publish_load()  # a short prompt cuts the other groups' long chunks from their next step

    def _begin_one(self, r: Request, leader: Slot | None = None) -> Slot:
        s = self._by_id[r.slot_id]
        start = plan_start(s, r, self.slots, self.prefix, self.config.cache_prompt, leader)
        self.runner.begin(start, banned=self.tok.eog_tokens if r.params.ignore_eos else (), slots=self.slots)
        self.active.append(s)
        self.publish_slot(s.view(), False)
        return s

    # ---- a step -----------------------------------------------------------------------------

    def _step(self) -> None:
        """One step: plan, run, process, send; each part timed by the profiler."""
        prof, runner, budget = self.prof, self.runner, self.budget
        with prof.timed("draft"):
            drafts = self._drafts()
        with prof.timed("batch"):
            cfg = self.config
            n_rows = len(generating(self.active))
            n_prompts = len(prompting(self.active))
            allowed = budget.tokens(self.index, n_rows, runner.capacity, n_prompts) if n_prompts else None
            cut = budget.long_cut(self.index, n_short(self.active, cfg.prefill_long_tokens))
            plan = plan_step(self.active, drafts, runner.capacity, runner.n_ubatch, cfg.kv_unified,
                             allowed, cfg.prefill_long_tokens, cut, cfg.prefill_aging_steps,
                             cfg.checkpoint_every if self.prefix.checkpoints else 0)
            runner.fill(plan)
        n_prompt = plan.n_prompt
        budget.begin(self.index, n_prompt)
        self.decode_rows = (n_rows, n_prompt)
        t0 = time.perf_counter()
        try:
            # the thread's CPU time in decode: the local stage's compute when it runs on the CPU
            with prof.timed("decode"), prof.cpu("decode_cpu"):
                runner.decode(plan)
        except NativeError as e:
            budget.end(self.index)
            self._fail_batch([en.slot for en in plan.entries] + [m.slot for m in plan.media], str(e))
            if e.rc < 0:
                # a compute failure (e.g. the RPC stage went away): the context cannot be
                # trusted any more; the group stops and the engine reports itself unhealthy
                raise
            return
        with prof.timed("sync"):
            logits = runner.logits(plan)
        budget.observe(n_rows, n_prompt, time.perf_counter() - t0, self.index)
        plan.advance()
        got = self.processor.process(plan, logits)
        outs = got.outputs
        for s, end in got.endings:  # the group frees their slots
            outs.append(self._finish(s, end.reason, end.text, **end.figures))
        n_saves = self._n_saves()
        self._checkpoint_long_prompts(plan)
        for s in got.began:  # published once (/slots, the page)
            self.prefix.checkpoint(s, self.slots)
            self.publish_slot(s.view(), False)
        self._publish_kept(n_saves)
        self._publish_load()
        # the step's figures are published before its outputs leave, so whoever reads an output
        # finds the step that made it counted; the send's own time goes to the next snapshot
        prof.end_step(got.n_sampled, plan.n_tokens, len(self.active) + len(got.endings),
                      sum(len(s.cache_tokens) for s in self.slots), plan.n_ubatches, self.prefix.n_copied,
                      self.prefix.kept.stats() if self.prefix.kept else None, self.prefix.moves())
        with prof.timed("send"):
            if outs:
                self.sink(outs)

    def _checkpoint_long_prompts(self, plan: Plan) -> None:
        """A checkpoint of each prompt still on its way whose KV reached a multiple of
        ``checkpoint_every`` (the planner ends its chunks there): a state the model cannot go
        back to otherwise, so an edit after it recomputes from there."""
        every = self.config.checkpoint_every
        if not every or not self.prefix.checkpoints:
            return
        for en in plan.entries:
            s = en.slot
            if s.state is not SlotState.PROMPT or s.req is None:
                continue
            n = len(s.cache_tokens)
            if n % every == 0 and n > s.n_checkpointed and self.prefix.checkpoint(s, self.slots):
                s.n_checkpointed = n

    def _n_saves(self) -> int:
        return self.prefix.kept.n_saves if self.prefix.kept else 0

    def _publish_kept(self, n_saves: int) -> None:
        """What the prompt cache's entries hold, for the scheduler, when saves since ``n_saves``
        changed it."""
        if self.on_kept is not None and self._n_saves() != n_saves:
            self.on_kept(self.index, self.prefix.kept.views())

    def _publish_load(self) -> None:
        """What the other groups' chunked prefill reads of this one (engine/budget.py)."""
        self.budget.publish(self.index, len(generating(self.active)), len(prompting(self.active)),
                            n_short(self.active, self.config.prefill_long_tokens))

    def _drafts(self) -> dict[int, list[int]]:
        """This step's drafts (slot id -> tokens), when the group speculates this step."""
        if self.runner.drafter is None or self.config.backend_sampling:  # rows sampled in the graph give one token
            return {}
        rows = draft_requests(generating(self.active), self.spec, self.n_ctx_slot)
        return self.runner.draft(rows, self.spec.n_min)

    def _finish(
        self,
        s: Slot,
        reason: FinishReason | Fault,
        text: str,
        *,
        release: bool = True,
        **figures: object,
    ) -> Output:
        """End the request on slot ``s``: its final output; the slot is idle, its KV kept."""
        out = final_output(s, reason, text, **figures)
        self.runner.detach(s)
        s.finish()
        self.prefix.settle(s)
        if s in self.active:
            self.active.remove(s)
        self._publish_load()
        if release:
            self.publish_slot(s.view(), True)
        return out

    def _fail_batch(self, failed: list[Slot], err: str) -> None:
        log.error("group %d: decode failed: %s", self.index, err)
        outs = []
        for s in failed:
            self.prefix.drop(s)  # the sequence's KV is now unknown
            outs.append(self._finish(s, Fault.INTERNAL, "", message=f"decode failed: {err}"))
        self.sink(outs)

    # ---- slot operations (group thread) -----------------------------------------------------

    def _slot_op(self, m: SlotOpMsg) -> dict:
        s = self._by_id[m.slot_id]
        if s.state is not SlotState.IDLE:
            raise SlotBusyError(f"slot {s.id} is busy")
        pc = self.prefix
        if m.action == "restore" and pc.copying_from(s):
            raise SlotBusyError(f"slot {s.id} is being copied to another slot; retry")
        t0 = time.perf_counter()
        if m.action == "erase":
            res = {"id_slot": s.id, "n_erased": self.runner.erase_slot(s)}
        elif m.action == "save":
            n_bytes = self.runner.save_slot(s, m.path)
            res = {
                "id_slot": s.id,
                "filename": m.path.name,
                "n_saved": len(s.cache_tokens),
                "n_written": n_bytes,
            }
        elif m.action == "restore":
            if not m.path.is_file():
                raise FileNotFoundError(f"no saved slot file {m.path.name}")
            try:
                n_restored = self.runner.load_slot(s, m.path)
            except BaseException:
                # the slot's cache is gone: the scheduler must not choose it for its old prefix
                self.publish_slot(s.view(), False)
                raise
            res = {
                "id_slot": s.id,
                "filename": m.path.name,
                "n_restored": n_restored,
                "n_read": os.path.getsize(m.path),
            }
        else:
            raise ValueError(f"unknown slot action {m.action!r}")
        res["timings"] = {"ms": (time.perf_counter() - t0) * 1000.0}
        s.last_used = time.monotonic()
        self.publish_slot(s.view(), False)
        return res
