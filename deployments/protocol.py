"""The OpenAI-compatible request bodies and the response/error shapes the ingress sends."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.grammar import JSON_OBJECT_SCHEMA, GrammarSpec, check_source
from engine.params import SAMPLER_NAMES, SamplingParams
from engine.tools import (
    ToolCallStream,
    check_tools,
    chosen,
    limit_calls,
    parse_tool_calls,
    template_message,
)

MAX_PROMPT_CHARS = 1_000_000
MAX_JSON_DEPTH = 64  # objects and arrays inside each other in a request body


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as JSON, or ``ValueError`` with what is wrong: not JSON, not an object,
    nested deeper than ``MAX_JSON_DEPTH``, or holding text that is not Unicode (a lone
    surrogate escape such as ``"\\ud800"`` parses, but no answer that echoes it could be
    encoded)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ValueError(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            for text in (k, v):
                if isinstance(text, str) and not text.isascii():
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        raise ValueError("the body holds a lone surrogate (\\ud800-\\udfff escape) that is "
                                         "not text") from None
            if isinstance(v, dict | list):
                stack.append((v, depth + 1))
    return body


@dataclass(frozen=True)
class ToolSettings:
    """How the ingress reads a tools request's answer: the offered functions' names, and
    whether several calls are allowed."""

    names: tuple[str, ...]
    parallel: bool

    def read(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """``(content, calls)`` of a whole answer, the calls cut to one without parallel calls."""
        content, calls = parse_tool_calls(text, list(self.names))
        return content, limit_calls(calls, self.parallel)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(list(self.names), self.parallel)


@dataclass(frozen=True)
class Submitted:
    """What an engine replica tells the ingress of a request it took (the value that crosses
    Ray back from ``submit``)."""

    prompt_tokens: int
    n_predict: int
    replica: str
    conn: str  # the output stream the request's outputs come by
    n_ctx: int  # tokens per slot
    echo: str | None = None  # completions' echo: the prompt's text
    tools: ToolSettings | None = None
    reasoning: Any = None  # engine.reasoning.ReasoningPlan: how a chat answer's thinking is split


class ApiModel(BaseModel):
    """A request body read as llama-server and vLLM read theirs: a field it does not know is
    set aside (its name goes to the validation context's ``unknown`` list, for the ingress to
    log and count, or to refuse with ``strict_request_fields``), and ``null`` is the field's
    default, for every field."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _lenient(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data
        known = cls.model_fields
        unknown = [k for k in data if k not in known]
        if unknown and info.context is not None and "unknown" in info.context:
            info.context["unknown"].extend(f"{cls.__name__}.{k}" if info.context.get("qualified") else k
                                           for k in unknown)
        return {k: v for k, v in data.items() if v is not None and k in known}


def engine_request(req: Any) -> Any:
    """The request the engine runs: the Responses and Messages APIs' are served as chat."""
    to_chat = getattr(req, "to_chat", None)
    return to_chat() if to_chat is not None else req


def validate_body(model_cls: type[BaseModel], body: dict[str, Any], strict: bool = False) -> tuple[Any, list[str]]:
    """``body`` as ``model_cls``, and the names of the fields it ignored; ``strict``: those
    are a ``ValueError`` (OpenAI's 400) instead."""
    unknown: list[str] = []
    req = model_cls.model_validate(body, context={"unknown": unknown})
    if strict and unknown:
        raise ValueError(f"unknown fields {sorted(set(unknown))}: Extra inputs are not permitted "
                         "(strict_request_fields is on)")
    return req, unknown


def _sampling(name: str) -> Any:
    """An optional request field with the bounds and description of ``SamplingParams.<name>``."""
    f = SamplingParams.model_fields[name]
    bounds = {k: getattr(m, k) for m in f.metadata for k in ("ge", "gt", "le", "lt", "max_length")
              if getattr(m, k, None) is not None}
    return Field(default=None, description=f.description, **bounds)


# llama-server's one-letter sampler names (its `samplers` string)
SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                   "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill"}

SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repeat_penalty",
    "repeat_last_n", "min_keep", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "dry_multiplier",
    "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "dynatemp_range",
    "dynatemp_exponent", "mirostat", "mirostat_tau", "mirostat_eta", "samplers", "speculative",
)


class _Common(ApiModel):
    """Fields shared by completions and chat (unknown ones are ignored, see ``ApiModel``)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=-1, le=1_000_000, description="Most tokens to generate; -1 "
                                   "(llama-server) or absent: until the slot's context is full.")
    n: int = Field(default=1, ge=1, le=16, description="Choices of one prompt, evaluated once; at most the slots of "
                   "one pipeline group (n_parallel / pipeline_groups).")
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    # the sampling fields: their bounds and meaning are SamplingParams' (one definition)
    temperature: float | None = _sampling("temperature")
    top_p: float | None = _sampling("top_p")
    top_k: int | None = _sampling("top_k")
    min_p: float | None = _sampling("min_p")
    seed: int | None = _sampling("seed")
    presence_penalty: float | None = _sampling("presence_penalty")
    frequency_penalty: float | None = _sampling("frequency_penalty")
    repeat_penalty: float | None = _sampling("repeat_penalty")
    repeat_last_n: int | None = _sampling("repeat_last_n")
    min_keep: int | None = _sampling("min_keep")
    typical_p: float | None = _sampling("typical_p")
    top_n_sigma: float | None = _sampling("top_n_sigma")
    xtc_probability: float | None = _sampling("xtc_probability")
    xtc_threshold: float | None = _sampling("xtc_threshold")
    dry_multiplier: float | None = _sampling("dry_multiplier")
    dry_base: float | None = _sampling("dry_base")
    dry_allowed_length: int | None = _sampling("dry_allowed_length")
    dry_penalty_last_n: int | None = _sampling("dry_penalty_last_n")
    dry_sequence_breakers: list[str] | None = _sampling("dry_sequence_breakers")
    dynatemp_range: float | None = _sampling("dynatemp_range")
    dynatemp_exponent: float | None = _sampling("dynatemp_exponent")
    mirostat: int | None = _sampling("mirostat")
    mirostat_tau: float | None = _sampling("mirostat_tau")
    mirostat_eta: float | None = _sampling("mirostat_eta")
    samplers: list[str] | None = _sampling("samplers")
    speculative: bool | None = _sampling("speculative")
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    # structured output: OpenAI's response_format, llama-server's grammar and json_schema
    response_format: dict[str, Any] | None = None
    grammar: str | None = Field(default=None, description="GBNF the output must match (llama-server).")
    json_schema: dict[str, Any] | None = Field(default=None, description="A JSON schema the output must match (llama-server).")
    n_predict: int | None = Field(default=None, ge=-1, le=1_000_000, description="llama-server's max_tokens; -1: no limit.")
    n_probs: int | None = Field(default=None, ge=0, le=20, description="llama-server's logprobs: this many alternatives per token.")
    id_slot: int = Field(default=-1, ge=-1, description="llama-server's slot pinning: run on this slot, waiting until "
                         "it is free; -1: the scheduler picks (longest cached prefix).")
    typ_p: float | None = Field(default=None, gt=0.0, le=1.0, description="llama-server's name of typical_p.")
    cache_prompt: bool = Field(default=True, description="Reuse the slot's cached prefix for this request (llama-server).")
    t_max_predict_ms: int | None = Field(
        default=None, ge=0, description="llama-server's time limit of the generation, from the first token: past it, "
        "the output ends (finish_reason length) at its next newline.")
    timings_per_token: bool | None = Field(default=None, description="llama-server's; the timings come with the last "
                                           "chunk of a stream and with every answer.")
    # accepted as llama-server's clients send them, with nothing to change here
    return_progress: bool | None = Field(default=None, description="llama-server's: stream prompt_progress "
                                         "{total, cache, processed, time_ms} after each chunk of the prompt.")
    reasoning_format: Literal["none", "auto", "deepseek", "deepseek-legacy"] | None = Field(
        default=None, description="llama-server's: auto (the default) or deepseek put a reasoning model's thinking in "
        "reasoning_content; none leaves the text whole.")
    thinking_budget_tokens: int | None = Field(
        default=None, ge=-1, description="0: no thinking (the template's enable_thinking false), as llama-server's "
        "reasoning budget; -1 or more: unrestricted (a positive budget is not enforced).")
    n_keep: int | None = Field(default=None, ge=-1, description="llama-server's context-shift keep (accepted; a "
                               "prompt longer than the slot is refused, never shifted).")
    response_fields: list[str] | None = Field(default=None, max_length=64, description="llama-server's: only these "
                                              "fields of /completion's and /infill's answer ('a/b' takes b out of a).")
    post_sampling_probs: bool | None = Field(default=None, description="llama-server's: with n_probs, the "
                                             "probabilities after the sampler chain (prob, top_probs).")
    # accepted and ignored, as OpenAI's API defines them for what this server does not keep
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @field_validator("samplers", mode="before")
    @classmethod
    def _sampler_letters(cls, v: object) -> object:
        """llama-server's letter string (``"edkypmxt"``) or names; letters and names it does not
        know are skipped, as llama-server skips them."""
        if isinstance(v, str):
            return [SAMPLER_LETTERS[c] for c in v if c in SAMPLER_LETTERS]
        if isinstance(v, list):
            return [x for x in v if not isinstance(x, str) or x in SAMPLER_NAMES]
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    def grammar_spec(self) -> GrammarSpec | None:
        """The one grammar the request asks for, from whichever field it used, checked against
        the limits every grammar meets (``engine.grammar``)."""
        asked = [k for k in ("grammar", "json_schema") if getattr(self, k) is not None]
        rf = self.response_format
        kind = rf.get("type") if rf else None
        if kind not in (None, "text"):
            asked.append("response_format")
        if len(asked) > 1:
            raise ValueError(f"set one of grammar, json_schema and response_format, not {' and '.join(asked)}")
        if self.grammar is not None:
            spec = GrammarSpec("gbnf", self.grammar)
            check_source(spec)
            return spec
        if self.json_schema is not None:
            return GrammarSpec.of_schema(self.json_schema)
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return GrammarSpec.of_schema(JSON_OBJECT_SCHEMA)
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("response_format.json_schema must be an object with a 'schema'")
            return GrammarSpec.of_schema(spec.get("schema", {}), "response_format.json_schema.schema")
        raise ValueError(f"response_format type {kind!r} is not one of text, json_object, json_schema")

    def sampling(self, default_max_tokens: int, max_tokens: int | None = None) -> SamplingParams:
        limits = [v for v in (max_tokens, self.max_tokens) if v is not None]
        if 0 in limits:
            raise ValueError("max_tokens must be at least 1 (or -1: until the slot's context is full)")
        if self.n_predict is not None:
            limits.append(self.n_predict)  # llama-server's: 0 evaluates (and caches) the prompt only
        d: dict[str, Any] = {
            "max_tokens": next((v for v in limits if v >= 0), default_max_tokens),
            "stop": self.stop,
            "ignore_eos": self.ignore_eos,
            "grammar": self.grammar_spec(),
            "logprobs": self.n_logprobs(),
        }
        for k in SAMPLING_KEYS:
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.typ_p is not None and self.typical_p is None:
            d["typical_p"] = self.typ_p
        if self.t_max_predict_ms:
            d["t_max_predict_ms"] = self.t_max_predict_ms
        if self.return_progress and self.stream:
            d["return_progress"] = True
        if self.post_sampling_probs:
            d["post_sampling_probs"] = True
        if self.logit_bias:
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                try:
                    bias[int(k)] = v
                except ValueError:
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
            d["logit_bias"] = bias
        return SamplingParams(**d)

    def n_logprobs(self) -> int | None:
        """How many alternatives each token's log probability comes with; None: not asked."""
        return self.n_probs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20, description="Log probabilities of each token and this many alternatives.")
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (the prompt's log probabilities are not computed)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ValueError("only one prompt per request is supported")
            self.prompt = p[0]
        if isinstance(self.prompt, str) and len(self.prompt) > MAX_PROMPT_CHARS:
            raise ValueError(f"prompt longer than {MAX_PROMPT_CHARS} characters")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("the prompt is empty")
        return self

    def n_logprobs(self) -> int | None:
        return self.logprobs if self.logprobs is not None else self.n_probs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (with their tool calls and results)."""
    extra = ("tool_calls", "tool_call_id", "name")
    return [template_message({"role": m.role, "content": m.text(), **{k: getattr(m, k, None) for k in extra}})
            for m in messages]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=-1, le=1_000_000)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Extra variables for the chat template, e.g. {\"enable_thinking\": false}."
    )

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tools is not None or self.tool_choice is not None:
            mode, _ = chosen(check_tools(self.tools or []), self.tool_choice)
            if mode == "required" and (self.grammar_spec() is not None):
                raise ValueError("a required or named tool_choice cannot be combined with grammar, json_schema or "
                                 "response_format")
        self.template_messages()  # tool calls in the conversation are well formed
        total = sum(len(m.text()) for m in self.messages)
        if total > MAX_PROMPT_CHARS:
            raise ValueError(f"messages longer than {MAX_PROMPT_CHARS} characters")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    def template_kwargs(self) -> dict[str, Any] | None:
        """The template's variables: ``chat_template_kwargs``, and a thinking budget of 0 as
        ``enable_thinking: false``."""
        if self.thinking_budget_tokens == 0:
            return {**(self.chat_template_kwargs or {}), "enable_thinking": False}
        return self.chat_template_kwargs

    def n_logprobs(self) -> int | None:
        if self.logprobs:
            return self.top_logprobs or 0
        return self.n_probs


class ResponsesRequest(ApiModel):
    """``POST /v1/responses`` (OpenAI's Responses API): text in, text out, served as a chat
    request. Nothing is stored: ``previous_response_id`` and ``tools`` are refused."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float | None = _sampling("temperature")
    top_p: float | None = _sampling("top_p")
    stream: bool = False
    text: dict[str, Any] | None = Field(default=None, description='{"format": {"type": "text" | "json_object" | "json_schema", ...}}')
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = Field(default=None, description="Extra output to include (the OpenAI Agents SDK "
                                      "sends []); nothing beyond the text is produced, so entries are ignored.")
    # accepted and ignored, as for chat
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    _chat: ChatCompletionRequest | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id is not supported: responses are not stored; send the whole input")
        if self.tools:
            raise ValueError("tools are not supported on /v1/responses; use /v1/chat/completions")
        self._chat = self._chat_request()  # validated here, once; to_chat() hands it out
        return self

    def messages(self) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*msgs, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            if item.get("type", "message") != "message" or "role" not in item:
                raise ValueError(f"input[{i}]: only message items (role and content) are supported")
            content = item.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                        raise ValueError(f"input[{i}]: only text content parts are supported")
                    parts.append({"type": "text", "text": part["text"]})
                content = parts
            msgs.append({"role": item["role"], "content": content})
        return msgs

    def response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if not fmt or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_schema":
            return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
        return {"type": fmt.get("type")}

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this one is served as (built when the body was validated)."""
        return self._chat

    def _chat_request(self) -> ChatCompletionRequest:
        body: dict[str, Any] = {"messages": self.messages(), "stream": self.stream, "model": self.model,
                                "response_format": self.response_format()}
        for k, v in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature), ("top_p", self.top_p)):
            if v is not None:
                body[k] = v
        return ChatCompletionRequest.model_validate(body)


ApiRequest = ChatCompletionRequest | CompletionRequest  # what the ingress hands the engine, validated


class LogprobsShaper:
    """Token log probabilities in OpenAI's shapes, one request at a time (a stream keeps the
    completion text's offset across its chunks). Entries come from the engine as
    ``(piece, logprob, ((piece, logprob), ...))`` with pieces as bytes."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.offset = 0

    def shape(self, entries: list[tuple]) -> dict[str, Any]:
        if self.kind == "chat":
            return {"content": [
                {**_token(p, lp), "top_logprobs": [_token(tp, tlp) for tp, tlp in top]} for p, lp, top in entries
            ]}
        tokens, offsets = [], []
        for p, _lp, _top in entries:
            t = p.decode("utf-8", "replace")
            tokens.append(t)
            offsets.append(self.offset)
            self.offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _p, lp, _top in entries],
            "top_logprobs": [{tp.decode("utf-8", "replace"): tlp for tp, tlp in top} for _p, _lp, top in entries],
            "text_offset": offsets,
        }


def _token(piece: bytes, logprob: float) -> dict[str, Any]:
    return {"token": piece.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(piece)}


ERROR_TYPES = {  # OpenAI's error type of each status we answer with
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_supported_error",
    503: "server_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error")


@dataclass(frozen=True)
class ApiError:
    """An error answer as a value: what the engine returns across Ray for the ingress to send."""

    status: int
    message: str

    @property
    def type(self) -> str:
        return error_type(self.status)


def error_body(message: str, type_: str, code: int | str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def now() -> int:
    return int(time.time())


# ---- llama-server's own API ---------------------------------------------------------------------


class LlamaCompletionRequest(CompletionRequest):
    """``POST /completion``: llama-server's native completion (its field names; the answer and
    the stream in its shapes)."""

    return_tokens: bool = Field(default=False, description="Return the generated token ids too.")
    n_cmpl: int = Field(default=1, ge=1, le=16, description="llama-server's choices of one prompt: more than one "
                        "answers a list of completions (at most the slots of one pipeline group).")
    n_indent: int | None = Field(default=None, ge=0, description="llama-server's least indentation of infill lines "
                                 "(accepted; not applied).")
    backend_sampling: bool | None = Field(default=None, description="llama-server's per-request switch (accepted; "
                                          "the engine's backend_sampling decides).")

    @model_validator(mode="after")
    def _slot(self) -> LlamaCompletionRequest:
        if self.n != 1:
            raise ValueError("/completion answers one choice; use /v1/completions for n > 1, or n_cmpl")
        if self.n_cmpl > 1:
            if self.stream:
                raise ValueError("n_cmpl > 1 answers a list of completions, which is not streamed")
            self.n = self.n_cmpl
        return self


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


class EmbeddingRequest(ApiModel):
    """``POST /v1/embeddings`` (OpenAI's); llama-server's ``/embedding`` names the input ``content``."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    content: str | list[str] | list[int] | list[list[int]] | None = Field(default=None, description="llama-server's input.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, description="Must be the model's own (vectors are not cut).")
    user: str | None = None

    @model_validator(mode="after")
    def _one_input(self) -> EmbeddingRequest:
        if (self.input is None) == (self.content is None):
            raise ValueError("give the text to embed as input (or llama-server's content)")
        items = self.inputs()
        if not items or len(items) > 2048:
            raise ValueError("input holds 1 to 2048 texts or token lists")
        if sum(len(x) for x in items) > MAX_PROMPT_CHARS:
            raise ValueError(f"input longer than {MAX_PROMPT_CHARS} characters")
        return self

    def inputs(self) -> list[str | list[int]]:
        x = self.input if self.input is not None else self.content
        if isinstance(x, str) or (isinstance(x, list) and x and isinstance(x[0], int)):
            return [x]  # one text, or one list of token ids
        return list(x or [])


@dataclass(frozen=True)
class Embedded:
    """What the engine replica returns for an embedding request."""

    vectors: list  # numpy float32 arrays, one per input
    n_tokens: int


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


def prompt_progress(o: Any) -> dict[str, int]:
    processed, total, cached, ms = o.progress
    return {"total": total, "cache": cached, "processed": processed, "time_ms": ms}


def timings(o: Any) -> dict[str, Any]:
    """llama-server's ``timings`` of a request's final output (its web UI's statistics bar
    reads them): the prompt's evaluation from the slot's start to the first token, then the
    generation from the first token to the last."""
    prompt_n = o.prompt_tokens - o.cached_tokens
    prompt_ms = 1000.0 * max(o.t_first_token - o.t_queue, 0.0)
    gen_ms = 1000.0 * max(o.t_end - o.t_first_token, 0.0)
    n_gen = max(o.completion_tokens - 1, 0)  # the first token's time is the prompt's
    return {
        "cache_n": o.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000.0 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": o.completion_tokens,
        "predicted_ms": gen_ms,
        "predicted_per_token_ms": gen_ms / n_gen if n_gen else 0.0,
        "predicted_per_second": 1000.0 * n_gen / gen_ms if gen_ms > 0 and n_gen else 0.0,
    }


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


# ---- llama-server's utility endpoints ---------------------------------------------------------


class TokenizeRequest(ApiModel):
    """``POST /tokenize`` (llama-server)."""

    content: str = Field(max_length=MAX_PROMPT_CHARS)
    add_special: bool = Field(default=False, description="Add the model's BOS/EOS as a prompt would get them.")
    parse_special: bool = Field(default=True, description="Read special-token text (e.g. <start_of_turn>) as those tokens.")
    with_pieces: bool = Field(default=False, description="Return [{id, piece}] instead of ids.")


class DetokenizeRequest(ApiModel):
    """``POST /detokenize`` (llama-server)."""

    tokens: list[int] = Field(max_length=1_000_000)


class ApplyTemplateRequest(ApiModel):
    """``POST /apply-template`` (llama-server): the prompt the chat template makes of messages."""

    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


def piece_json(piece: bytes) -> str | list[int]:
    """A token's text as llama-server shows it: a string when it is valid UTF-8, else its bytes."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)
