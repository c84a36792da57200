"""The body boundary (deployments/api/base.py) and the HTTP guard (deployments/guard.py), with no
engine and no Ray: whatever a body holds ends in the request or a 400 naming what is wrong;
no answer carries NaN or Infinity; the guard refuses foreign hosts and origins, slow bodies
and one address's flood, and lets the rest through."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployments import api
from deployments.api.anthropic import CountTokensRequest, MessagesRequest
from deployments.api.base import (
    MAX_FIELD_NAME,
    MAX_UNKNOWN_PER_BODY,
    ApiError,
    dumps,
    parse_body,
    read_request,
)
from deployments.api.llama import (
    ApplyTemplateRequest,
    LlamaCompletionRequest,
    completion_probabilities,
)
from deployments.api.openai import ChatCompletionRequest
from deployments.api.responses import ResponsesRequest
from deployments.guard import Guard, GuardSettings, same_origin

# ---- the bodies that gave 500s ------------------------------------------------------------------

WRONG_SHAPES = [
    ("a tool_result whose content is a number", MessagesRequest,
     {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                  "content": 5}]}]}, "messages[0].content[0]"),
    ("the same in count_tokens", CountTokensRequest,
     {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}]},
     "messages[0].content[0]"),
    ("a chat message whose tool_calls is a number", ChatCompletionRequest,
     {"messages": [{"role": "assistant", "content": "", "tool_calls": 5}]}, "tool_calls"),
    ("the same in /apply-template", ApplyTemplateRequest,
     {"messages": [{"role": "assistant", "content": "", "tool_calls": 5}]}, "tool_calls"),
    ("a tool call that is not an object", ChatCompletionRequest,
     {"messages": [{"role": "assistant", "content": "", "tool_calls": [7]}]}, "tool_calls"),
    ("a Responses content part that is not an object", ResponsesRequest,
     {"input": [{"role": "user", "content": ["hi"]}]}, "input[0].content[0]"),
    ("a Responses text.format that is not an object", ResponsesRequest,
     {"input": "hi", "text": {"format": "json"}}, "text.format"),
    ("a Messages content block that is not an object", MessagesRequest,
     {"max_tokens": 4, "messages": [{"role": "user", "content": [3]}]}, "messages[0].content[0]"),
]


@pytest.mark.parametrize("what, model, body, names", WRONG_SHAPES, ids=[w[0] for w in WRONG_SHAPES])
def test_a_body_of_the_wrong_shape_is_a_400_that_names_the_field(what, model, body, names):
    with pytest.raises(ApiError) as e:
        read_request(model, body)
    assert e.value.status == 400 and names in e.value.message, (what, e.value.message)


@pytest.mark.parametrize("raw", [
    b'{"input": "hi", "text": {"format": {"type": "text"}, "x": NaN}}',
    b'{"input": "hi", "text": {"v": Infinity}}',
    b'{"prompt": "x", "temperature": -Infinity}',
    b'{"prompt": "x", "top_p": 1e999}',
])
def test_non_finite_numbers_in_a_body_are_refused(raw):
    with pytest.raises(ApiError, match="finite|not JSON"):
        parse_body(raw)


def test_no_answer_carries_nan_or_infinity():
    """A log probability of minus infinity is written as OpenAI and vLLM write it."""
    text = dumps({"logprob": float("-inf"), "p": [float("inf"), float("nan"), 0.5], "ok": "é"})
    assert json.loads(text) == {"logprob": -9999.0, "p": [9999.0, None, 0.5], "ok": "é"}
    assert "Infinity" not in text and "NaN" not in text

    class Out:  # an output whose chosen token the chain had removed: post_sampling_probs at temperature ~0
        tokens = [5]
        logprobs = [(b"a", float("-inf"), ((b"a", float("-inf")), (b"b", 0.0)))]

    for post in (False, True):
        body = dumps({"completion_probabilities": completion_probabilities(Out(), post)})
        assert "Infinity" not in body and "NaN" not in body
        json.loads(body)


def test_unknown_field_names_are_cut_before_they_are_kept():
    body = {"prompt": "x", **{f"{i}" + "n" * 6_000_000 if i == 0 else f"field{i}": 1 for i in range(300)}}
    _, unknown = read_request(LlamaCompletionRequest, body)
    assert len(unknown) == MAX_UNKNOWN_PER_BODY and max(map(len, unknown)) <= MAX_FIELD_NAME


# ---- every route's model, fuzzed ------------------------------------------------------------------

# one body each endpoint takes, to mutate
VALID: dict[str, dict[str, Any]] = {
    "ChatCompletionRequest": {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                           {"role": "assistant", "content": "", "tool_calls": [
                                               {"id": "c", "type": "function",
                                                "function": {"name": "f", "arguments": "{}"}}]},
                                           {"role": "tool", "tool_call_id": "c", "content": "1"}],
                              "max_tokens": 2, "tools": [{"type": "function", "function": {"name": "f",
                                                                                            "parameters": {}}}],
                              "response_format": {"type": "text"}, "stop": ["x"], "logit_bias": {"1": 1.0}},
    "CompletionRequest": {"prompt": "hi", "max_tokens": 2, "logprobs": 1, "samplers": ["top_k", "temperature"],
                          "dry_sequence_breakers": ["\n"], "stream_options": {"include_usage": True}},
    "LlamaCompletionRequest": {"prompt": "hi", "n_predict": 2, "n_probs": 1, "response_fields": ["content"],
                               "logit_bias": [[1, False]], "seed": -1},
    "InfillRequest": {"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": "c", "filename": "d"}],
                      "n_predict": 2},
    "ResponsesRequest": {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                         "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
                         "max_output_tokens": 2},
    "MessagesRequest": {"max_tokens": 2, "system": [{"type": "text", "text": "s"}], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text",
                                                                                            "text": "1"}]}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "auto"}},
    "CountTokensRequest": {"messages": [{"role": "user", "content": "hi"}]},
    "EmbeddingRequest": {"input": ["a", "b"]},
    "TokenizeRequest": {"content": "hi", "with_pieces": True},
    "DetokenizeRequest": {"tokens": [1, 2]},
    "ApplyTemplateRequest": {"messages": [{"role": "user", "content": "hi"}]},
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _paths(node: Any, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


def _replace(node: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    copy = dict(node) if isinstance(node, dict) else list(node)
    copy[head] = _replace(node[head], rest, value)
    return copy


@st.composite
def mutated(draw: Any) -> tuple[type, dict]:
    model = draw(st.sampled_from(sorted({ep.request for ep in api.ENDPOINTS}, key=lambda m: m.__name__)))
    body = VALID[model.__name__]
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(body) if p]
        if paths:
            body = _replace(body, draw(st.sampled_from(paths)), draw(json_values))
    return model, body


def test_every_endpoints_model_has_a_valid_example():
    for ep in api.ENDPOINTS:
        read_request(ep.request, VALID[ep.request.__name__])


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=mutated())
def test_whatever_a_body_holds_it_is_read_or_refused_with_a_400(case):
    model, body = case
    try:
        req, _ = read_request(model, body)
    except ApiError as e:
        assert 400 <= e.status < 500 and e.message
        return
    dumps(req.model_dump(mode="json"))  # what was read can be written back


# ---- the guard ----------------------------------------------------------------------------------


async def _app(scope: dict, receive: Any, send: Any) -> None:
    """Stands for the ingress: reads the body, answers its length."""
    n = 0
    while True:
        m = await receive()
        n += len(m.get("body", b""))
        if not m.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(n).encode()})


def _call(guard: Guard, method: str = "POST", host: str = "127.0.0.1:8000", origin: str | None = None,
          ctype: str = "application/json", server: str = "127.0.0.1", client: str = "127.0.0.1",
          chunks: list[bytes] | None = None, stall: bool = False) -> tuple[int, dict, bytes]:
    headers = [(b"host", host.encode()), (b"content-type", ctype.encode())]
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    scope = {"type": "http", "method": method, "path": "/v1/completions", "headers": headers,
             "server": (server, 8000), "client": (client, 40000)}
    parts = list(chunks if chunks is not None else [b"{}"])
    sent: list[dict] = []

    async def receive() -> dict:
        if parts:
            body = parts.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(parts) or stall}
        await asyncio.sleep(3600)  # a client that never sends the rest
        return {"type": "http.disconnect"}

    async def send(m: dict) -> None:
        sent.append(m)

    asyncio.run(guard(scope, receive, send))
    start = sent[0]
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, sent[1]["body"]


def _guard(**kw: Any) -> Guard:
    s = GuardSettings(**kw)
    return Guard(_app, lambda: s)


def test_loopback_without_a_key_serves_loopback_host_names_only():
    g = _guard()
    for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "app.localhost", "127.0.0.2"):
        assert _call(g, host=host)[0] == 200, host
    status, _, body = _call(g, host="rebind.example:8000")
    assert status == 403 and "Host" in json.loads(body)["error"]["message"]
    assert _call(_guard(allowed_hosts=("rebind.example",)), host="rebind.example:8000")[0] == 200
    assert _call(_guard(keyless=False), host="rebind.example:8000")[0] == 200  # the key protects it
    assert _call(g, host="served.example", server="10.0.0.5")[0] == 200  # not reached on loopback


def test_foreign_origins_are_refused_and_listed_ones_get_cors():
    g = _guard()
    assert _call(g, origin="http://127.0.0.1:8000")[0] == 200  # the server's own page
    status, _, body = _call(g, origin="https://evil.example", ctype="text/plain")
    assert status == 403 and "origin" in json.loads(body)["error"]["message"]
    listed = _guard(cors_origins=("http://localhost:5173",))
    status, headers, _ = _call(listed, origin="http://localhost:5173")
    assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:5173"
    status, headers, _ = _call(listed, method="OPTIONS", origin="http://localhost:5173")
    assert status == 200  # not a preflight without Access-Control-Request-Method: the app answers
    assert _call(listed, origin="http://localhost:5174")[0] == 403


def test_a_browser_post_must_be_json():
    status, _, _ = _call(_guard(), origin="http://127.0.0.1:8000", ctype="text/plain")
    assert status == 415
    assert _call(_guard(), ctype="text/plain")[0] == 200  # no Origin: curl, an SDK


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_a_large_one_a_413():
    g = _guard(body_timeout_s=0.3)
    status, headers, body = _call(g, chunks=[b'{"prompt": '], stall=True)
    assert status == 408 and headers.get("connection") == "close" and b"in time" in body
    assert _call(g, chunks=[b'{"prompt": ', b'"x"}'])[0] == 200
    status, _, _ = _call(_guard(max_body_bytes=1024), chunks=[b"x" * 600, b"x" * 600])
    assert status == 413


def test_one_address_cannot_hold_every_place():
    s = GuardSettings(max_requests_per_client=3, body_timeout_s=5.0)
    g = Guard(_app, lambda: s)

    async def main() -> list[int]:
        stalled = [asyncio.create_task(asyncio.to_thread(_call, g, client="127.0.0.2", chunks=[b"{"], stall=True))
                   for _ in range(3)]
        await asyncio.sleep(0.5)
        other = await asyncio.to_thread(_call, g, client="127.0.0.3")
        flood = await asyncio.to_thread(_call, g, client="127.0.0.2")
        for t in stalled:
            t.cancel()
        return [other[0], flood[0]]

    # each _call runs its own loop in a thread: the guard's table is shared, as in one replica
    other, flood = asyncio.run(main())
    assert other == 200 and flood == 429


def test_every_client_together_cannot_pass_the_ingress_bound():
    """Served directly (no Serve proxy to queue them), the ingress holds at most
    ``max_requests`` in flight from every address together: the next gets a 503 at once."""
    s = GuardSettings(max_requests=2, body_timeout_s=5.0)
    g = Guard(_app, lambda: s)

    async def main() -> tuple[int, dict, int]:
        stalled = [asyncio.create_task(asyncio.to_thread(_call, g, client=f"127.0.0.{i}", chunks=[b"{"], stall=True))
                   for i in (2, 3)]
        await asyncio.sleep(0.5)
        status, headers, _ = await asyncio.to_thread(_call, g, client="127.0.0.4")
        for t in stalled:
            t.cancel()
        await asyncio.sleep(0)
        return status, headers, g.total

    status, headers, in_flight = asyncio.run(main())
    assert status == 503 and headers.get("retry-after") == "1" and in_flight == 2
    assert s.refused.get("503") == 1


def test_same_origin_compares_scheme_default_ports():
    assert same_origin("http://localhost", "localhost:80") and same_origin("http://h:8000", "H:8000")
    assert not same_origin("http://h:8001", "h:8000") and not same_origin("null", "h:8000")


def test_the_http_layer_never_loads_llama_cpp():
    """Importing the ingress and the app builder loads no native code: configs and requests are
    read without it (the ingress maps llama.cpp's tokenizer only when it makes its first prompt:
    the model's vocabulary, no weights, no device)."""
    code = ("import sys, deployments.ingress, deployments.app, engine.config, engine\n"
            "engine.SamplingParams, engine.RequestError, engine.Output\n"
            "assert 'llama_cpp' not in sys.modules, sorted(m for m in sys.modules if m.startswith('engine'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_an_error_answer_crosses_ray_whole_and_tells_when_to_retry():
    """The one error type is raised in the ingress and returned by an engine replica across Ray
    (pickled): status, message, field and headers arrive as they left."""
    import pickle

    e = pickle.loads(pickle.dumps(ApiError(400, "bad", "messages")))
    assert (e.status, e.message, e.param, e.headers, e.type) == (400, "bad", "messages", None, "invalid_request_error")
    busy = pickle.loads(pickle.dumps(ApiError(429, "full")))
    assert busy.headers == {"Retry-After": "1"} and isinstance(busy, ValueError)
    assert ApiError(503, "x", headers={"Retry-After": "2"}).headers == {"Retry-After": "2"}
