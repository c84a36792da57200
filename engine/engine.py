"""The engine: one model, N pipeline groups, one scheduler, one output sink.

``Engine(config, sink)`` loads the model once and creates ``pipeline_groups`` contexts from
it, partitioning the ``n_parallel`` slots contiguously (slot ``i`` is in group
``i // (n_parallel / N)`` and uses sequence ``i % (n_parallel / N)`` there). Requests are
validated and tokenised on the caller's thread; every output of a step goes to ``sink`` in
one call from the group thread that produced it. No Ray import here: the engine runs in a
plain Python process.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack
from pathlib import Path

from engine.budget import PrefillBudget
from engine.cache.prefix import sharing_on
from engine.cache.prompt_cache import n_entries_for
from engine.config import EngineConfig
from engine.embeddings import Embedder
from engine.group import PipelineGroup
from engine.media import MEDIA_SLOT, MediaSpan
from engine.messages import CancelMsg, ExportMsg, SlotBusyError, SlotOpMsg, StartMsg
from engine.native.devices import add_rpc_server
from engine.native.gguf_shape import read_shape
from engine.native.model import Model
from engine.native.projector import load_projector
from engine.outputs import Completion, OutputQueues
from engine.placement import default_devices, kv_per_device, layer_split
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.slots import Slot, SlotView
from engine.speculation.drafters import load_draft_model
from engine.speculation.mtp import require_mtp
from engine.text.matcher import GrammarCompiler, GrammarDeadEnd
from engine.text.stream import TextStream
from engine.text.tokenizer import Tokenizer, TokenLimit, prompt_tokens, server_limits
from engine.types import Decode, EngineRequest, Output, Request, RequestError

log = logging.getLogger(__name__)

__all__ = ["Engine", "SlotBusyError"]

THREAD_STACK = 64 << 20


class Engine:
    def __init__(self, config: EngineConfig, sink: Callable[[list[Output]], None] | None = None):
        # the threads this process starts from now (groups, their sampling pools, grammar
        # compilation) get room for llguidance's recursion along a grammar's rule chains; the
        # stacks are virtual memory, committed only as used
        if threading.stack_size() < THREAD_STACK:
            threading.stack_size(THREAD_STACK)
        self.config = config
        self.outputs = OutputQueues() if sink is None else None
        self.sink: Callable[[list[Output]], None] = sink or self.outputs.put  # type: ignore[union-attr]
        if not config.graph_reuse:
            # read by each llama_context when it is created
            os.environ["LLAMA_GRAPH_REUSE_DISABLE"] = "1"
        rpc_devices: list[str] = []
        for ep in config.rpc_endpoints:
            rpc_devices += add_rpc_server(ep)
        self.devices = default_devices(config, rpc_devices)
        # native handles are freed by construction: whatever fails below, what was created
        # before it goes, in reverse order (contexts before the models they were made from)
        mtp = config.speculative is not None and config.speculative.type == "mtp"
        with ExitStack() as built:
            self.model = Model(
                config.model,
                devices=self.devices,
                n_gpu_layers=config.n_gpu_layers,
                tensor_split=layer_split(config, self.devices),
                repack=config.repack,
                load_mtp=mtp,
                release_offloaded=config.release_offloaded_pages,
            )
            built.callback(self.model.close)
            log.info("model loaded in %.1f s on %s; %.0f MB of its pages released on this node (the layers "
                     "other devices hold)", self.model.load_s, self.devices, self.model.released_bytes / 1e6)
            if mtp:
                require_mtp(self.model)
            self.draft_model = None
            if config.speculative is not None and config.speculative.type == "draft":
                self.draft_model = load_draft_model(config.speculative, self.model)
                built.callback(self.draft_model.close)
            self.model_name = config.model_alias or Path(config.model).name
            self.tokenizer = Tokenizer(self.model, config.chat_template, config.chat_template_file)
            self.grammars = GrammarCompiler(self.tokenizer, budget_s=config.grammar_budget_s)
            built.callback(self.grammars.close)
            self.groups: list[PipelineGroup] = []
            per = config.n_slots_per_group
            self.slots = [Slot(id=i, group=i // per, seq_id=i % per) for i in range(config.n_parallel)]
            # the KV a token takes on each stage, and the prompt cache's entries (slot-sized)
            self.kv_per_token = kv_per_device(read_shape(config.model), self.model.layer_devices)
            self.entry_bytes = sum(self.kv_per_token.values()) * (config.n_ctx_per_group // per)
            self.n_kept = n_entries_for(config.prompt_cache_bytes, self.entry_bytes, config.pipeline_groups, per)
            self.scheduler = Scheduler(
                [s.view() for s in self.slots],
                dispatch=lambda g, r: self.groups[g].inbox.put(StartMsg(r)),
                cancel_running=lambda g, rid: self.groups[g].inbox.put(CancelMsg(rid)),
                sink=self._sink,
                max_queued=config.max_queued_requests,
                similarity=config.slot_prompt_similarity,
                share_prefix=sharing_on(config, self.model) or self.n_kept > 0,
                share_min=config.share_min_tokens,
                max_queued_per_slot=config.max_queued_per_slot,
                long_prompt=config.prefill_long_tokens,
                aging=config.queue_aging,
                move=self._move,
                move_min=config.move_min_tokens if config.cache_prompt else 0,
            )
            # chunked prefill: one budget for the groups, which share the stages
            self.prefill = PrefillBudget(config.pipeline_groups, config.prefill_gap_factor, config.prefill_min_rate,
                                         config.prefill_chunk_min, config.prefill_beside_short,
                                         burst_step_s=config.prefill_burst_step_s)
            for g in range(config.pipeline_groups):
                group = PipelineGroup(g, self.model, self.tokenizer, config, self.slots[g * per : (g + 1) * per],
                                      self._sink, self.scheduler.publish, draft_model=self.draft_model,
                                      budget=self.prefill, n_kept=self.n_kept, on_kept=self.scheduler.kept)
                built.callback(group.close)
                self.groups.append(group)
            self.embedder = (Embedder(self.model, config.n_ubatch, config.local_threads(), config.pooling,
                                      config.flash_attn) if config.embeddings else None)
            if self.embedder is not None:
                built.callback(self.embedder.close)
            self.projector = load_projector(config, self.model) if config.mmproj else None
            if self.projector is not None:
                built.callback(self.projector.close)
            self._free = built.pop_all()
        self.n_ctx_slot = self.groups[0].n_ctx_slot
        # what a prompt, and a text for /tokenize or /apply-template, may take: past it, refused
        # by its bytes where the vocabulary shows it (engine.tokenizer), never tokenised in full
        self.slot_limit, self.context_limit = server_limits(self.n_ctx_slot, config.n_parallel)
        self._closed = False
        for grp in self.groups:
            grp.start()
        log.info(
            "engine ready: %s, %d slots over %d group(s), %d tokens per slot, devices %s; prompt cache: "
            "%d entries per group (%.0f MiB of KV each)",
            self.model_name,
            config.n_parallel,
            config.pipeline_groups,
            self.n_ctx_slot,
            self.devices or "default",
            self.n_kept,
            self.entry_bytes / 2**20,
        )

    @property
    def modalities(self) -> dict[str, bool]:
        """What the model takes beside text (llama-server's /props ``modalities``)."""
        p = self.projector
        return {"vision": bool(p and p.vision), "audio": bool(p and p.audio), "video": False}

    def kv_bytes_per_token(self) -> dict[str, int]:
        """The KV bytes one cached token takes on each device (f16 KV): each stage keeps its
        own layers' part."""
        return self.kv_per_token

    def _move(self, source: int, group: int, r: Request) -> None:
        """Start ``r`` on ``group`` with its history's state read from group ``source``
        (engine/cache/move.py); the scheduler calls this under its lock: two puts, no wait."""
        state: Future = Future()
        self.groups[source].inbox.put(ExportMsg(r.prompt_tokens, r.cache_salt, state))
        self.groups[group].inbox.put(StartMsg(r, state))

    def _sink(self, outs: list[Output]) -> None:
        try:
            self.sink(outs)
        except Exception:  # a broken consumer must not kill a group thread
            log.exception("output sink failed")

    # ---- requests -----------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int], limit: TokenLimit | None = None) -> list[int]:
        """A prompt's tokens; ``limit`` (default: a slot's): ``TooLong`` past it (a 400)."""
        return prompt_tokens(self.tokenizer, prompt, limit or self.slot_limit)

    def make_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
        cache_prompt: bool = True, n: int = 1, id_slot: int = -1, n_resumed: int = 0,
        media: list[MediaSpan] | None = None, preserved: tuple[int, ...] = (), cache_salt: str = "",
    ) -> Request:
        """Validate and tokenise; raises ``RequestError`` for what cannot be served. With
        ``n`` > 1 the request leads ``n - 1`` followers (see ``Request.followers``), whose
        seeds follow its own so that every choice samples differently and reproducibly.
        ``n_resumed`` (with ``n`` 1): the prompt's last tokens are ones this request generated
        before (on a replica that failed it); its grammar and its text stream are advanced
        over them, so it goes on as if it had never stopped."""
        per_group = self.config.n_slots_per_group
        if not -1 <= id_slot < len(self.slots):
            raise RequestError(f"id_slot {id_slot} does not exist; slots are 0..{len(self.slots) - 1} (or -1: any)")
        if id_slot >= 0 and n > 1:  # several choices need several slots: the pin cannot hold (llama.vscode sends both)
            id_slot = -1
        if n > per_group:
            raise RequestError(f"n={n} needs {n} slots of one pipeline group; each group has {per_group} "
                               "(n_parallel / pipeline_groups)")
        # a prompt with media comes expanded (Projector.expand): its text ids checked, its rows' ids negative
        tokens = list(prompt) if media else self.tokenize_prompt(prompt)
        room = self.n_ctx_slot - len(tokens)
        if room < 1:
            raise RequestError(
                f"the prompt is {len(tokens)} tokens but a slot holds {self.n_ctx_slot} "
                "(n_ctx / n_parallel) with at least one generated token: shorten the prompt"
            )
        bad_bias = [t for t in params.logit_bias if t >= self.model.n_vocab]
        if bad_bias:
            raise RequestError(f"logit_bias token ids out of range: {bad_bias[:5]}")
        params = self._bounded(params)
        # compiled here, on the caller's thread (never a group's): a bad grammar is the request's 400
        grammar = self.grammars.compile(params.grammar) if params.grammar else None
        rid = request_id or uuid.uuid4().hex
        if n > 1 and params.seed is None:
            seed = self.config.seed if self.config.seed >= 0 else random.randrange(0, 2**32 - 1 - n)
            params = params.model_copy(update={"seed": seed})
        r = Request(id=rid, prompt_tokens=tokens, params=params, n_predict=min(params.max_tokens, room),
                    cache_prompt=cache_prompt, id_slot=id_slot, grammar=grammar, media=media or [],
                    preserved=frozenset(t for t in preserved if 0 <= t < self.model.n_vocab), cache_salt=cache_salt)
        if n_resumed:
            self._advance(r, tokens[len(tokens) - n_resumed:])
        for i in range(1, n):
            seed_i = (params.seed + i) % (2**32 - 1)
            r.followers.append(Request(id=f"{rid}#{i}", prompt_tokens=tokens, t_arrival=r.t_arrival,
                                       params=params.model_copy(update={"seed": seed_i}), n_predict=r.n_predict,
                                       cache_prompt=False, grammar=grammar.copy() if grammar else None,
                                       media=r.media, preserved=r.preserved, cache_salt=cache_salt))
        return r

    def accept(self, er: EngineRequest) -> Request:
        """The engine's request for one the ingress made (``make_request``'s checks: ids in the
        vocabulary, room in a slot, the grammar compiled here, on the caller's thread). Its
        media are encoded here too (engine.media: the projector, one encode at a time), never on
        a group's thread."""
        tokens, spans = er.prompt_tokens, []
        if er.media:
            if self.projector is None:
                raise RequestError("this model takes text only: it is served without a projector (mmproj)")
            bad = [t for t in tokens if t != MEDIA_SLOT and not 0 <= t < self.model.n_vocab]
            if bad:
                raise RequestError(f"prompt token ids out of range [0, {self.model.n_vocab}): {bad[:5]}")
            tokens, spans = self.projector.expand(tokens, er.media)
            wide = next((s.n for s in spans if not s.causal and s.n > self.config.n_ubatch), None)
            if wide is not None:
                raise RequestError(f"an image of {wide} rows attends to itself whole, past n_ubatch "
                                   f"{self.config.n_ubatch}: raise n_ubatch (and n_batch) or send a smaller image")
        return self.make_request(tokens, er.params, er.id, cache_prompt=er.cache_prompt, n=er.n,
                                 id_slot=er.id_slot, n_resumed=er.n_resumed, media=spans, preserved=er.preserved,
                                 cache_salt=er.cache_salt)

    def _advance(self, r: Request, generated: list[int]) -> None:
        """A resumed request's state after the tokens it generated before: its grammar has
        taken them, its text stream has read them (what it held back it holds again)."""
        if len(generated) >= len(r.prompt_tokens):
            raise RequestError("a resumed request needs its prompt before the tokens it generated")
        if r.grammar is not None:
            try:
                for t in generated:
                    r.grammar.accept(t)
            except GrammarDeadEnd as e:
                raise RequestError(f"the resumed output does not match the request's grammar: {e}") from None
        text = TextStream(r.params.stop)
        for t in generated:
            text.feed(self.tokenizer.piece(t, special=t in r.preserved))
        if text.stopped_by is not None:
            raise RequestError("the resumed output holds one of the request's stop strings")
        r.n_resumed, r.text = len(generated), text

    def _bounded(self, params: SamplingParams) -> SamplingParams:
        """Look-back windows at most the slot's context: the penalty and DRY samplers size their
        buffers by them, on the group thread where the group's other rows wait."""
        cap = self.n_ctx_slot
        update = {k: cap for k in ("repeat_last_n", "dry_penalty_last_n")
                  if getattr(params, k) < 0 or getattr(params, k) > cap}
        return params.model_copy(update=update) if update else params

    def embed(self, inputs: list[str | list[int]]) -> tuple[list, int]:
        """One normalised vector per input (text, or token ids), and the tokens they took;
        raises ``RequestError`` when embeddings are off or an input cannot be taken."""
        if self.embedder is None:
            raise RequestError("this server does not serve embeddings: set embeddings: true in its config")
        limit = TokenLimit(self.config.n_ubatch, f"an embedding takes at most {self.config.n_ubatch} (n_ubatch)")
        tokens = [self.tokenize_prompt(x, limit) for x in inputs]
        return self.embedder.embed(tokens), sum(len(t) for t in tokens)

    def submit(self, r: Request) -> None:
        """Queue a request; raises ``QueueFullError`` when its wait queue is full (the one for any
        slot, or its pinned slot's own)."""
        if self._closed:
            raise RuntimeError("engine is closed")
        if not all(g.alive for g in self.groups):
            raise RuntimeError("engine is unhealthy: " + "; ".join(g.error or "" for g in self.groups))
        self.scheduler.submit(r)

    def cancel(self, request_id: str) -> bool:
        return self.scheduler.cancel(request_id)

    # ---- convenience for plain Python use (sink=None) ------------------------------------------

    def stream(self, prompt: str | list[int], params: SamplingParams) -> Iterator[Output]:
        return self.stream_request(self.make_request(prompt, params))

    def complete(self, r: Request) -> Completion:
        """The whole answer of a request made already (``accept``, ``make_request``)."""
        parts, tokens, last = [], [], None
        for o in self.stream_request(r):
            parts.append(o.text)
            tokens.extend(o.tokens)
            last = o
        assert last is not None
        return Completion("".join(parts), last, tokens)

    def stream_request(self, r: Request) -> Iterator[Output]:
        if self.outputs is None:
            raise RuntimeError("stream() needs the engine's own output queues (sink=None)")
        q = self.outputs.register(r.id)
        try:
            self.submit(r)
            while True:
                o = q.get()
                yield o
                if o.finish_reason is not None:
                    return
        finally:
            if self.outputs.unregister(r.id):
                self.cancel(r.id)

    def generate(self, prompt: str | list[int], params: SamplingParams) -> Completion:
        return self.complete(self.make_request(prompt, params))

    def generate_n(self, prompt: str | list[int], params: SamplingParams, n: int) -> list[Completion]:
        """``n`` choices of one prompt, evaluated once (see ``Request.followers``)."""
        return self.complete_n(self.make_request(prompt, params, n=n))

    def complete_n(self, r: Request) -> list[Completion]:
        """Every choice of a request made already with ``n`` > 1."""
        if self.outputs is None:
            raise RuntimeError("generate_n() needs the engine's own output queues (sink=None)")
        qs = [self.outputs.register(m.id) for m in r.family]
        try:
            self.submit(r)
            out = []
            for q in qs:
                parts, tokens = [], []
                while True:
                    o = q.get()
                    parts.append(o.text)
                    tokens.extend(o.tokens)
                    if o.finish_reason is not None:
                        break
                out.append(Completion("".join(parts), o, tokens))
            return out
        finally:
            for m in r.family:
                if self.outputs.unregister(m.id):
                    self.cancel(m.id)

    # ---- slots ----------------------------------------------------------------------------------

    def slot_views(self) -> list[SlotView]:
        return self.scheduler.views()

    def slot_action(self, slot_id: int, action: str, filename: str | None, timeout: float = 60.0) -> dict:
        if not 0 <= slot_id < len(self.slots):
            raise RequestError(f"no slot {slot_id}; slots are 0..{len(self.slots) - 1}")
        if action not in ("save", "restore", "erase"):
            raise RequestError(f"unknown action {action!r}: use save, restore or erase")
        path = None
        if action != "erase":
            path = self.resolve_slot_file(filename)
        fut: Future = Future()
        self.groups[self.slots[slot_id].group].inbox.put(SlotOpMsg(action, slot_id, path, fut))
        try:
            return fut.result(timeout)
        except TimeoutError:
            if fut.cancel():  # not started: the group will skip it
                raise TimeoutError(
                    f"slot {slot_id}'s group did not take the {action} within {timeout:.0f} s; it was not done"
                ) from None
            return fut.result()  # started meanwhile: it finishes

    def resolve_slot_file(self, filename: str | None) -> Path:
        base = self.config.slot_save_path
        if not base:
            raise RequestError("slot save/restore is disabled: set slot_save_path")
        if not filename or not _is_plain_filename(filename):
            raise RequestError("filename must be a plain file name inside slot_save_path")
        root = Path(base).resolve()
        root.mkdir(parents=True, exist_ok=True)
        path = (root / filename).resolve()
        if path.parent != root:
            raise RequestError("filename must be a plain file name inside slot_save_path")
        return path

    # ---- state ----------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self.problem() is None

    def problem(self) -> str | None:
        """Why the engine cannot serve (None: it can): closed, a group dead, or a group's step
        stuck past ``step_budget_s`` (a thread in native code that does not return)."""
        if self._closed:
            return "the engine is closed"
        dead = [g.error or f"pipeline group {g.index} stopped" for g in self.groups if not g.alive]
        if dead:
            return "; ".join(dead)
        stuck = self.stuck_for()
        if stuck > self.config.step_budget_s:
            return (f"a pipeline group's step has not returned for {stuck:.0f} s (step_budget_s "
                    f"{self.config.step_budget_s:g}): a thread is stuck in native code")
        return None

    def stuck_for(self) -> float:
        """Seconds the longest step in progress has run (0.0 when none runs)."""
        now = time.monotonic()
        return max((now - g.step_since for g in self.groups if g.step_since), default=0.0)

    def profiles(self) -> list:
        return [g.prof.snapshot for g in self.groups]

    def stalled_for(self) -> float:
        """Seconds the longest decode in progress has run (0.0 when none runs)."""
        return max((d.seconds for d in self.decodes()), default=0.0)

    def decodes(self) -> list[Decode]:
        """The decodes in progress, one per group in a step: how long each has run, what the
        cost model expected of it, and its thread's CPU seconds (deployments/watchdog.py)."""
        now = time.monotonic()
        return [Decode(g.index, now - since, self.prefill.expected(*g.decode_rows), g.thread_cpu_s())
                for g in self.groups if (since := g.decode_since)]

    def close(self, timeout: float = 30.0) -> None:
        """Stop the groups (their requests end with a shutting-down error) and free the model.
        A group stuck in a decode that never returns keeps its native state: freeing it
        under a running call would crash; the process is about to go anyway."""
        if self._closed:
            return
        self._closed = True
        for g in self.groups:
            g.stop(timeout)
        stuck = [g.index for g in self.groups if g.running]
        if stuck:
            log.error("pipeline group(s) %s did not stop; their native state is left as it is", stuck)
            return
        self._free.close()  # the projector, the embedder, the groups, the grammars, the draft model, the model


def _is_plain_filename(name: str) -> bool:
    if name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        return False
    return len(name) <= 255 and not name.startswith(".")
