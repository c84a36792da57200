"""Prefixes are private to a salt (``cache_salt``, as vLLM defines it): two salts never share a
cached token, in a slot, in another slot of the group, in the prompt cache or in the routing,
on the split with two groups. Nothing here is timed: the reuse counters (``cached_tokens``) say
what was reused. And a request's preserved tokens (a family's markup) reach its text."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.types import EngineRequest
from tests.test_prompt_cache import SYSTEM, user

P = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def run(e, prompt: list[int], salt: str = "", params: SamplingParams = P, preserved: tuple[int, ...] = ()):
    """One request to its end: its text and its final output."""
    r = e.accept(EngineRequest.of(f"r{id(prompt)}{salt}{len(prompt)}", prompt, params, cache_salt=salt,
                                  preserved=preserved))
    q = e.outputs.register(r.id)
    e.submit(r)
    texts = []
    while True:
        o = q.get(timeout=60)
        texts.append(o.text)
        if o.finish_reason is not None:
            return "".join(texts), o


@pytest.fixture
def split_engine(make_engine, rpc_endpoint):
    e = make_engine(n_parallel=4, pipeline_groups=2, n_ctx=4096, rpc_endpoints=[rpc_endpoint], peer_layers=2)
    yield e
    e.close()  # before the RPC server goes: a lost connection aborts the process


def test_the_same_prompt_under_another_salt_reuses_nothing_and_under_its_own_salt_reuses_its_prefix(split_engine):
    e = split_engine
    prompt = SYSTEM + user(1, 0)
    text_a, first = run(e, prompt, "tenant-a")
    assert first.cached_tokens == 0
    text_b, other = run(e, prompt, "tenant-b")
    assert other.cached_tokens == 0, "another salt's KV was reused"
    text_plain, unsalted = run(e, prompt)
    assert unsalted.cached_tokens == 0, "a salted request's KV was reused by an unsalted one"
    again, same = run(e, prompt, "tenant-a")
    assert same.cached_tokens >= len(SYSTEM), "the salt's own prefix was not reused"
    assert text_a == text_b == text_plain == again  # greedy: the salt changes what is reused, not the text


def test_a_shared_system_prompt_is_shared_only_within_a_salt(split_engine):
    e = split_engine
    for k in range(4):  # four conversations of one salt share the system prompt between slots and groups
        _, fin = run(e, SYSTEM + user(10 + k, 0), "shared")
        assert k == 0 or fin.cached_tokens >= len(SYSTEM) - 1
    for k in range(4):  # each of four other salts evaluates it whole
        _, fin = run(e, SYSTEM + user(20 + k, 0), f"alone-{k}")
        assert fin.cached_tokens == 0


def test_a_conversation_of_one_salt_taken_back_from_the_prompt_cache_is_not_another_salts(make_engine):
    e = make_engine(n_parallel=1, n_ctx=2048, prompt_cache_mib=256)  # room for every conversation here
    try:
        history = SYSTEM + user(0, 0)
        run(e, history, "a")
        run(e, user(5, 0), "a")  # takes the one slot: the first conversation goes to the prompt cache
        _, other = run(e, history + user(0, 1), "b")
        assert other.cached_tokens == 0
        run(e, user(6, 0), "a")
        _, own = run(e, history + user(0, 1), "a")
        assert own.cached_tokens >= len(history) - 1
        assert any(g.prefix.kept.stats().hits for g in e.groups if g.prefix.kept is not None)
    finally:
        e.close()


def test_the_scheduler_routes_no_salted_prompt_by_another_salts_prefix(make_engine):
    e = make_engine(n_parallel=2, pipeline_groups=2, n_ctx=2048)
    try:
        prompt = SYSTEM + user(3, 0)
        run(e, prompt, "a")
        held = {v.group: v.cache_salt for v in e.scheduler.views() if v.n_cached}
        assert set(held.values()) == {"a"}
        before = e.scheduler.n_elsewhere
        _, fin = run(e, prompt, "b")
        assert fin.cached_tokens == 0 and e.scheduler.n_elsewhere == before  # no affinity counted for b
    finally:
        e.close()


def test_preserved_special_tokens_are_rendered_as_text_and_others_not(make_engine):
    e = make_engine(n_parallel=1, n_ctx=512)
    try:
        tok = e.tokenizer.encode("<|im_start|>", add_special=False, parse_special=True)
        assert len(tok) == 1 and e.tokenizer.piece(tok[0], special=False) == b""
        forced = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={tok[0]: 100.0})
        shown, _ = run(e, user(1, 0, 8), params=forced, preserved=(tok[0],))
        hidden, _ = run(e, user(2, 0, 8), params=forced)
        assert shown == "<|im_start|>" * 3 and hidden == ""
    finally:
        e.close()


# ---- every API carries the salt; a key salts its requests ------------------------------------------

API_BODIES = [
    ("deployments.api.openai", "ChatCompletionRequest", {"messages": [{"role": "user", "content": "hi"}]}),
    ("deployments.api.openai", "CompletionRequest", {"prompt": "hi"}),
    ("deployments.api.llama", "LlamaCompletionRequest", {"prompt": "hi"}),
    ("deployments.api.anthropic", "MessagesRequest", {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 8}),
    ("deployments.api.responses", "ResponsesRequest", {"input": "hi"}),
]


@pytest.mark.parametrize(("module", "name", "body"), API_BODIES, ids=[n for _, n, _ in API_BODIES])
def test_every_api_takes_cache_salt_into_the_engines_request(module: str, name: str, body: dict) -> None:
    import importlib

    from tests.fake_handle import fake_maker

    cls = getattr(importlib.import_module(module), name)
    for salt, want in (("tenant-7", "tenant-7"), (None, "")):
        req = cls.model_validate({**body, **({"cache_salt": salt} if salt else {})})
        served = req.served_as() if hasattr(req, "served_as") else req
        assert served.prepare(fake_maker(), "r1").request.cache_salt == want


def test_an_empty_or_oversized_salt_is_the_requests_error() -> None:
    from pydantic import ValidationError

    from deployments.api.openai import CompletionRequest

    for bad in ("", "x" * 257, 5):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": "hi", "cache_salt": bad})


def _request(headers: dict[str, str], body: bytes):
    from starlette.requests import Request

    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": raw}, receive)


def test_salting_by_api_key_keeps_each_keys_prompts_apart_and_names_no_key() -> None:
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from deployments.api.openai import CompletionRequest
    from deployments.errors import ApiError
    from deployments.reader import RequestReader

    reader = RequestReader(["key-a", "key-b"], False, ["m"], ThreadPoolExecutor(1), salt_by_key=True)

    def salt_of(key: str, body: bytes = b'{"prompt": "hi"}') -> str:
        req, _ = asyncio.run(reader.read(_request({"Authorization": f"Bearer {key}"}, body), CompletionRequest))
        return req.cache_salt

    a, b = salt_of("key-a"), salt_of("key-b")
    assert a != b and a == salt_of("key-a") and "key-a" not in a
    assert salt_of("key-a", b'{"prompt": "hi", "cache_salt": "s"}').endswith("/s")  # the request's own salt within the key's
    with pytest.raises(ApiError):
        salt_of("key-c")
    plain = RequestReader("key-a", False, ["m"], ThreadPoolExecutor(1))
    req, _ = asyncio.run(plain.read(_request({"x-api-key": "key-a"}, b'{"prompt": "hi"}'), CompletionRequest))
    assert req.cache_salt is None  # without salt_by_key a key salts nothing
