"""llama-server's own API: ``/completion`` and ``/infill`` (its answer and stream shapes),
``/tokenize``, ``/detokenize``, ``/apply-template``, ``/embedding``, ``/props`` and
``/slots``, with its field names and values."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, model_validator

from deployments.api import media
from deployments.api.base import (
    MAX_PROMPT_CHARS,
    Answer,
    ApiError,
    ApiModel,
    Call,
    Generate,
    by_choice,
    openai_error,
    read_request,
    sse,
)
from deployments.api.embeddings import EmbeddingRequest, embed
from deployments.api.generation import prompt_progress, timings
from deployments.api.media import MediaBag
from deployments.api.openai import ChatMessage, CompletionRequest, template_messages
from deployments.api.values import Prepared
from engine.errors import RequestError
from engine.params import SamplingParams
from engine.types import Output

if TYPE_CHECKING:
    from engine.engine import Engine


class LlamaCompletionRequest(CompletionRequest):
    """``POST /completion``: llama-server's native completion (its field names; the answer and
    the stream in its shapes)."""

    return_tokens: bool = Field(default=False, description="Return the generated token ids too.")
    n_cmpl: int = Field(default=1, ge=1, le=16, description="llama-server's choices of one prompt: more than one "
                        "answers a list of completions (at most the slots of one pipeline group).")
    n_indent: int | None = Field(default=None, ge=0, description="llama-server's least indentation of infill lines "
                                 "(accepted; not applied).")

    @model_validator(mode="wrap")
    @classmethod
    def _multimodal(cls, data: Any, handler: Any) -> Any:
        """llama-server's multimodal prompt, ``{"prompt_string": "... <__media__> ...",
        "multimodal_data": [base64, ...]}``: the string is the prompt, the data its media."""
        bag = MediaBag()
        if isinstance(data, dict) and isinstance(data.get("prompt"), dict):
            p = data["prompt"]
            items = p.get("multimodal_data") or []
            if not isinstance(items, list):
                raise ValueError("prompt.multimodal_data must be a list of base64 strings")
            for i, b64 in enumerate(items):
                where = f"prompt.multimodal_data[{i}]"
                kind = "audio" if media.sniff_b64(b64) in media.AUDIO_TYPES else "image"
                bag.add(media.from_base64(b64, where, kind), where)
            data = {**data, "prompt": p.get("prompt_string", "")}
        req = handler(data)
        req._media = tuple(bag.items)
        return req

    @model_validator(mode="after")
    def _slot(self) -> LlamaCompletionRequest:
        if self.n != 1:
            raise ValueError("/completion answers one choice; use /v1/completions for n > 1, or n_cmpl")
        if self.n_cmpl > 1:
            if self.stream:
                raise ValueError("n_cmpl > 1 answers a list of completions, which is not streamed")
            self.n = self.n_cmpl
        return self

    def prepare(self, engine: Engine, request_id: str) -> Prepared:
        most = engine.config.n_slots_per_group
        if self.n_cmpl > most:  # llama-server's words: llama.vscode reads them and asks for fewer
            raise RequestError(f"Field 'n_cmpl': Value must be between 1 and {most} (the slots of one pipeline group)")
        return super().prepare(engine, request_id)


class InfillChunk(ApiModel):
    """One extra context chunk of an infill request (another file, or part of one)."""

    text: str = ""
    filename: str = Field(default="", max_length=4096)
    time: float | None = Field(default=None, description="llama.vscode's (when the chunk was taken; accepted).")


class InfillRequest(LlamaCompletionRequest):
    """``POST /infill``: llama-server's fill-in-the-middle, from the model's FIM tokens; the
    answer as ``/completion``'s."""

    prompt: str = Field(default="", description="Text the middle starts with (after the prefix).")
    input_prefix: str = Field(default="", description="The code before the cursor.")
    input_suffix: str = Field(default="", description="The code after the cursor.")
    input_extra: list[InfillChunk] = Field(default_factory=list, max_length=1024,
                                           description="Extra context chunks [{text, filename}], most relevant last.")
    t_max_prompt_ms: int | None = Field(default=None, description="llama.vscode's (accepted; the prompt is not cut by time).")

    @model_validator(mode="after")
    def _size(self) -> InfillRequest:
        total = len(self.prompt) + len(self.input_prefix) + len(self.input_suffix) + sum(
            len(c.text) + len(c.filename) for c in self.input_extra)
        if total > MAX_PROMPT_CHARS:
            raise ValueError(f"prefix, suffix, prompt and extra chunks are longer than {MAX_PROMPT_CHARS} characters")
        return self

    def extra(self) -> list[tuple[str, str]]:
        return [(c.filename, c.text) for c in self.input_extra]

    def engine_prompt(self, engine: Engine) -> list[int]:
        from engine.infill import infill_tokens  # native: imported where a prompt is made

        asked = max(self.n_predict or 0, self.max_tokens or 0, 0)
        return infill_tokens(engine.tokenizer, self.input_prefix, self.input_suffix, self.prompt, self.extra(),
                             engine.config.n_batch, engine.n_ctx_slot, asked)


# ---- the answers ---------------------------------------------------------------------------------


def completion_probabilities(o: Any, post: bool = False) -> list[dict[str, Any]]:
    """llama-server's ``completion_probabilities`` of one output's tokens (``n_probs``): each
    token's id, text, bytes and log probability, and its most likely alternatives; ``post``
    (``post_sampling_probs``): probabilities (``prob``, ``top_probs``) after the sampler chain."""
    if not o.logprobs:
        return []
    key, top_key = ("prob", "top_probs") if post else ("logprob", "top_logprobs")

    def entry(piece: bytes, logprob: float) -> dict[str, Any]:
        v = math.exp(logprob) if post else logprob
        return {"token": piece.decode("utf-8", "replace"), "bytes": list(piece), key: v}

    out = []
    for i, (piece, lp, top) in enumerate(o.logprobs):
        e = {"id": o.tokens[i]} if i < len(o.tokens) else {}
        out.append({**e, **entry(piece, lp), top_key: [entry(p, v) for p, v in top]})
    return out


def pick_fields(body: dict[str, Any], fields: list[str] | None) -> dict[str, Any]:
    """llama-server's ``response_fields``: only the named fields; ``a/b`` is ``body[a][b]`` at the
    top as ``b``; a field that is not there is left out."""
    if not fields:
        return body
    out: dict[str, Any] = {}
    for f in fields:
        node: Any = body
        for part in f.split("/"):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            out[f.rsplit("/", 1)[-1]] = node
    return out


_MISSING = object()


def llama_final(o: Any, content: str, model: str, tokens: list[int] | None, n_ctx: int = 0) -> dict[str, Any]:
    """llama-server's last /completion object (``stop: true``) for a request's final output."""
    if o.finish_reason == "length":
        stop_type = "limit"
    elif o.stop_word is not None:
        stop_type = "word"
    else:
        stop_type = "eos"
    out: dict[str, Any] = {
        "content": content,
        "stop": True,
        "model": model,
        "tokens_predicted": o.completion_tokens,
        "tokens_evaluated": o.prompt_tokens,
        "tokens_cached": o.cached_tokens,
        "stop_type": stop_type,
        "stopping_word": o.stop_word or "",
        "id_slot": o.slot,
        "truncated": False,
        "timings": timings(o),
        "generation_settings": {"n_ctx": n_ctx},  # the slot's context (llama.vscode's status bar)
    }
    if tokens is not None:
        out["tokens"] = tokens
    return out


class LlamaShaper:
    """llama-server's answer: one object, or with ``n_cmpl`` > 1 a list, one per choice; its
    stream: ``{"content", "stop": false}`` events, then the final object with ``stop: true``
    (no ``[DONE]``, as llama-server)."""

    def __init__(self, a: Answer) -> None:
        req = a.run
        self.model, self.n, self.n_ctx = a.model, req.n, a.submitted.n_ctx
        self.want_tokens, self.fields, self.post = bool(req.return_tokens), req.response_fields, bool(req.post_sampling_probs)
        self.parts: list[list[str]] = [[] for _ in range(self.n)]
        self.tokens: list[list[int]] = [[] for _ in range(self.n)]
        self.probs: list[list[dict]] = [[] for _ in range(self.n)]
        self.lasts: list[Output | None] = [None] * self.n

    def add(self, batch: list[Output]) -> None:
        for i, outs in by_choice(batch).items():
            for o in outs:
                self.parts[i].append(o.text)
                self.tokens[i].extend(o.tokens)
                self.probs[i].extend(completion_probabilities(o, self.post))
            self.lasts[i] = outs[-1]

    def _final(self, i: int) -> dict[str, Any]:
        last = self.lasts[i]
        body = llama_final(last, "".join(self.parts[i]), self.model, self.tokens[i] if self.want_tokens else None,
                           self.n_ctx)
        if self.probs[i]:
            body["completion_probabilities"] = self.probs[i]
        return pick_fields(body, self.fields)

    def final(self) -> Any:
        bodies = [self._final(i) for i in range(self.n)]
        return bodies if self.n > 1 else bodies[0]

    # ---- the stream (one choice) --------------------------------------------------------------

    def opening(self) -> bytes:
        return b""

    def events(self, batch: list[Output]) -> bytes:
        last = batch[-1]
        if last.finish_reason is not None:  # the final object carries this batch: closing() sends it
            self.parts[0], self.tokens[0], self.probs[0], self.lasts[0] = [], [], [], None
            self.add(batch)
            return b""
        event: dict[str, Any] = {"content": "".join(o.text for o in batch), "stop": False}
        progress = [o for o in batch if o.progress is not None]
        if progress:
            event["prompt_progress"] = prompt_progress(progress[-1])
        if self.want_tokens:
            event["tokens"] = [t for o in batch for t in o.tokens]
        probs = [p for o in batch for p in completion_probabilities(o, self.post)]
        if probs:
            event["completion_probabilities"] = probs
        return sse(event)

    def closing(self) -> bytes:
        return sse(self._final(0))

    def failed(self, status: int, message: str) -> bytes:
        return sse(openai_error(status, message))


LLAMA = Generate(("/completion",), LlamaCompletionRequest, "cmpl-", LlamaShaper, summary="llama-server's completion")
INFILL = Generate(("/infill",), InfillRequest, "cmpl-", LlamaShaper,
                  summary="llama-server's fill-in-the-middle, from the model's FIM tokens")


# ---- the utility endpoints (each runs in the ingress, on its prompt threads) ----------------------


def piece_json(piece: bytes) -> str | list[int]:
    """A token's text as llama-server shows it: a string when it is valid UTF-8, else its bytes."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


class TokenizeRequest(ApiModel):
    """``POST /tokenize`` (llama-server)."""

    content: str = Field(max_length=MAX_PROMPT_CHARS)
    add_special: bool = Field(default=False, description="Add the model's BOS/EOS as a prompt would get them.")
    parse_special: bool = Field(default=True, description="Read special-token text (e.g. <start_of_turn>) as those tokens.")
    with_pieces: bool = Field(default=False, description="Return [{id, piece}] instead of ids.")

    def run(self, engine: Engine) -> dict[str, Any]:
        """The tokens of a text the server's whole context could hold (past it, a 400 from its
        bytes alone where they show it)."""
        toks = engine.tokenizer.encode(self.content, add_special=self.add_special, parse_special=self.parse_special,
                                       limit=engine.context_limit)
        if not self.with_pieces:
            return {"tokens": toks}
        return {"tokens": [{"id": t, "piece": piece_json(engine.tokenizer.piece(t))} for t in toks]}


class DetokenizeRequest(ApiModel):
    """``POST /detokenize`` (llama-server)."""

    tokens: list[int] = Field(max_length=1_000_000)

    def run(self, engine: Engine) -> dict[str, Any]:
        limit = engine.context_limit  # the text of more could be far larger than the body
        if len(self.tokens) > limit.n_tokens:
            raise RequestError(f"{len(self.tokens)} tokens but {limit.what}: detokenize fewer at a time")
        bad = [t for t in self.tokens if not 0 <= t < engine.model.n_vocab]
        if bad:
            raise RequestError(f"token ids out of range [0, {engine.model.n_vocab}): {bad[:5]}")
        return {"content": engine.tokenizer.decode(self.tokens)}


class ApplyTemplateRequest(ApiModel):
    """``POST /apply-template`` (llama-server): the prompt the chat template makes of messages."""

    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ApplyTemplateRequest:
        self.template_messages()  # tool calls in the conversation are well formed
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    def run(self, engine: Engine) -> dict[str, Any]:
        return {"prompt": engine.tokenizer.apply_chat_template(self.template_messages(),
                                                               kwargs=self.chat_template_kwargs,
                                                               limit=engine.context_limit)}


TOKENIZE = Call(("/tokenize",), TokenizeRequest, summary="llama-server's tokenizer")
DETOKENIZE = Call(("/detokenize",), DetokenizeRequest, summary="llama-server's detokenizer")
APPLY_TEMPLATE = Call(("/apply-template",), ApplyTemplateRequest,
                      summary="llama-server's: the prompt the chat template makes of messages")
EMBEDDING = Call(("/embedding",), EmbeddingRequest, call=embed,
                 answer=lambda res, _req, _model: [{"index": i, "embedding": [v.tolist()]} for i, v in enumerate(res.vectors)],
                 summary="llama-server's embeddings: [{index, embedding: [vector]}]")

ENDPOINTS = (LLAMA, INFILL, TOKENIZE, DETOKENIZE, APPLY_TEMPLATE, EMBEDDING)


# ---- state: props and slots ----------------------------------------------------------------------


def llama_props(tok: Any, report: dict) -> dict:
    """llama-server's ``/props`` of an engine replica (``report``: its ``props()``; ``tok``: the
    model's tokenizer, the ingress's), with every field its web UI, Zed and SillyTavern read,
    and this server's own (groups, devices, topology)."""
    config, n_ctx_slot = report["config"], report["n_ctx_slot"]
    return {
        "default_generation_settings": {
            "id": 0, "id_task": -1, "n_ctx": n_ctx_slot, "is_processing": False,
            "speculative": config.speculative is not None, "params": llama_params(n_ctx_slot, config),
        },
        "total_slots": config.n_parallel,
        "model_alias": report["model_name"],
        "model_path": config.model,
        "modalities": report.get("modalities") or {"vision": False, "audio": False, "video": False},
        "media_marker": media.MEDIA_MARKER,  # where /completion's multimodal_data go in its prompt
        "endpoint_slots": True, "endpoint_props": True, "endpoint_metrics": True,
        "chat_template": tok.template.source,
        "chat_template_caps": {
            # what this server does with the template: tools are served for every template (in
            # it when it takes them, else in a system message), calls are parsed from the text
            "supports_tools": True, "supports_tool_calls": True, "supports_parallel_tool_calls": True,
            "supports_system_role": True, "supports_preserve_reasoning": False, "requires_typed_content": False,
            "supports_string_content": True, "supports_typed_content": False,
        },
        "chat_template_origin": tok.template.origin,
        "bos_token": tok.bos_text,
        "eos_token": tok.eos_text,
        "build_info": f"pipeline-groups {_version()} (llama-cpp-python {_llama_cpp_version()})",
        "is_sleeping": False,
        "pipeline_groups": config.pipeline_groups,
        "devices": report["devices"],
        "topology": report["topology"],
    }


def llama_params(n_ctx_slot: int, config: Any) -> dict[str, Any]:
    """The default sampling settings in llama-server's names and types (its web UI syncs its
    settings from these: every value a number, ``samplers`` a list of names)."""
    d = SamplingParams(max_tokens=n_ctx_slot)
    spec = config.speculative
    return {
        "seed": config.seed if config.seed >= 0 else 4294967295,  # llama-server's random seed
        "temperature": d.temperature, "dynatemp_range": d.dynatemp_range, "dynatemp_exponent": d.dynatemp_exponent,
        "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p, "top_n_sigma": d.top_n_sigma,
        "xtc_probability": d.xtc_probability, "xtc_threshold": d.xtc_threshold,
        "typical_p": d.typical_p, "typ_p": d.typical_p,  # the web UI looks for typ_p
        "repeat_last_n": d.repeat_last_n, "repeat_penalty": d.repeat_penalty,
        "presence_penalty": d.presence_penalty, "frequency_penalty": d.frequency_penalty,
        "dry_multiplier": d.dry_multiplier, "dry_base": d.dry_base, "dry_allowed_length": d.dry_allowed_length,
        "dry_penalty_last_n": d.dry_penalty_last_n, "dry_sequence_breakers": list(d.dry_sequence_breakers),
        "mirostat": d.mirostat, "mirostat_tau": d.mirostat_tau, "mirostat_eta": d.mirostat_eta,
        "max_tokens": -1, "n_predict": -1, "n_keep": 0, "n_discard": 0, "ignore_eos": False, "stream": True,
        "n_probs": 0, "min_keep": d.min_keep, "samplers": list(d.order), "reasoning_format": "auto",
        "speculative.n_max": spec.n_max if spec else 0, "speculative.n_min": spec.n_min if spec else 0,
        "speculative.p_min": spec.p_min if spec else 0.0, "timings_per_token": False,
        "post_sampling_probs": False, "backend_sampling": config.backend_sampling, "lora": [],
    }


def llama_slots(report: dict) -> list[dict]:
    """llama-server's ``/slots`` rows of an engine replica (``report``: its ``slots()``), each
    with its group and replica."""
    return [
        {
            "id": v["id"],
            "n_ctx": report["n_ctx_slot"],  # llama.cpp's web UI sizes its context by it
            "speculative": report["speculative"],
            "is_processing": v["state"] != "idle",
            "group": v["group"],
            "seq_id": v["seq_id"],
            "state": v["state"],
            "n_cached_tokens": v["n_cached"],
            "id_task": v["request_id"],
            "replica": report["replica"],
        }
        for v in report["slots"]
    ]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pipeline-groups-serve")
    except PackageNotFoundError:
        return "0"


def _llama_cpp_version() -> str:
    import llama_cpp

    return str(getattr(llama_cpp, "__version__", "?"))



async def props(ing: Any, request: Request) -> Response:
    report = await ing.engine.props.remote()
    return JSONResponse(llama_props((await ing.client.maker()).tokenizer, report))


async def slots(ing: Any, request: Request) -> Response:
    """Every engine replica's slots (each names its replica)."""
    parts = await ing.each_replica(lambda engine, replica: engine.slots.remote(replica=replica))
    return JSONResponse([s for part in parts for s in llama_slots(part)])


class SlotFile(ApiModel):
    """The body of ``POST /slots/{id}?action=save|restore``."""

    filename: str | None = Field(default=None, max_length=255)


async def slot_action(ing: Any, request: Request) -> Response:
    """``?action=save|restore|erase``; ``?replica=`` (from /slots) picks the engine replica, needed
    when there are several."""
    try:
        slot_id = int(request.path_params["slot_id"])
    except ValueError:
        raise ApiError(400, "the slot id must be an integer", "slot_id") from None
    action, replica = request.query_params.get("action", ""), request.query_params.get("replica")
    if replica is None and len(ing.streams) > 1:
        raise ApiError(400, f"{len(ing.streams)} engine replicas: add ?replica=<id> (see /slots)", "replica")
    body = await ing.body_json(request)
    req, _ = read_request(SlotFile, body or {})
    return ing.answer_of(await ing.engine.slot_action.remote(slot_id, action, req.filename, replica=replica))


ROUTES = (("GET", ("/props",), props), ("GET", ("/slots",), slots), ("POST", ("/slots/{slot_id}",), slot_action))

