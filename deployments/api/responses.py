"""OpenAI's Responses API (``POST /v1/responses``): text in, text out, served as a chat request;
the response object and its stream of typed events (created, the message item and its text
part, text deltas, then completed). Nothing is stored: ``previous_response_id`` and ``tools``
are refused."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from deployments.api.base import Answer, ApiModel, Generate, now, sse
from deployments.api.generation import sampling_field
from deployments.api.openai import ChatCompletionRequest
from engine.types import Output


class ResponsesRequest(ApiModel):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float | None = sampling_field("temperature")
    top_p: float | None = sampling_field("top_p")
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
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                            or not isinstance(part.get("text"), str):
                        raise ValueError(f"input[{i}].content[{j}]: only text content parts (objects) are supported")
                    parts.append({"type": "text", "text": part["text"]})
                content = parts
            msgs.append({"role": item["role"], "content": content})
        return msgs

    def response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise ValueError("text.format must be an object such as {\"type\": \"json_schema\", \"schema\": {...}}")
        if not fmt or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_schema":
            return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
        return {"type": fmt.get("type")}

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this one is served as (built when the body was validated)."""
        return self._chat

    served_as = to_chat

    def _chat_request(self) -> ChatCompletionRequest:
        body: dict[str, Any] = {"messages": self.messages(), "stream": self.stream, "model": self.model,
                                "response_format": self.response_format()}
        for k, v in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature), ("top_p", self.top_p)):
            if v is not None:
                body[k] = v
        return ChatCompletionRequest.model_validate(body)


class ResponsesShaper:
    """One ``/v1/responses`` answer."""

    def __init__(self, a: Answer) -> None:
        self.rid = a.rid
        self.msg_id = "msg_" + a.rid.removeprefix("resp_")
        self.model = a.model
        self.req = a.request
        self.created = now()
        self.seq = 0
        self.parts: list[str] = []
        self.last: Output | None = None

    def response(self, status: str, final: Output | None = None) -> dict[str, Any]:
        text = "".join(self.parts)
        done = status != "in_progress"
        output = [self._item(text, status)] if done else []
        body: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "error": None, "incomplete_details": None, "instructions": self.req.instructions,
            "max_output_tokens": self.req.max_output_tokens, "temperature": self.req.temperature, "top_p": self.req.top_p,
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "text": self.req.text or {"format": {"type": "text"}},
            "metadata": self.req.metadata or {}, "store": False, "truncation": "disabled", "usage": None,
        }
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if final is not None:
            body["usage"] = {
                "input_tokens": final.prompt_tokens, "output_tokens": final.completion_tokens,
                "total_tokens": final.prompt_tokens + final.completion_tokens,
                "input_tokens_details": {"cached_tokens": final.cached_tokens, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            }
        return body

    def _item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" else []
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def status_of(final: Output) -> str:
        return "incomplete" if final.finish_reason == "length" else "completed"

    def add(self, batch: list[Output]) -> None:
        self.parts.extend(o.text for o in batch)
        self.last = batch[-1]

    def final(self) -> dict[str, Any]:
        assert self.last is not None
        return self.response(self.status_of(self.last), self.last)

    # ---- the stream ---------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(body, kind)

    def opening(self) -> bytes:
        item = {"type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return (self.event("response.created", response=self.response("in_progress"))
                + self.event("response.in_progress", response=self.response("in_progress"))
                + self.event("response.output_item.added", output_index=0, item=item)
                + self.event("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0, part=part))

    def events(self, batch: list[Output]) -> bytes:
        self.last = batch[-1]
        text = "".join(o.text for o in batch)
        if not text:
            return b""
        self.parts.append(text)
        return self.event("response.output_text.delta", item_id=self.msg_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self) -> bytes:
        assert self.last is not None
        status = self.status_of(self.last)
        text = "".join(self.parts)
        item = self._item(text, status)
        done = "response.completed" if status == "completed" else "response.incomplete"
        return (self.event("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0,
                           text=text, logprobs=[])
                + self.event("response.content_part.done", item_id=self.msg_id, output_index=0, content_index=0,
                             part=item["content"][0])
                + self.event("response.output_item.done", output_index=0, item=item)
                + self.event(done, response=self.response(status, self.last)))

    def failed(self, status: int, message: str) -> bytes:
        body = self.response("failed")
        body["error"] = {"code": "server_error" if status >= 500 else "invalid_request", "message": message}
        return self.event("response.failed", response=body)


RESPONSES = Generate(("/v1/responses",), ResponsesRequest, "resp_", ResponsesShaper, summary="OpenAI's Responses API")

ENDPOINTS = (RESPONSES,)
