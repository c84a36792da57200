"""llama-server's own API: ``/completion`` and ``/infill`` (its answer and stream shapes),
``/tokenize``, ``/detokenize``, ``/apply-template``, ``/embedding``, ``/props`` and
``/slots``, with its field names and values."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from deployments.api import media
from deployments.api.base import (
    MAX_PROMPT_CHARS,
    Answer,
    ApiModel,
    Call,
    Generate,
    by_choice,
    openai_error,
    sse,
)
from deployments.api.chat_content import ChatMessage, template_messages
from deployments.api.embeddings import EmbeddingRequest, embed
from deployments.api.generation import prompt_progress, timings
from deployments.api.media import MediaBag
from deployments.api.openai import CompletionRequest
from deployments.api.values import Prepared
from engine.errors import RequestError
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
                bag.add(media.from_base64(b64, where, kind=None), where)  # image or audio, by its bytes
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
        from engine.text.infill import infill_tokens  # native: imported where a prompt is made

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


ROUTES = ()  # /props and /slots: deployments/api/server_info.py
