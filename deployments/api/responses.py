"""OpenAI's Responses API (``POST /v1/responses``), served as a chat request: text and function
tools in (``function_call`` and ``function_call_output`` items carry a tool loop's turns), the
response object out with its message and ``function_call`` items, or its stream of typed events
(created; the message item, its text part and text deltas; each call's item, its arguments'
delta and done; then completed). Nothing is stored: ``previous_response_id`` is refused (send
the whole input, as the Agents SDK does by default)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from deployments.api.base import Answer, ApiModel, Generate, now, sse
from deployments.api.generation import sampling_field
from deployments.api.openai import ChatCompletionRequest
from engine.text.answer import AnswerReader, harmony_only, read_answer
from engine.text.call_args import CallPart
from engine.types import Output

TEXT_PARTS = ("input_text", "output_text", "text")
SKIPPED_ITEMS = ("reasoning",)  # an earlier turn's reasoning summary: not part of the prompt here


def _text(content: Any, where: str, images: bool = False) -> Any:
    """The text of a content list (text parts) or a string; with ``images``, a list of chat
    content parts when the content holds ``input_image`` parts (a data URL each)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: the content must be a string or a list of text parts")
    parts: list[Any] = []
    for j, part in enumerate(content):
        if images and isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise ValueError(f"{where}[{j}]: an input_image needs image_url (a data URL; file ids are not kept here)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            continue
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}]: content parts are text{' or input_image' if images else ''} (objects)")
        parts.append(part["text"])
    if any(not isinstance(p, str) for p in parts):
        return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return "".join(parts)


def _chat_tool(i: int, t: Any) -> dict[str, Any]:
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
        kind = t.get("type") if isinstance(t, dict) else type(t).__name__
        raise ValueError(f"tools[{i}]: only function tools ({{type: function, name, parameters}}) are supported, "
                         f"not {str(kind)[:40]!r}")
    fn: dict[str, Any] = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
    if t.get("description"):
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "required", "none"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError('tool_choice must be "auto", "required", "none" or {"type": "function", "name": ...}')


class ResponsesRequest(ApiModel):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float | None = sampling_field("temperature")
    top_p: float | None = sampling_field("top_p")
    stream: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, description="vLLM's: the prompt "
                                   "reuses cached KV only of requests with the same salt (a tenant's own; docs/security.md).")
    text: dict[str, Any] | None = Field(default=None, description='{"format": {"type": "text" | "json_object" | "json_schema", ...}}')
    tools: list[dict[str, Any]] | None = Field(default=None, description="Function tools: {type: function, name, "
                                               "description, parameters}; other tool types are a 400.")
    tool_choice: Any = Field(default=None, description='"auto", "required", "none" or {"type": "function", "name"}.')
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = Field(default=None, description="Extra output to include (the OpenAI Agents SDK "
                                      "sends []); nothing beyond the text is produced, so entries are ignored.")
    # accepted and ignored, as for chat
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    _chat: ChatCompletionRequest | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id is not supported: responses are not stored; send the whole input")
        self._chat = self._chat_request()  # validated here, once; to_chat() hands it out
        return self

    def messages(self) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*msgs, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message" and "role" in item:
                msgs.append({"role": item["role"], "content": _text(item.get("content") or "", f"input[{i}].content",
                                                                    images=item["role"] == "user")})
            elif kind == "function_call":
                call = {"id": str(item.get("call_id") or item.get("id") or f"call_{i}"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
                last = msgs[-1] if msgs else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)  # parallel calls of one turn: one assistant message
                else:
                    msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                out = item.get("output")
                msgs.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": _text(out if out is not None else "", f"input[{i}].output")})
            elif kind in SKIPPED_ITEMS:
                continue
            else:
                raise ValueError(f"input[{i}]: only message, function_call and function_call_output items are "
                                 f"supported, not {str(kind)[:40]!r}")
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
        forced = self.tools and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))
        # a forced call is not text: text.format applies to the answer after it (the Agents SDK sends
        # both, with tool_choice reset to auto once the call is made)
        body: dict[str, Any] = {"messages": self.messages(), "stream": self.stream, "model": self.model,
                                "response_format": None if forced else self.response_format()}
        for k, v in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature), ("top_p", self.top_p),
                     ("parallel_tool_calls", self.parallel_tool_calls), ("cache_salt", self.cache_salt)):
            if v is not None:
                body[k] = v
        if self.tools:
            body["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        return ChatCompletionRequest.model_validate(body)


class ResponsesShaper:
    """One ``/v1/responses`` answer: a message item for its text and a ``function_call`` item
    per tool call."""

    def __init__(self, a: Answer) -> None:
        self.rid = a.rid
        self.key = a.rid.removeprefix("resp_")
        self.msg_id = "msg_" + self.key
        self.model = a.model
        req = a.request  # what the response object echoes of the request, not its input: a stream keeps this
        self.echo = {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}},
            "metadata": req.metadata or {},
        }
        self.tools = a.submitted.tools
        self.plan = harmony_only(a.submitted.reasoning)
        self._stream = AnswerReader(self.plan, self.tools)
        self.created = now()
        self.seq = 0
        self.raw: list[str] = []  # the whole answer's text as generated
        self.parts: list[str] = []  # the message's text (tool calls taken out)
        self.calls: list[dict[str, Any]] = []
        self.last: Output | None = None
        self._open = False  # the stream's message item is open
        self._index = 0  # the stream's next output index
        self.later: list[str] = []  # text after calls that streamed (a second message item)
        self.later_id = self.msg_id + "_1"

    def _status(self) -> str:
        assert self.last is not None
        return "incomplete" if self.last.finish_reason == "length" and not self.calls else "completed"

    def _message(self, status: str, item_id: str | None = None, parts: list[str] | None = None) -> dict[str, Any]:
        """The message item (``item_id`` and ``parts``: the later one's, after streamed calls)."""
        parts = self.parts if parts is None else parts
        content = [] if status == "in_progress" else [
            {"type": "output_text", "text": "".join(parts), "annotations": [], "logprobs": []}]
        return {"type": "message", "id": item_id or self.msg_id, "status": status, "role": "assistant",
                "content": content}

    def _call(self, i: int, status: str) -> dict[str, Any]:
        c = self.calls[i]
        return {"type": "function_call", "id": f"fc_{self.key}_{i}", "call_id": c["id"], "name": c["function"]["name"],
                "arguments": "" if status == "in_progress" else c["function"]["arguments"], "status": status}

    def _output(self, status: str) -> list[dict[str, Any]]:
        items = [self._message(status)] if "".join(self.parts) or not self.calls else []
        items += [self._call(i, "completed") for i in range(len(self.calls))]
        if self.later:
            items.append(self._message("completed", self.later_id, self.later))
        return items

    def response(self, status: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": self._output(status) if status not in ("in_progress", "failed") else [], "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **self.echo, "store": False, "truncation": "disabled", "usage": None,
        }
        final = self.last
        if final is not None and status not in ("in_progress", "failed"):
            body["usage"] = {
                "input_tokens": final.prompt_tokens, "output_tokens": final.completion_tokens,
                "total_tokens": final.prompt_tokens + final.completion_tokens,
                "input_tokens_details": {"cached_tokens": final.cached_tokens, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            }
        return body

    # ---- the whole answer ---------------------------------------------------------------------

    def add(self, batch: list[Output]) -> None:
        self.raw.extend(o.text for o in batch)
        self.last = batch[-1]

    def final(self) -> dict[str, Any]:
        text = "".join(self.raw)
        _, text, self.calls = read_answer(self.plan, self.tools, text)
        self.parts = [text]
        return self.response(self._status())

    # ---- the stream ---------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(body, kind)

    def opening(self) -> bytes:
        return (self.event("response.created", response=self.response("in_progress"))
                + self.event("response.in_progress", response=self.response("in_progress")))

    def _text(self, text: str, item_id: str | None = None, parts: list[str] | None = None) -> bytes:
        """``text`` into the open message item (opened first where none is); ``item_id`` and
        ``parts``: the later message's."""
        item_id, parts = item_id or self.msg_id, self.parts if parts is None else parts
        out = b""
        if not self._open:
            self._open = True
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self.event("response.output_item.added", output_index=self._index,
                              item=self._message("in_progress", item_id, parts))
            out += self.event("response.content_part.added", item_id=item_id, output_index=self._index,
                              content_index=0, part=part)
        if text:
            parts.append(text)
            out += self.event("response.output_text.delta", item_id=item_id, output_index=self._index,
                              content_index=0, delta=text, logprobs=[])
        return out

    def events(self, batch: list[Output]) -> bytes:
        self.last = batch[-1]
        text = "".join(o.text for o in batch)
        text = self._stream.feed(text)[1]
        out = self._text(text) if text else b""
        parts = self._stream.call_parts()  # each call streams as it is written
        if parts:
            out += self._close_message()
            out += self._calls(parts)
        return out

    def _close_message(self, item_id: str | None = None, parts: list[str] | None = None) -> bytes:
        if not self._open:
            return b""
        self._open = False
        item = self._message("completed", item_id, parts)
        out = (self.event("response.output_text.done", item_id=item["id"], output_index=self._index,
                          content_index=0, text=item["content"][0]["text"], logprobs=[])
               + self.event("response.content_part.done", item_id=item["id"], output_index=self._index,
                            content_index=0, part=item["content"][0])
               + self.event("response.output_item.done", output_index=self._index, item=item))
        self._index += 1
        return out

    def _calls(self, parts: list[CallPart]) -> bytes:
        """Calls' parts as ``function_call`` items: added at a call's first part, its arguments as
        deltas, done at its last."""
        out = b""
        for p in parts:
            if p.first:
                self.calls.append({"id": p.id, "type": "function", "function": {"name": p.name, "arguments": ""}})
                out += self.event("response.output_item.added", output_index=self._index,
                                  item=self._call(len(self.calls) - 1, "in_progress"))
            i = len(self.calls) - 1
            item_id = f"fc_{self.key}_{i}"
            if p.arguments:
                self.calls[i]["function"]["arguments"] += p.arguments
                out += self.event("response.function_call_arguments.delta", item_id=item_id,
                                  output_index=self._index, delta=p.arguments)
            if p.last:
                done = self._call(i, "completed")
                out += (self.event("response.function_call_arguments.done", item_id=item_id, output_index=self._index,
                                   arguments=done["arguments"], name=done["name"])
                        + self.event("response.output_item.done", output_index=self._index, item=done))
                self._index += 1
        return out

    def closing(self) -> bytes:
        out = b""
        _, rest, more = self._stream.finish()
        later = rest if self.calls else ""  # after calls that streamed: a message of its own, last
        if rest and not later:
            out += self._text(rest)
        if not self._open and not self.calls and not more:  # ``more``: the calls' last parts
            out += self._text("")  # a plain answer always has its message, empty or not
        out += self._close_message() + self._calls(more)
        if later:  # text after calls that already streamed: a message item of its own, after them
            out += self._text(later, self.later_id, self.later) + self._close_message(self.later_id, self.later)
        status = self._status()
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self.event(kind, response=self.response(status))

    def failed(self, status: int, message: str) -> bytes:
        body = self.response("failed")
        body["error"] = {"code": "server_error" if status >= 500 else "invalid_request", "message": message}
        return self.event("response.failed", response=body)


RESPONSES = Generate(("/v1/responses",), ResponsesRequest, "resp_", ResponsesShaper,
                     summary="OpenAI's Responses API, with function tools")

ENDPOINTS = (RESPONSES,)
ROUTES = ()
