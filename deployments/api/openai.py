"""OpenAI's API: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings`` and
``/v1/models``: the request bodies, how a request's prompt is made on the engine side, and
the answers, whole and streamed (SSE chunks ending in ``[DONE]``).

A request with ``n`` choices has outputs for request ids ``<id>`` (choice 0) and
``<id>#<i>``; each choice has its own text, log probabilities and tool-call parser.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from deployments.api import media
from deployments.api.base import (
    MAX_PROMPT_CHARS,
    Answer,
    Generate,
    by_choice,
    dumps,
    now,
    openai_error,
    sse,
    usage,
)
from deployments.api.chat_content import ChatMessage, template_messages
from deployments.api.embeddings import EMBEDDINGS
from deployments.api.generation import GenerationRequest, prompt_progress, timings
from deployments.api.media import CHAT_MARKER, MediaBag
from deployments.api.values import Prepared, ToolSettings
from engine.text.answer import AnswerReader, preserved_tokens, read_answer
from engine.text.call_args import CallPart
from engine.text.reasoning import ReasoningPlan, opened_thinking
from engine.text.tool_calls import arg_types, tool_finish
from engine.text.tools import ToolPlan, check_tools, chosen
from engine.types import Output

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.params import SamplingParams

DONE = b"data: [DONE]\n\n"


class CompletionRequest(GenerationRequest):
    _media: tuple[bytes, ...] = PrivateAttr(default=())  # /completion's multimodal_data, checked
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

    def engine_prompt(self, engine: Engine) -> str | list[int]:
        return self.prompt

    def prepare(self, engine: Engine, request_id: str) -> Prepared:
        """The engine's request (on the engine replica, off its event loop)."""
        prompt = self.engine_prompt(engine)
        r = engine.make_request(prompt, self.sampling(engine.n_ctx_slot), request_id, cache_prompt=self.cache_prompt,
                                n=self.n, id_slot=self.id_slot, media=self._media, marker=media.MEDIA_MARKER,
                                cache_salt=self.cache_salt or "")
        echo = None
        if self.echo:  # after make_request: token ids are checked there (400), not decoded blind
            echo = prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)
        return Prepared(r, echo=echo)


class ChatCompletionRequest(GenerationRequest):
    _media: tuple[bytes, ...] = PrivateAttr(default=())
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
        bag = MediaBag()
        for i, m in enumerate(self.messages):
            m.add_media(bag, f"messages[{i}]")
        self._media = tuple(bag.items)
        return self

    @property
    def media(self) -> tuple[bytes, ...]:
        """The request's images and audio, in the order of their ``CHAT_MARKER``s in the prompt."""
        return self._media

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

    def prepare(self, engine: Engine, request_id: str) -> Prepared:
        """The engine's request, its tool parser's settings and its reasoning split."""
        prompt, params, plan = chat_prompt(engine.tokenizer, self, engine.n_ctx_slot, engine.slot_limit)
        thinking = ReasoningPlan.make(self.reasoning_format, engine.tokenizer.template.source or "", prompt)
        tools = ToolSettings(tuple(plan.names), plan.parallel, plan.format, arg_types(plan.tools)) if plan.active else None
        r = engine.make_request(prompt, params, request_id, cache_prompt=self.cache_prompt, n=self.n,
                                id_slot=self.id_slot, media=self.media, marker=CHAT_MARKER,
                                preserved=preserved_tokens(thinking, tools), cache_salt=self.cache_salt or "")
        return Prepared(r, tools=tools, reasoning=thinking)


def chat_prompt(tokenizer: Any, req: ChatCompletionRequest, default_max_tokens: int,
                limit: Any = None) -> tuple[str, SamplingParams, ToolPlan]:
    """A chat request's prompt (its tools in it, as its template takes them), its sampling
    (a forced tool call's grammar in it) and its tool plan. ``limit`` (an
    ``engine.text.tokenizer.TokenLimit``): the rendering stops once the prompt cannot fit it."""
    plan = ToolPlan.make(tokenizer.template.source, tokenizer.template.builtin, req.tools, req.tool_choice,
                         req.parallel_tool_calls)
    prompt = tokenizer.apply_chat_template(plan.messages(req.template_messages()), tools=plan.template_tools(),
                                           kwargs=req.template_kwargs(), limit=limit)
    params = req.sampling(default_max_tokens, req.max_completion_tokens)
    grammar = plan.grammar(after=opened_thinking(tokenizer.template.source or "", prompt))
    if grammar is not None:
        params = params.model_copy(update={"grammar": grammar})
    return prompt, params, plan


# ---- the answers ---------------------------------------------------------------------------------


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
        head = dumps(self.head)[:-1].encode()
        key = b'"delta": {"content": ' if kind == "chat" else b'"text": '
        tail = b"}" if kind == "chat" else b""
        self._prefix = b"data: " + head + b', "choices": [{"index": 0, ' + key
        self._suffix = tail + b', "finish_reason": null, "logprobs": null}]' + (
            b', "usage": null' if include_usage else b""
        ) + b"}\n\n"
        self.include_usage = include_usage

    def chunk(self, text: str | None, finish: str | None, first: bool = False, logprobs: dict | None = None,
              tool_calls: list[dict] | None = None, index: int = 0, final: Output | None = None,
              reasoning: str | None = None, usage: dict | None = None) -> bytes:
        """One chunk; ``final``: the choice's last output, whose llama-server ``timings`` it carries;
        ``reasoning``: thinking text (chat: ``delta.reasoning_content``); ``usage``: the request's
        usage, on the chunk that ends its last choice when no usage chunk was asked for;
        ``tool_calls``: OpenAI's tool-call deltas (``call_deltas``)."""
        if text and finish is None and not first and logprobs is None and tool_calls is None and index == 0 \
                and not reasoning:
            return self._prefix + dumps(text).encode() + self._suffix  # the per-token case
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        body = {**self.head, "choices": [choice]}
        if usage is not None:
            body["usage"] = usage
        elif self.include_usage:
            body["usage"] = None
        if final is not None:
            body["timings"] = timings(final)
        return sse(body)

    def progress(self, o: Output) -> bytes:
        """llama-server's prompt progress chunk (``return_progress``): no choices."""
        return sse({**self.head, "choices": [], "prompt_progress": prompt_progress(o)})

    def usage(self, finals: list[Output]) -> bytes:
        """The usage chunk, with llama-server's ``timings`` (Open WebUI keeps the last usage it
        sees and reads its speed there)."""
        return sse({**self.head, "choices": [], "usage": total_usage(finals), "timings": timings(finals[0])})


class Choice:
    """One choice of a request: what has arrived for it, and its streamed form."""

    def __init__(self, index: int, kind: str, want_logprobs: bool, tools: ToolSettings | None,
                 reasoning: ReasoningPlan | None = None) -> None:
        self.index = index
        self.reasoning = reasoning if kind == "chat" else None
        self.kind = kind
        self.parts: list[str] = []
        self.entries: list[tuple] = []
        self.last: Output | None = None
        self.want_logprobs = want_logprobs
        self.tools = tools
        self._shaper = LogprobsShaper(kind) if want_logprobs else None
        self._answer = AnswerReader(self.reasoning, tools) if kind == "chat" else None
        self.n_calls = 0  # tool calls begun in the stream so far

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
        thinking, content, calls = read_answer(self.reasoning, self.tools, text)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else ""),
                                   **({"reasoning_content": thinking} if thinking else {})}
        if calls:
            message["tool_calls"] = calls
            finish = tool_finish(finish)
        return {"index": self.index, "message": message, "finish_reason": finish, "logprobs": lp}

    # ---- the stream ---------------------------------------------------------------------------

    def events(self, ev: SseEvents, outs: list[Output], usage: dict | None = None) -> bytes:
        """The SSE chunks for outputs that arrived for this choice (not for a failed end: the
        caller sends the error); ``usage`` goes on its closing chunk. A call streams as it is
        written: its id and name, then its arguments a piece at a time, as OpenAI streams them."""
        self.last = outs[-1]
        text = "".join(o.text for o in outs)
        thinking, parts = "", []
        ending = self.last.finish_reason is not None and not self.last.failed
        if self._answer is not None:
            thinking, text = self._answer.feed(text)
            parts = self._answer.call_parts()
            if ending:
                more, rest, last_parts = self._answer.finish()
                thinking, text, parts = thinking + more, text + rest, parts + last_parts
        lp = None
        if self._shaper is not None:
            entries = [e for o in outs if o.logprobs for e in o.logprobs]
            lp = self._shaper.shape(entries) if entries else None
        out = ev.chunk(None, None, index=self.index, reasoning=thinking) if thinking else b""
        if parts and not self.n_calls and (text or lp):  # the text before the first call goes out before it
            out += ev.chunk(text, None, logprobs=lp, index=self.index)
            text, lp = "", None
        if parts:
            self.n_calls = max(self.n_calls, 1 + max(p.index for p in parts))
            out += ev.chunk(None, None, tool_calls=call_deltas(parts), index=self.index)
        if not ending:
            return out + (ev.chunk(text, None, logprobs=lp, index=self.index) if text or lp else b"")
        finish = tool_finish(self.last.finish_reason) if self.n_calls else self.last.finish_reason
        if self.kind == "chat" and (text or lp):
            return out + ev.chunk(text, None, logprobs=lp, index=self.index) + ev.chunk(
                None, finish, index=self.index, final=self.last, usage=usage)
        return out + ev.chunk(text, finish, logprobs=lp, index=self.index, final=self.last, usage=usage)


def call_deltas(parts: list[CallPart]) -> list[dict[str, Any]]:
    """OpenAI's ``delta.tool_calls`` for calls' parts: a call's first carries its id, type and name,
    the others only its arguments (one entry per call and chunk, its parts joined)."""
    out: list[dict[str, Any]] = []
    for p in parts:
        if out and out[-1]["index"] == p.index:
            out[-1]["function"]["arguments"] += p.arguments
        elif p.first:
            out.append({"index": p.index, "id": p.id, "type": "function",
                        "function": {"name": p.name, "arguments": p.arguments}})
        else:
            out.append({"index": p.index, "function": {"arguments": p.arguments}})
    return [d for d in out if "id" in d or d["function"]["arguments"]]


class ChoicesShaper:
    """A completions or chat answer: every choice's, whole or as SSE chunks."""

    def __init__(self, a: Answer, kind: Literal["chat", "completion"]) -> None:
        req = a.run
        self.kind, self.rid, self.model = kind, a.rid, a.model
        self.include_usage = req.include_usage
        self.ev = SseEvents(a.rid, kind, a.model, req.include_usage)
        want = req.n_logprobs() is not None
        self.choices = [Choice(i, kind, want, a.submitted.tools, a.submitted.reasoning) for i in range(req.n)]

    def add(self, batch: list[Output]) -> None:
        for i, outs in by_choice(batch).items():
            self.choices[i].add(outs)

    def final(self) -> dict[str, Any]:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": now(), "model": self.model,
                "choices": [c.body() for c in self.choices], "usage": total_usage([c.last for c in self.choices]),
                "timings": timings(self.choices[0].last)}

    def opening(self) -> bytes:
        if self.kind != "chat":
            return b""
        return b"".join(self.ev.chunk(None, None, first=True, index=c.index) for c in self.choices)

    def events(self, batch: list[Output]) -> bytes:
        out = b"".join(self.ev.progress(o) for o in batch if o.progress is not None)
        for i, outs in by_choice(batch).items():
            out += self.choices[i].events(self.ev, outs, self._usage_if_last(i, outs[-1]))
        return out

    def _usage_if_last(self, i: int, last: Output) -> dict | None:
        """Without ``stream_options.include_usage`` the usage rides on the chunk that ends the
        last choice, as llama-server wrote it on its finishing chunk before it had the option
        (haystack, among others, reads it there): a client that asked for nothing still learns
        its token counts, and one that asked gets OpenAI's separate usage chunk instead."""
        if self.include_usage or last.finish_reason is None or last.failed:
            return None
        others = [c for c in self.choices if c.index != i]
        if not all(c.finished for c in others):
            return None
        return total_usage([last if c.index == i else c.last for c in self.choices])

    def closing(self) -> bytes:
        return (self.ev.usage([c.last for c in self.choices]) if self.include_usage else b"") + DONE

    def failed(self, status: int, message: str) -> bytes:
        return sse(openai_error(status, message)) + DONE


CHAT = Generate(("/v1/chat/completions", "/chat/completions"), ChatCompletionRequest, "chatcmpl-",
                lambda a: ChoicesShaper(a, "chat"), summary="OpenAI's chat completions")
COMPLETION = Generate(("/v1/completions", "/completions"), CompletionRequest, "cmpl-",
                      lambda a: ChoicesShaper(a, "completion"), summary="OpenAI's (legacy) completions")


ENDPOINTS = (CHAT, COMPLETION, EMBEDDINGS)


ROUTES = ()  # /v1/models: deployments/api/server_info.py
