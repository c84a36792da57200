"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): the request
served as a chat request, the answer and its typed event stream in Anthropic's shapes.

Text, a system prompt, tools (``tool_use`` blocks out, ``tool_result`` blocks back in) and
``tool_choice`` map onto the chat request; images and documents are refused with a 400 that
says so; ``thinking`` and cache-control hints are accepted and change nothing.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from pydantic import Field, PrivateAttr, model_validator

from deployments.api.base import Answer, ApiModel, Call, Generate, sse
from deployments.api.openai import ChatCompletionRequest, chat_prompt
from engine.text.answer import AnswerReader, harmony_only, read_answer
from engine.text.call_args import CallPart
from engine.types import Output

if TYPE_CHECKING:
    from engine.engine import Engine

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 504: "api_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _text_of(content: Any, where: str) -> str:
    """The text of a ``tool_result``'s or a system prompt's content: a string or text blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{where}: the content must be a string or a list of text blocks")
    parts = []
    for b in content:
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise ValueError(f"{where}: only text blocks are supported here")
        parts.append(b["text"])
    return "".join(parts)


class MessagesRequest(ApiModel):
    """``POST /v1/messages``."""

    model: str | None = None
    max_tokens: int = Field(ge=1, le=1_000_000)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, description="vLLM's: the prompt "
                                   "reuses cached KV only of requests with the same salt (a tenant's own; docs/security.md).")
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = Field(
        default=None, description='Structured outputs: {"format": {"type": "json_schema", "schema": {...}}} (what '
        "the SDK's messages.parse sends); the answer's text matches the schema, as OpenAI's response_format.")
    output_format: dict[str, Any] | None = Field(default=None, description="The older SDKs' top-level form of "
                                                 "output_config.format.")
    # accepted; nothing here changes with them
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    _chat: ChatCompletionRequest | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _as_chat(self) -> MessagesRequest:
        self._chat = ChatCompletionRequest.model_validate(self.chat_body())
        return self

    def to_chat(self) -> ChatCompletionRequest:
        return self._chat

    served_as = to_chat

    def chat_body(self, max_tokens: int | None = None) -> dict[str, Any]:
        msgs: list[dict[str, Any]] = []
        if self.system:
            msgs.append({"role": "system", "content": _text_of(self.system, "system")})
        for i, m in enumerate(self.messages):
            msgs.extend(_chat_messages(i, m))
        body: dict[str, Any] = {"messages": msgs, "max_tokens": max_tokens or self.max_tokens, "stream": self.stream,
                                "model": self.model}
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        for k in ("temperature", "top_p", "top_k"):
            if getattr(self, k) is not None:
                body[k] = getattr(self, k)
        if self.tools:
            body["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        fmt = self._output_format()
        if fmt is not None:  # the schema goes the one path every schema goes (engine.text.grammar)
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt}}
        if self.tool_choice:
            kind = self.tool_choice.get("type")
            choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
            if kind == "tool":
                choice = {"type": "function", "function": {"name": self.tool_choice.get("name")}}
            if choice is None:
                raise ValueError(f"tool_choice type {kind!r} is not one of auto, any, tool, none")
            body["tool_choice"] = choice
            if self.tool_choice.get("disable_parallel_tool_use"):
                body["parallel_tool_calls"] = False
        return body


    def _output_format(self) -> dict[str, Any] | None:
        fmt = (self.output_config or {}).get("format")
        if fmt is not None and self.output_format is not None:
            raise ValueError("give output_config.format or output_format, not both")
        fmt = fmt if fmt is not None else self.output_format
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise ValueError('output_config.format must be {"type": "json_schema", "schema": {...}}')
        return fmt["schema"]


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: the same body, without ``max_tokens``."""

    max_tokens: int = Field(default=1, ge=1, le=1_000_000)

    def run(self, engine: Engine) -> dict[str, int]:
        """The prompt tokens the chat request would have (in the ingress); a prompt no
        slot can hold is refused as the request itself would be, without tokenising it in full."""
        prompt, _, _ = chat_prompt(engine.tokenizer, self.to_chat(), engine.n_ctx_slot, engine.slot_limit)
        return {"input_tokens": len(engine.tokenize_prompt(prompt))}


def _chat_tool(i: int, t: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise ValueError(f"tools[{i}]: a tool needs a name (server tools such as web search are not supported)")
    fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
    if t.get("description"):
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _chat_messages(i: int, m: dict[str, Any]) -> list[dict[str, Any]]:
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise ValueError(f"messages[{i}].role must be user or assistant")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content must be a string or a list of content blocks")
    out: list[dict[str, Any]] = []
    text: list[Any] = []  # strings, and image parts (dicts) in their place
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text":
            text.append(str(b.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": str(b.get("id") or "toolu_" + uuid.uuid4().hex[:24]), "type": "function",
                          "function": {"name": str(b.get("name", "")), "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            result = _text_of(b.get("content"), where)
            out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                        "content": ("Error: " + result) if b.get("is_error") else result})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # a reasoning trace of an earlier turn: not part of the prompt here
        elif kind == "image" and role == "user":
            src = b.get("source")
            if not isinstance(src, dict) or src.get("type") != "base64":
                raise ValueError(f"{where}: an image block's source must be {{type: base64, media_type, data}} "
                                 "(URLs are not fetched)")
            text.append({"type": "image_url",  # checked where the chat request is (deployments/api/media.py)
                         "image_url": {"url": f"data:{src.get('media_type') or ''};base64,{src.get('data') or ''}"}})
        elif kind in ("image", "document"):
            raise ValueError(f"{where}: {kind} blocks are not supported here")
        else:
            raise ValueError(f"{where}: unsupported content block type {kind!r}")
    if text or calls or not out:
        parts = [{"type": "text", "text": t} if isinstance(t, str) else t for t in text]
        content = parts if any(not isinstance(t, str) for t in text) else "".join(text)
        msg: dict[str, Any] = {"role": role, "content": content}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


class MessagesShaper:
    """One ``/v1/messages`` answer: the message object, or its stream of typed events."""

    def __init__(self, a: Answer) -> None:
        self.id = "msg_" + a.rid.split("-", 1)[-1]
        self.model = a.model
        self.tools = tools = a.submitted.tools
        self.parts: list[str] = []
        self.plan = harmony_only(a.submitted.reasoning)
        self._answer = AnswerReader(self.plan, tools)
        self.prompt_tokens = a.submitted.prompt_tokens
        self.last: Output | None = None
        self._text_open = False
        self._index = 0
        self._n_calls = 0  # tool_use blocks streamed

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None,
                 usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    @staticmethod
    def _usage(final: Output) -> dict[str, int]:
        return {"input_tokens": final.prompt_tokens - final.cached_tokens, "output_tokens": final.completion_tokens,
                "cache_read_input_tokens": final.cached_tokens, "cache_creation_input_tokens": 0}

    @staticmethod
    def _stop(final: Output, has_calls: bool) -> tuple[str, str | None]:
        if has_calls:
            return "tool_use", None
        if final.stop_word is not None:
            return "stop_sequence", final.stop_word
        return STOP_REASONS.get(str(final.finish_reason), "end_turn"), None

    def add(self, batch: list[Output]) -> None:
        self.parts.extend(o.text for o in batch)
        self.last = batch[-1]

    def final(self) -> dict[str, Any]:
        final = self.last
        assert final is not None
        text = "".join(self.parts)
        _, text, calls = read_answer(self.plan, self.tools, text)
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text or not calls else []
        content += [_tool_use(c) for c in calls]
        reason, seq = self._stop(final, bool(calls))
        return self._message(content, reason, seq, self._usage(final))

    # ---- the stream ---------------------------------------------------------------------------

    @staticmethod
    def event(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, **fields}, kind)

    def opening(self) -> bytes:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        return self.event("message_start", message=self._message([], None, None, usage)) + self.event("ping")

    def _text(self, text: str) -> bytes:
        if not text:
            return b""
        out = b""
        if not self._text_open:
            out += self.event("content_block_start", index=self._index, content_block={"type": "text", "text": ""})
            self._text_open = True
        return out + self.event("content_block_delta", index=self._index, delta={"type": "text_delta", "text": text})

    def events(self, batch: list[Output]) -> bytes:
        self.last = batch[-1]
        text = "".join(o.text for o in batch)
        if not text:
            return b""
        out = self._text(self._answer.feed(text)[1])
        return out + self._tool_uses(self._answer.call_parts())  # each as it is written

    def _close_text(self) -> bytes:
        if not self._text_open:
            return b""
        self._text_open = False
        self._index += 1
        return self.event("content_block_stop", index=self._index - 1)

    def _tool_uses(self, parts: list[CallPart]) -> bytes:
        """Calls' parts as ``tool_use`` blocks: opened at a call's first part, its arguments as
        ``input_json_delta``s, closed at its last."""
        out = self._close_text() if parts else b""
        for p in parts:
            if p.first:
                block = {"type": "tool_use", "id": "toolu_" + p.id.removeprefix("call_"), "name": p.name, "input": {}}
                out += self.event("content_block_start", index=self._index, content_block=block)
                self._n_calls += 1
            if p.arguments:
                out += self.event("content_block_delta", index=self._index,
                                  delta={"type": "input_json_delta", "partial_json": p.arguments})
            if p.last:
                out += self.event("content_block_stop", index=self._index)
                self._index += 1
        return out

    def closing(self) -> bytes:
        final = self.last
        assert final is not None
        _, rest, parts = self._answer.finish()
        out = self._tool_uses(parts) + self._text(rest) if self._n_calls else self._text(rest) + self._tool_uses(parts)
        out += self._close_text()
        reason, seq = self._stop(final, bool(self._n_calls))
        return out + self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                                usage={"output_tokens": final.completion_tokens}) + self.event("message_stop")

    def failed(self, status: int, message: str) -> bytes:
        return self.event("error", error=error_body(status, message)["error"])


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        args = {"_raw": fn["arguments"]}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": fn["name"], "input": args}



MESSAGES = Generate(("/v1/messages",), MessagesRequest, "msg-", MessagesShaper, error=error_body,
                    summary="Anthropic's Messages API; its errors in Anthropic's shape")
COUNT_TOKENS = Call(("/v1/messages/count_tokens",), CountTokensRequest, error=error_body, summary="Anthropic's token count of a Messages request")

ENDPOINTS = (MESSAGES, COUNT_TOKENS)
ROUTES = ()
