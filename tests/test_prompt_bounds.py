"""Memory and time per request, bounded: a prompt that cannot fit a slot is refused from its
bytes before it is tokenised (and a chat template's rendering stops), a body's values are
counted before they are parsed and validated, the body is not kept once parsed (not for a
stream's life either), and prompts are made on bounded pools off the event loop, large bodies
apart from small ones. No timed assertion: each test holds the policy itself."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import tracemalloc
from typing import Any

import pytest

from deployments.api.anthropic import CountTokensRequest
from deployments.api.base import (
    MAX_ARRAY,
    MAX_JSON_CONTAINERS,
    MAX_JSON_STRINGS,
    ApiError,
    parse_body,
    read_request,
)
from deployments.api.llama import TokenizeRequest
from deployments.api.openai import ChatCompletionRequest, CompletionRequest
from deployments.api.values import Submitted
from engine.text.chat import Bound, ChatTemplate, TooLong
from engine.text.tokenizer import TokenLimit
from tests.fake_handle import FakeHandle, Streamed, fake_maker

SLOT = dict(n_ctx=512, n_parallel=2)  # 256 tokens a slot


def _no_tokenising(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.text.tokenizer as tok

    def refuse(*_: Any) -> int:
        raise AssertionError("tokenised a text its bytes show cannot fit")

    monkeypatch.setattr(tok.llama_cpp, "llama_tokenize", refuse)


def tool_call_body(argument: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                             "name": "f", "arguments": json.dumps({"x": argument})}}]},
                         {"role": "tool", "tool_call_id": "c", "content": "ok"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}


# ---- the prompt's length, from its bytes ----------------------------------------------------------


def test_a_prompt_no_slot_can_hold_is_refused_from_its_bytes_naming_the_limit(make_engine, monkeypatch):
    e = make_engine(**SLOT)
    most = e.tokenizer.max_token_bytes * e.slot_limit.n_tokens
    _no_tokenising(monkeypatch)
    for prompt in ("a" * (most + 1), "é" * (most // 2 + 1)):  # characters first, then bytes, show it
        with pytest.raises(TooLong, match=rf"a slot holds {e.n_ctx_slot} \(n_ctx / n_parallel\)") as err:
            e.tokenize_prompt(prompt)
        assert f"at most {e.tokenizer.max_token_bytes} bytes" in str(err.value)
    # a one-word tool-call argument: the template's rendering stops, nothing is tokenised
    req = ChatCompletionRequest.model_validate(tool_call_body("a" * 1_000_000))
    with pytest.raises(TooLong, match="the prompt the chat template makes is over"):
        req.prepare(e, "r1")
    with pytest.raises(TooLong, match=f"a slot holds {e.n_ctx_slot} "):  # count_tokens is refused as the request would be
        CountTokensRequest.model_validate({"messages": [{"role": "user", "content": "a" * 1_000_000}]}).run(e)
    with pytest.raises(TooLong, match=rf"whole context holds {2 * e.n_ctx_slot} \(n_ctx\)"):  # /tokenize: the whole context
        TokenizeRequest(content="a" * 900_000).run(e)


def test_a_prompt_at_the_bound_that_fits_is_served(make_engine):
    """The bound refuses only what cannot fit: a text of exactly the limit's tokens of the
    longest piece is as long in bytes as the bound allows, and is tokenised and taken."""
    e = make_engine(**SLOT)
    tok = e.tokenizer
    longest = max(range(tok.n_vocab), key=lambda t: len(tok.piece(t)))
    text = tok.piece(longest).decode() * (e.slot_limit.n_tokens - 1)  # and the BOS
    assert len(text.encode()) > tok.max_token_bytes * (e.slot_limit.n_tokens - 2)
    tokens = e.tokenize_prompt(text)
    assert len(tokens) <= e.slot_limit.n_tokens
    past = TokenLimit(len(tokens) - 1, "the test's limit")
    with pytest.raises(TooLong, match=f"the prompt is {len(tokens)} tokens but the test's limit"):
        tok.encode(text, limit=past)  # one token more than a limit: counted, not guessed


TRICKY = ["", " " * 5000, "\n" * 3000, "a" * 4000, "\x04\x06\x13" * 1000, "\U00040000" * 500, "é🙂" * 700,
          "<|im_start|>" * 300, "<start_of_turn>user\n" * 200, "The quick brown fox. " * 300]


def test_no_text_takes_fewer_tokens_than_its_bytes_allow(make_engine):
    """The bound's premise, on the synthetic vocabulary (the real ones: tests/real)."""
    tok = make_engine(**SLOT).tokenizer
    for text in TRICKY:
        n = len(tok.encode(text))
        assert tok._counted(text, text.encode()) <= tok.max_token_bytes * max(n, 1), text[:20]  # noqa: SLF001


def test_an_indented_tojson_stops_once_past_the_bound():
    """A template's ``tojson(indent=4)`` of a deeply nested value writes far more than the body
    held; a bounded render stops there instead of making it all."""
    t = ChatTemplate("{{ tools | tojson(indent=4) }}{% for m in messages %}{{ m.content }}{% endfor %}",
                     builtin=False, bos_token="", eos_token="", origin="test")
    deep: Any = [1] * 20_000
    for _ in range(60):
        deep = [deep]
    with pytest.raises(TooLong):
        t.render([{"role": "user", "content": "hi"}], tools=deep, bound=Bound(10_000))
    with pytest.raises(TooLong):
        t.render([{"role": "user", "content": "x" * 20_000}], tools=[], bound=Bound(10_000))
    assert t.render([{"role": "user", "content": "hi"}], tools=[1], bound=Bound(10_000)).endswith("hi")


# ---- a body's values, counted before they are parsed ----------------------------------------------


def test_a_body_of_too_many_values_is_refused_before_it_is_parsed(monkeypatch):
    import deployments.api.base as base

    def no_parse(*_: Any, **__: Any) -> Any:
        raise AssertionError("parsed a body its counts refuse")

    many_objects = b'{"messages": [' + b",".join([b"{}"] * (MAX_JSON_CONTAINERS + 1)) + b"]}"
    many_strings = b'{"stop": [' + b",".join([b'"ab"'] * (MAX_JSON_STRINGS + 1)) + b"]}"
    monkeypatch.setattr(base.json, "loads", no_parse)
    for raw, what in ((many_objects, "objects and arrays"), (many_strings, "strings")):
        with pytest.raises(ApiError, match=what) as err:
            parse_body(raw)
        assert err.value.status == 413
    monkeypatch.undo()
    # brackets and quotes inside strings are not values: such a body parses
    text = '{[" ' * (MAX_JSON_CONTAINERS + 10)
    assert parse_body(json.dumps({"prompt": text}).encode())["prompt"] == text


def test_a_long_array_is_taken_only_as_token_ids_in_a_field_of_them():
    ids = [7] * (MAX_ARRAY + 1)
    req, _ = read_request(CompletionRequest, parse_body(json.dumps({"prompt": ids}).encode()))
    assert req.prompt == ids
    with pytest.raises(ApiError, match="at most 65536, but for token ids"):
        parse_body(json.dumps({"prompt": ["a"] * (MAX_ARRAY + 1)}).encode())
    msg = {"role": "user", "content": "hi"}
    for body in ({"messages": [msg], "stop": ids}, {"messages": [{"role": "user", "content": ids}]}):
        with pytest.raises(ApiError, match=r"(stop|content): an array of 65537 items, at most 65536"):
            read_request(ChatCompletionRequest, body)


# ---- the body, not kept -------------------------------------------------------------------------


class _Engine(FakeHandle):
    """The ingress's handle to the engine: one output stream that says hello and then nothing
    (a stream that never ends), and a submit that takes every request."""

    deployment_name = "engine"

    def _outputs(self, *_: Any, **__: Any) -> Any:
        async def stream() -> Any:
            yield {"connected": "replica-1"}
            await asyncio.Event().wait()

        return Streamed(stream())

    async def _submit(self, conns: dict, req: Any, **_: Any) -> Submitted:
        return Submitted(3, 10, "replica-1", conns["replica-1"], 512)

    async def _cancel(self, *_: Any, **__: Any) -> bool:
        return True


async def _stalled_request(app: Any, path: str, body: bytes, answered: list[int]) -> None:
    """One request over ASGI, its body in 64 KiB chunks, whose client stops reading at the
    first byte of its answer and never leaves."""
    chunks = [body[i:i + 65536] for i in range(0, len(body), 65536)]

    async def receive() -> dict:
        if chunks:
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
        await asyncio.Event().wait()
        return {}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            answered.append(message["status"])
        elif message.get("body"):
            await asyncio.Event().wait()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    await app(scope, receive, send)


def test_no_body_is_kept_once_parsed_not_for_a_streams_life(monkeypatch):
    """Streams whose clients stopped reading, and requests waiting for their whole answer,
    hold no part of their bodies (the guard's copy, starlette's, the parsed text, the request)."""
    import deployments.ingress as ingress_module
    from deployments import router

    monkeypatch.setattr(router, "_KNOWN", {})
    cls = ingress_module.Ingress.func_or_class.__mro__[1]
    big = "a" * 4_000_000
    bodies = {
        "/v1/chat/completions": {"stream": True, **tool_call_body(big)},
        "/v1/completions": {"prompt": "x" + big[:900_000]},  # not streamed: waits for its whole answer
        "/v1/responses": {"stream": True, "input": "x" + big[:900_000]},
    }

    async def main() -> None:
        ing = object.__new__(cls)
        await cls.__init__(ing, _Engine(), ["m"])
        ing.client.makers._maker = fake_maker()  # noqa: SLF001 - the ingress makes the prompts (of a fake model)
        monkeypatch.setattr(ingress_module, "_CURRENT", [ing])  # the routes' Ingress (Serve's rewrite copies it)
        for path, obj in bodies.items():
            raw = json.dumps(obj).encode()
            gc.collect()
            tracemalloc.start()
            answered: list[int] = []
            tasks = [asyncio.create_task(_stalled_request(ingress_module.app, path, raw, answered)) for _ in range(3)]
            while len(ing.out.pending) < 3 or (path != "/v1/completions" and len(answered) < 3):
                await asyncio.sleep(0.01)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert answered == ([] if path == "/v1/completions" else [200] * 3), (path, answered)
            assert held < len(raw) // 4, f"{path}: {held} bytes held by 3 requests of {len(raw)}-byte bodies"
        for t in [ing.out.discover_task, *ing.out.pumps.values()]:
            t.cancel()

    asyncio.run(main())


# ---- off the loop, bounded, large apart from small ----------------------------------------------------


def test_prompts_are_made_on_bounded_pools_large_bodies_apart(make_engine):
    """A large body's prompt is made (in the ingress's engine client) on the one thread for
    large bodies: while it is held there, a small request's prompt is made, and the loop runs."""
    from concurrent.futures import ThreadPoolExecutor

    from deployments.client import LARGE_BODY_BYTES, PREPARE_THREADS, EngineClient
    from deployments.prompts import PromptMaker
    from deployments.resume import ResumeSettings

    maker = PromptMaker.of_engine(make_engine(n_parallel=2))
    release, entered = threading.Event(), threading.Event()
    threads: dict[str, str] = {}
    real = maker.make_request

    def make_request(prompt: Any, *a: Any, **kw: Any) -> Any:
        threads[prompt] = threading.current_thread().name
        if prompt == "large":
            entered.set()
            release.wait(30)
        return real(prompt, *a, **kw)

    maker.make_request = make_request  # type: ignore[method-assign]

    async def main() -> None:
        client = EngineClient(None, 1.0, None, ResumeSettings(), ThreadPoolExecutor(1))
        large = asyncio.create_task(client.run(CompletionRequest(prompt="large", max_tokens=2).prepare,
                                               LARGE_BODY_BYTES + 1, maker, "r1"))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        small = await client.run(CompletionRequest(prompt="small", max_tokens=2).prepare, 100, maker, "r2")
        assert small.request.id == "r2" and not large.done()
        release.set()
        assert (await large).request.id == "r1"
        assert threads["large"].startswith("prepare-large") and threads["small"].startswith("prepare_")
        assert client._prepare._max_workers == PREPARE_THREADS and client._prepare_large._max_workers == 1  # noqa: SLF001
        await client.close()

    asyncio.run(main())
