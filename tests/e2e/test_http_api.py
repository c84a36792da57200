"""The OpenAI API through Ray Serve over HTTP, with the model split over the RPC stage."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.models import SYNTHETIC_MMPROJ

APP = {
    "n_ctx": 2048,
    "n_parallel": 4,
    "pipeline_groups": 2,
    "n_threads": 1,
    "max_queued_requests": 64,
    "rpc": {"port": 50152, "threads": 1},
    "cors_origins": ["http://localhost:5173"],  # a listed web page (tests/e2e/test_guard_http.py)
    "mmproj": str(SYNTHETIC_MMPROJ),  # images (tests/e2e/test_images_http.py)
}


@pytest.fixture(scope="module")
def base(deploy) -> str:
    return deploy(APP)


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_health_models_and_slots(base, client):
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["synthetic.gguf"]
    slots = httpx.get(base + "/slots").json()
    assert [s["group"] for s in slots] == [0, 0, 1, 1]
    assert [s["seq_id"] for s in slots] == [0, 1, 0, 1]
    # each slot carries its group's prompt cache: one entry a slot by default, KV on both stages
    caches = [s["prompt_cache"] for s in slots]
    assert caches[0] == caches[1] and [c["capacity"] for c in caches] == [2] * 4, caches
    assert any(d.startswith("RPC") for d in caches[0]["bytes"]) and len(caches[0]["bytes"]) == 2
    assert set(caches[0]["invalidations"]) == {"evicted", "superseded"}


def test_completion(client):
    r = client.completions.create(model="synthetic.gguf", prompt="hello world", max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = client.completions.create(model="synthetic.gguf", prompt="hello world", max_tokens=8, temperature=0)
    assert again.choices[0].text == r.choices[0].text


def test_streamed_completion_equals_non_streamed(client):
    kw = {"model": "synthetic.gguf", "prompt": "tell me a story", "max_tokens": 16, "temperature": 0}
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_streamed_and_not(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(model="synthetic.gguf", messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    text = r.choices[0].message.content
    stream = client.chat.completions.create(
        model="synthetic.gguf", messages=msgs, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_sse_wire_format_ends_with_done(base):
    with httpx.stream(
        "POST", base + "/v1/completions",
        json={"prompt": "hello", "max_tokens": 4, "stream": True, "temperature": 0},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        json.loads(e[6:])


BAD = [
    ("malformed json", b"{not json", 400),
    ("invalid utf-8", b'{"prompt": "\xff\xfe"}', 400),
    ("not an object", b"[1, 2]", 400),
    ("missing prompt", {"max_tokens": 4}, 400),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -2}, 400),
    ("max_tokens 0", {"prompt": "hi", "max_tokens": 0}, 400),
    ("temperature out of range", {"prompt": "hi", "temperature": 5}, 400),
    ("wrong type", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("n of 0", {"prompt": "hi", "n": 0}, 400),
    ("n beyond a group's slots", {"prompt": "hi", "n": 3}, 400),
    ("logit_bias out of range", {"prompt": "hi", "logit_bias": {"5": 500}}, 400),
    ("logit_bias bad key", {"prompt": "hi", "logit_bias": {"x": 1}}, 400),
    ("huge max_tokens", {"prompt": "hi", "max_tokens": 10**12}, 400),
    ("prompt longer than the slot", {"prompt": "hello " * 3000, "max_tokens": 4}, 400),
    ("token ids out of range", {"prompt": [1, 2, 99999999]}, 400),
    ("grammar that does not parse", {"prompt": "hi", "grammar": 'root ::= ("a"'}, 400),
    ("schema that is not an object", {"prompt": "hi", "json_schema": [1, 2]}, 400),
    ("two structured-output fields", {"prompt": "hi", "grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, 400),
    ("unknown response_format", {"prompt": "hi", "response_format": {"type": "yaml"}}, 400),
    ("grammar with ignore_eos", {"prompt": "hi", "grammar": 'root ::= "a"', "ignore_eos": True}, 400),
]


@pytest.mark.parametrize("name, body, status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_4xx_and_the_server_keeps_serving(base, name, body, status):
    if isinstance(body, bytes):
        r = httpx.post(base + "/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(base + "/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    ok = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_chat_bad_input(base):
    for body in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]}, {"messages": "hi"}):
        r = httpx.post(base + "/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text


def test_oversized_body_is_413(base):
    r = httpx.post(base + "/v1/completions", content=b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413


def test_dropped_streams_free_their_slots(base):
    for _ in range(10):
        with httpx.stream("POST", base + "/v1/completions",
                          json={"prompt": "hello", "max_tokens": 500, "ignore_eos": True, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # leave mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        slots = httpx.get(base + "/slots").json()
        if all(not s["is_processing"] for s in slots):
            break
        time.sleep(0.2)
    assert all(not s["is_processing"] for s in slots), slots
    assert httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200


def test_structured_output_through_the_openai_sdk(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "w": {"enum": ["a", "b"]}},
              "required": ["n", "w"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="synthetic.gguf", messages=[{"role": "user", "content": "json please"}], max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
    )
    out = json.loads(r.choices[0].message.content)
    assert set(out) == {"n", "w"} and isinstance(out["n"], int) and out["w"] in ("a", "b")
    assert r.choices[0].finish_reason == "stop"
    # llama-server's grammar field, streamed; OpenAI's no-op fields are accepted
    chunks = list(client.completions.create(
        model="synthetic.gguf", prompt="answer", max_tokens=8, stream=True, user="u1",
        extra_body={"grammar": 'root ::= ("yes" | "no") "!"', "store": False, "metadata": {"k": "v"},
                    "service_tier": "auto"},
    ))
    assert "".join(c.choices[0].text for c in chunks) in ("yes!", "no!")
    # n_predict is llama-server's max_tokens
    r = client.completions.create(model="synthetic.gguf", prompt="count", extra_body={"n_predict": 3, "ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_llama_server_utility_routes(base):
    toks = httpx.post(base + "/tokenize", json={"content": "hello world"}).json()["tokens"]
    assert httpx.post(base + "/detokenize", json={"tokens": toks}).json()["content"].strip() == "hello world"
    r = httpx.post(base + "/apply-template", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and "hi" in r.json()["prompt"]
    props = httpx.get(base + "/props").json()
    assert props["total_slots"] == APP["n_parallel"] and props["pipeline_groups"] == APP["pipeline_groups"]
    assert httpx.post(base + "/detokenize", json={"tokens": "x"}).status_code == 400
    assert httpx.post(base + "/tokenize", content=b"{", headers={"content-type": "application/json"}).status_code == 400


def test_logprobs_through_the_openai_sdk(client):
    kw = {"model": "synthetic.gguf", "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=3, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6  # greedy takes the most likely
    assert "".join(t.token for t in content) == r.choices[0].message.content
    streamed = [t for c in client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=3, stream=True, **kw)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    # the same tokens; the figures within rounding (the second request reuses the first's cached prompt)
    assert [t.token for t in streamed] == [t.token for t in content]
    assert all(abs(a.logprob - b.logprob) < 0.02 for a, b in zip(streamed, content, strict=True))
    # completions: OpenAI's legacy shape
    c = client.completions.create(prompt="hello", logprobs=2, **kw).choices[0]
    assert "".join(c.logprobs.tokens) == c.text and len(c.logprobs.token_logprobs) == 6
    assert c.logprobs.text_offset == sorted(c.logprobs.text_offset) and all(len(t) == 2 for t in c.logprobs.top_logprobs)
    # not asked: null
    assert client.completions.create(prompt="hello", **kw).choices[0].logprobs is None


def test_llama_server_sampler_fields_over_http(base):
    body = {"prompt": "hello", "max_tokens": 6, "seed": 3, "temperature": 0.9, "ignore_eos": True, "typical_p": 0.8,
            "dry_multiplier": 0.5, "mirostat": 2, "samplers": ["penalties", "dry", "temperature"], "min_keep": 2}
    a = httpx.post(base + "/v1/completions", json=body, timeout=60)
    b = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert a.status_code == 200 and a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    # a sampler name llama-server does not know is skipped, as llama-server skips it
    assert httpx.post(base + "/v1/completions", json={**body, "samplers": ["nope", "temperature"]},
                      timeout=60).status_code == 200
    assert httpx.post(base + "/v1/completions", json={**body, "typical_p": 3}, timeout=60).status_code == 400


def test_echo_puts_the_prompt_first(client):
    kw = {"model": "synthetic.gguf", "max_tokens": 5, "temperature": 0}
    plain = client.completions.create(prompt="hello world", **kw).choices[0].text
    echoed = client.completions.create(prompt="hello world", echo=True, **kw).choices[0].text
    assert echoed == "hello world" + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt="hello world", echo=True, stream=True, **kw))
    assert streamed == echoed
    ids = client.completions.create(prompt=[306, 307], echo=True, **kw).choices[0].text
    assert ids.endswith(client.completions.create(prompt=[306, 307], **kw).choices[0].text) and len(ids) > 0


def test_llama_servers_completion_route(base):
    body = {"prompt": "tell me a story about", "n_predict": 8, "temperature": 0, "ignore_eos": True,
            "return_tokens": True}
    r = httpx.post(base + "/completion", json=body, timeout=60).json()
    assert r["stop"] is True and r["stop_type"] == "limit" and r["tokens_predicted"] == 8
    assert len(r["tokens"]) == 8 and r["tokens_evaluated"] > 0 and r["timings"]["predicted_n"] == 8
    assert httpx.post(base + "/detokenize", json={"tokens": r["tokens"]}).json()["content"] == r["content"]
    # streamed: content events, then the final object; no [DONE]
    events = []
    with httpx.stream("POST", base + "/completion", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == r["content"]
    assert [t for e in events for t in e.get("tokens", [])] == r["tokens"]
    # a stop word: the text before it, and which word it was
    word = r["content"][len(r["content"]) // 2:][:3]
    w = httpx.post(base + "/completion", json={**body, "stop": [word]}, timeout=60).json()
    assert w["stop_type"] == "word" and w["stopping_word"] == word and word not in w["content"]
    # per-request cache_prompt
    again = httpx.post(base + "/completion", json={**body, "cache_prompt": False}, timeout=60).json()
    assert again["tokens_cached"] == 0 and again["content"] == r["content"]
    # id_slot pins the slot
    for slot in (2, 1):
        pinned = httpx.post(base + "/completion", json={**body, "id_slot": slot}, timeout=60).json()
        assert pinned["id_slot"] == slot and pinned["content"] == r["content"]
    assert httpx.post(base + "/completion", json={**body, "id_slot": 4}, timeout=60).status_code == 400


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}},
]


def test_tool_calls_through_the_openai_sdk(client):
    """A model with random weights calls tools only because the grammar of tool_choice makes
    it: the calls come back parsed, streamed as deltas the SDK assembles, and a conversation
    that carries calls and results renders."""
    msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
    r = client.chat.completions.create(model="synthetic.gguf", messages=msgs, tools=TOOLS, max_tokens=300,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and isinstance(args["days"], int)

    # required, parallel off, streamed: the call streams as it is written, its id and name
    # first, then its arguments a piece at a time, which the SDK's own stream state assembles
    # (one tool: a prompt with both fills most of this app's 512-token slots on the synthetic vocabulary)
    stream = client.chat.completions.create(model="synthetic.gguf", messages=msgs, tools=TOOLS[1:], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=300, stream=True)
    chunks = list(stream)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_time" and {d.index for d in deltas} == {0}, chunks
    assert len(deltas) > 1 and not any(d.id or d.function.name for d in deltas[1:])
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(c)
    [streamed] = state.get_final_completion().choices[0].message.tool_calls
    assert json.loads(streamed.function.arguments)["zone"] in ("UTC", "CET")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # the calls and their results go back in the conversation; tool_choice none answers in text
    history = [*msgs, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="synthetic.gguf", messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_bad_tool_requests_are_400(base):
    for extra in ({"tools": [{"type": "function"}]}, {"tool_choice": "required"},
                  {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}):
        r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **extra})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_n_choices_through_the_openai_sdk(client, base):
    greedy = client.completions.create(model="synthetic.gguf", prompt="choices", max_tokens=12, temperature=0)
    r = client.completions.create(model="synthetic.gguf", prompt="choices", max_tokens=12, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [greedy.choices[0].text] * 2
    assert r.usage.prompt_tokens == greedy.usage.prompt_tokens
    assert r.usage.completion_tokens == 2 * greedy.usage.completion_tokens

    # streamed chat: chunks of both choices, each with its role, text and finish
    stream = client.chat.completions.create(model="synthetic.gguf", messages=[{"role": "user", "content": "hi"}],
                                            n=2, max_tokens=10, temperature=1.0, seed=5, stream=True,
                                            stream_options={"include_usage": True})
    text, finish, roles = {0: "", 1: ""}, {}, set()
    usage = None
    for c in stream:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            roles.update([ch.index] if ch.delta.role == "assistant" else [])
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert roles == {0, 1} and set(finish) == {0, 1} and all(text.values())
    assert usage.completion_tokens >= 2
    # the slots are free again
    assert all(not s["is_processing"] for s in httpx.get(base + "/slots").json())


def test_the_responses_api_through_the_openai_sdk(client, base):
    from openai.types.responses import Response as SdkResponse

    r = client.responses.create(model="synthetic.gguf", input="Say something.", instructions="Be brief.",
                                max_output_tokens=6, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    # the raw body validates as the SDK's own model
    raw = httpx.post(base + "/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Say something."}]}], "instructions": "Be brief.", "max_output_tokens": 6,
        "temperature": 0}, timeout=60).json()
    SdkResponse.model_validate(raw)
    assert raw["output"][0]["content"][0]["text"] == r.output_text  # the same prompt both ways
    # streamed: typed events, in order, whose deltas make the final text
    events = list(client.responses.create(model="synthetic.gguf", input="Say something.", instructions="Be brief.",
                                          max_output_tokens=6, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    # a JSON schema through text.format
    schema = {"type": "object", "properties": {"w": {"enum": ["a", "b"]}}, "required": ["w"], "additionalProperties": False}
    r = client.responses.create(model="synthetic.gguf", input="json", max_output_tokens=32,
                                text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}})
    assert r.status == "completed" and json.loads(r.output_text)["w"] in ("a", "b")
    for bad in ({"input": "x", "previous_response_id": "resp_1"}, {"input": "x", "tools": [{"type": "web_search"}]},
                {"input": [{"type": "image", "url": "x"}]}, {"input": "x", "max_output_tokens": 0}):
        assert httpx.post(base + "/v1/responses", json=bad, timeout=60).status_code == 400, bad


def test_two_salts_never_share_a_cached_token_over_http(base, client):
    """``cache_salt`` through the served app: /completion's ``tokens_cached`` and the OpenAI
    SDK's ``cached_tokens`` stay 0 across salts, and a salt reuses its own prefix."""
    prompt = "a tenant's private system prompt: " + " ".join(f"rule {k}" for k in range(30))
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0}
    first = httpx.post(base + "/completion", json={**body, "cache_salt": "tenant-a"}, timeout=60).json()
    other = httpx.post(base + "/completion", json={**body, "cache_salt": "tenant-b"}, timeout=60).json()
    plain = httpx.post(base + "/completion", json=body, timeout=60).json()
    own = httpx.post(base + "/completion", json={**body, "cache_salt": "tenant-a"}, timeout=60).json()
    assert first["tokens_cached"] == other["tokens_cached"] == 0
    assert plain["tokens_cached"] <= 1  # at most the BOS every unsalted prompt of this app begins with
    assert own["tokens_cached"] > 0 and own["content"] == first["content"] == other["content"]
    chat = [{"role": "user", "content": prompt}]
    a = client.chat.completions.create(model="m", messages=chat, max_tokens=4, temperature=0,
                                       extra_body={"cache_salt": "tenant-c"})
    b = client.chat.completions.create(model="m", messages=chat, max_tokens=4, temperature=0,
                                       extra_body={"cache_salt": "tenant-d"})
    assert a.usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens_details.cached_tokens == 0
    r = httpx.post(base + "/v1/completions", json={"prompt": "x", "cache_salt": ""}, timeout=60)
    assert r.status_code == 400, r.text
