"""Response shaping: a request's outputs, per choice, into OpenAI's answer and SSE chunks.

Pure functions and small per-request state, no I/O: the ingress feeds each choice's outputs
in and sends what comes out. A request with ``n`` choices has outputs for request ids
``<id>`` (choice 0) and ``<id>#<i>``; each choice has its own text, log probabilities
and tool-call parser.
"""

from __future__ import annotations

import json
from typing import Any

from deployments.protocol import LogprobsShaper, ToolSettings, now, prompt_progress, timings, usage
from engine.reasoning import ReasoningPlan, ReasoningSplitter, split_reasoning
from engine.tools import tool_finish
from engine.types import Output


def member_ids(rid: str, n: int) -> list[str]:
    """The engine's request id of each choice."""
    return [rid] + [f"{rid}#{i}" for i in range(1, n)]


def choice_index(request_id: str) -> int:
    _, sep, tail = request_id.rpartition("#")
    return int(tail) if sep else 0


def total_usage(finals: list[Output]) -> dict:
    """One prompt (evaluated once) and every choice's completion tokens."""
    lead = finals[0]
    return usage(lead.prompt_tokens, sum(o.completion_tokens for o in finals), lead.cached_tokens)


class SseEvents:
    """The SSE events of one streamed request. The parts that do not change are encoded
    once, so a token of choice 0 costs one ``json.dumps`` of its text."""

    def __init__(self, rid: str, kind: str, model: str, include_usage: bool) -> None:
        self.kind = kind
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.head = {"id": rid, "object": obj, "created": now(), "model": model}
        head = json.dumps(self.head, ensure_ascii=False)[:-1].encode()
        key = b'"delta": {"content": ' if kind == "chat" else b'"text": '
        tail = b"}" if kind == "chat" else b""
        self._prefix = b"data: " + head + b', "choices": [{"index": 0, ' + key
        self._suffix = tail + b', "finish_reason": null, "logprobs": null}]' + (
            b', "usage": null' if include_usage else b""
        ) + b"}\n\n"
        self.include_usage = include_usage

    def chunk(self, text: str | None, finish: str | None, first: bool = False, logprobs: dict | None = None,
              tool_calls: list[dict] | None = None, index: int = 0, final: Output | None = None,
              reasoning: str | None = None) -> bytes:
        """One chunk; ``final``: the choice's last output, whose llama-server ``timings`` it carries;
        ``reasoning``: thinking text (chat: ``delta.reasoning_content``)."""
        if text and finish is None and not first and logprobs is None and tool_calls is None and index == 0 \
                and not reasoning:
            return self._prefix + json.dumps(text, ensure_ascii=False).encode() + self._suffix  # the per-token case
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        body = {**self.head, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        if final is not None:
            body["timings"] = timings(final)
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    def progress(self, o: Output) -> bytes:
        """llama-server's prompt progress chunk (``return_progress``): no choices."""
        body = {**self.head, "choices": [], "prompt_progress": prompt_progress(o)}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def usage(self, finals: list[Output]) -> bytes:
        body = {**self.head, "choices": [], "usage": total_usage(finals)}
        return b"data: " + json.dumps(body).encode() + b"\n\n"


class Choice:
    """One choice of a request: what has arrived for it, and its streamed form."""

    def __init__(self, index: int, kind: str, want_logprobs: bool, tools: ToolSettings | None,
                 reasoning: ReasoningPlan | None = None) -> None:
        self.index = index
        self.reasoning = reasoning if kind == "chat" else None
        self._thinking = ReasoningSplitter(self.reasoning) if self.reasoning is not None else None
        self.kind = kind
        self.parts: list[str] = []
        self.entries: list[tuple] = []
        self.last: Output | None = None
        self.want_logprobs = want_logprobs
        self.tools = tools
        self._shaper = LogprobsShaper(kind) if want_logprobs else None
        self._calls = tools.stream() if tools is not None else None

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None

    # ---- the whole answer ---------------------------------------------------------------------

    def add(self, outs: list[Output]) -> None:
        self.parts.extend(o.text for o in outs)
        self.entries.extend(e for o in outs if o.logprobs for e in o.logprobs)
        self.last = outs[-1]

    def body(self) -> dict[str, Any]:
        """The choice in a non-streamed answer."""
        assert self.last is not None
        text = "".join(self.parts)
        lp = LogprobsShaper(self.kind).shape(self.entries) if self.want_logprobs else None
        finish = self.last.finish_reason
        if self.kind != "chat":
            return {"index": self.index, "text": text, "finish_reason": finish, "logprobs": lp}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            thinking, text = split_reasoning(self.reasoning, text)
            message = {"role": "assistant", "content": text, **({"reasoning_content": thinking} if thinking else {})}
        if self.tools is not None:
            content, calls = self.tools.read(text)
            if calls:
                message = {**message, "content": content or None, "tool_calls": calls}
                finish = tool_finish(finish)
        return {"index": self.index, "message": message, "finish_reason": finish, "logprobs": lp}

    # ---- the stream ---------------------------------------------------------------------------

    def events(self, ev: SseEvents, outs: list[Output]) -> bytes:
        """The SSE chunks for outputs that arrived for this choice (not for a failed end: the
        caller sends the error)."""
        self.last = outs[-1]
        text = "".join(o.text for o in outs)
        thinking = ""
        if self._thinking is not None:
            thinking, text = self._thinking.feed(text)
            if self.last.finish_reason is not None:
                more, rest = self._thinking.finish()
                thinking, text = thinking + more, text + rest
        if self._calls is not None:
            text = self._calls.feed(text)
        lp = None
        if self._shaper is not None:
            entries = [e for o in outs if o.logprobs for e in o.logprobs]
            lp = self._shaper.shape(entries) if entries else None
        finish = self.last.finish_reason
        head = ev.chunk(None, None, index=self.index, reasoning=thinking) if thinking else b""
        if finish is None or finish.failed:
            return head + (ev.chunk(text, None, logprobs=lp, index=self.index) if text or lp else b"")
        return head + self._closing(ev, text, lp, finish)

    def _closing(self, ev: SseEvents, text: str, lp: dict | None, finish: Any) -> bytes:
        calls = None
        if self._calls is not None:  # the held text: content, then the calls it holds
            rest, calls = self._calls.finish()
            text += rest
            finish = tool_finish(finish) if calls else finish
        last = self.last
        if calls:
            return (ev.chunk(text, None, logprobs=lp, index=self.index) if text or lp else b"") \
                + ev.chunk(None, None, tool_calls=calls, index=self.index) \
                + ev.chunk(None, finish, index=self.index, final=last)
        if self.kind == "chat" and (text or lp):
            return ev.chunk(text, None, logprobs=lp, index=self.index) + ev.chunk(None, finish, index=self.index,
                                                                                 final=last)
        return ev.chunk(text, finish, logprobs=lp, index=self.index, final=last)


def by_choice(batch: list[Output]) -> dict[int, list[Output]]:
    """A batch of outputs split per choice, each in arrival order."""
    out: dict[int, list[Output]] = {}
    for o in batch:
        out.setdefault(choice_index(o.request_id), []).append(o)
    return out


# ---- OpenAI's Responses API -----------------------------------------------------------------------


class ResponsesShaper:
    """One ``/v1/responses`` answer: the response object, and its stream of typed events
    (created, the message item and its text part, text deltas, then completed)."""

    def __init__(self, rid: str, model: str, req: Any) -> None:
        self.rid = rid
        self.msg_id = "msg_" + rid.removeprefix("resp_")
        self.model = model
        self.req = req
        self.created = now()
        self.seq = 0
        self.parts: list[str] = []

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

    def final(self, last: Output) -> dict[str, Any]:
        """The whole answer's body."""
        return self.response(self.status_of(last), last)

    def add(self, outs: list[Output]) -> None:
        self.parts.extend(o.text for o in outs)

    # ---- the stream ---------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    def opening(self) -> bytes:
        item = {"type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return (self.event("response.created", response=self.response("in_progress"))
                + self.event("response.in_progress", response=self.response("in_progress"))
                + self.event("response.output_item.added", output_index=0, item=item)
                + self.event("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0, part=part))

    def delta(self, text: str) -> bytes:
        self.parts.append(text)
        return self.event("response.output_text.delta", item_id=self.msg_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self, final: Output) -> bytes:
        status = self.status_of(final)
        text = "".join(self.parts)
        item = self._item(text, status)
        done = "response.completed" if status == "completed" else "response.incomplete"
        return (self.event("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0,
                           text=text, logprobs=[])
                + self.event("response.content_part.done", item_id=self.msg_id, output_index=0, content_index=0,
                             part=item["content"][0])
                + self.event("response.output_item.done", output_index=0, item=item)
                + self.event(done, response=self.response(status, final)))

    def failed(self, status: int, message: str) -> bytes:
        body = self.response("failed")
        body["error"] = {"code": "server_error" if status >= 500 else "invalid_request", "message": message}
        return self.event("response.failed", response=body)
