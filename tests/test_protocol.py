"""Request bodies as llama-server's and OpenAI's clients write them: unknown fields, nulls,
llama-server's names and values (no engine, no Ray)."""

from __future__ import annotations

import json

import pytest

from deployments.api.base import read_request
from deployments.api.generation import timings
from deployments.api.llama import LlamaCompletionRequest, completion_probabilities
from deployments.api.openai import ChatCompletionRequest, CompletionRequest, SseEvents
from deployments.api.responses import ResponsesRequest
from engine.types import Delta, Finish, FinishReason, Output


def test_unknown_fields_are_ignored_and_named_or_refused_when_strict():
    body = {"prompt": "x", "frobnicate": 1, "return_progress": True, "timings_per_token": True, "mystery": {"a": 1}}
    req, unknown = read_request(CompletionRequest, body)
    assert req.prompt == "x" and sorted(unknown) == ["frobnicate", "mystery"]  # llama-server's own are known
    with pytest.raises(ValueError, match="unknown fields .*frobnicate.*mystery"):
        read_request(CompletionRequest, body, strict=True)
    req, unknown = read_request(CompletionRequest, {"prompt": "x", "stream": False}, strict=True)
    assert unknown == []


def test_null_means_the_default_for_every_field():
    req, _ = read_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "n": None,
                                                   "stream": None, "ignore_eos": None, "cache_prompt": None,
                                                   "temperature": None, "stop": None, "id_slot": None})
    assert req.n == 1 and req.stream is False and req.ignore_eos is False and req.cache_prompt is True
    assert req.id_slot == -1 and req.sampling(16).temperature == 0.8
    r, _ = read_request(ResponsesRequest, {"input": "hi", "include": [], "stream": None, "tools": None})
    assert r.to_chat().messages[0].content == "hi"


@pytest.mark.parametrize("field", ["max_tokens", "n_predict"])
def test_minus_one_tokens_is_until_the_context_is_full(field):
    req = CompletionRequest.model_validate({"prompt": "x", field: -1})
    assert req.sampling(777).max_tokens == 777
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "max_completion_tokens": -1, "max_tokens": 5})
    assert chat.sampling(777, chat.max_completion_tokens).max_tokens == 5
    zero = CompletionRequest.model_validate({"prompt": "x", field: 0})
    if field == "n_predict":  # llama-server's: evaluate and cache the prompt, generate nothing
        assert zero.sampling(10).max_tokens == 0
    else:
        with pytest.raises(ValueError, match="at least 1"):
            zero.sampling(10)


def test_llama_servers_sampler_letters_and_names():
    req = CompletionRequest.model_validate({"prompt": "x", "samplers": "edkypmxt", "typ_p": 0.5})
    p = req.sampling(8)
    assert p.order == ("penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
    assert p.typical_p == 0.5
    assert CompletionRequest.model_validate({"prompt": "x", "samplers": "kq?t"}).sampling(8).order == ("top_k", "temperature")
    vscode = CompletionRequest.model_validate({"prompt": "x", "samplers": ["top_k", "top_p", "infill", "nope"]})
    assert vscode.sampling(8).order == ("top_k", "top_p", "infill")  # llama.vscode's; unknown names skipped
    assert CompletionRequest.model_validate({"prompt": "x", "samplers": ["top_k"]}).sampling(8).order == ("top_k",)
    p = CompletionRequest.model_validate({"prompt": "x", "t_max_predict_ms": 250}).sampling(8)
    assert p.t_max_predict_ms == 250


def test_cache_prompt_is_taken_on_every_route():
    for cls, body in ((CompletionRequest, {"prompt": "x"}), (LlamaCompletionRequest, {"prompt": "x"}),
                      (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})):
        assert cls.model_validate({**body, "cache_prompt": False}).cache_prompt is False


def _final(**kw) -> Output:
    base = dict(request_id="r", text="", n_tokens=1, finish_reason=FinishReason.STOP, prompt_tokens=10,
                completion_tokens=5, cached_tokens=4, t_queue=0.1, t_first_token=0.6, t_end=1.6)
    return Finish(**{**base, **kw})


def test_timings_are_llama_servers():
    t = timings(_final())
    assert t["prompt_n"] == 6 and t["cache_n"] == 4 and t["predicted_n"] == 5
    assert t["prompt_ms"] == pytest.approx(500) and t["prompt_per_second"] == pytest.approx(12)
    assert t["predicted_ms"] == pytest.approx(1000) and t["predicted_per_second"] == pytest.approx(4)
    assert t["predicted_per_token_ms"] == pytest.approx(250)


def test_completion_probabilities_are_llama_servers():
    o = _final(tokens=(7, 9), logprobs=((b"a", -0.1, ((b"a", -0.1), (b"b", -2.0))), (b"\xc3", -0.5, ())))
    p = completion_probabilities(o)
    assert p[0] == {"id": 7, "token": "a", "bytes": [97], "logprob": -0.1,
                    "top_logprobs": [{"token": "a", "bytes": [97], "logprob": -0.1},
                                     {"token": "b", "bytes": [98], "logprob": -2.0}]}
    assert p[1]["id"] == 9 and p[1]["bytes"] == [0xC3] and p[1]["top_logprobs"] == []
    assert completion_probabilities(_final()) == []


def test_response_fields_pick_and_unnest():
    from deployments.api.llama import pick_fields

    body = {"content": "x", "stop": True, "timings": {"prompt_n": 3}, "generation_settings": {"n_ctx": 512}}
    assert pick_fields(body, ["content", "timings/prompt_n", "generation_settings/n_ctx", "missing", "content/x"]) == \
        {"content": "x", "prompt_n": 3, "n_ctx": 512}
    assert pick_fields(body, None) is body


def test_responses_tools_and_their_items_become_the_chat_request():
    from deployments.api.base import ApiError, read_request

    body = {"input": [{"role": "user", "content": "weather?"},
                      {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "w", "arguments": "{\"c\": 1}",
                       "status": "completed"},
                      {"type": "function_call", "call_id": "call_b", "name": "w", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
                      {"type": "function_call_output", "call_id": "call_b",
                       "output": [{"type": "input_text", "text": "rain"}]},
                      {"type": "reasoning", "summary": []}],
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}, "strict": True}],
            "tool_choice": {"type": "function", "name": "w"}, "parallel_tool_calls": False}
    chat = read_request(ResponsesRequest, body)[0].to_chat()
    msgs = chat.template_messages()
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["call_a", "call_b"]  # one turn's calls: one message
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"c": 1} and msgs[3]["content"] == "rain"
    assert chat.tools[0]["function"]["name"] == "w" and chat.tool_choice == {"type": "function", "function": {"name": "w"}}
    assert chat.parallel_tool_calls is False
    for bad, where in (({"tools": [{"type": "web_search"}]}, "tools[0]"), ({"tool_choice": "sometimes"}, "tool_choice"),
                       ({"input": [{"type": "image_generation_call"}]}, "input[0]")):
        with pytest.raises(ApiError, match=where.replace("[", r"\[").replace("]", r"\]")):
            read_request(ResponsesRequest, {"input": "x", **bad})


def _events(raw: bytes) -> list[dict]:
    import json

    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_responses_answer_with_tool_calls_in_openais_own_types(streamed):
    """Each event and the response validate against the openai SDK's own models, strictly."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    from deployments.api.base import Answer, read_request
    from deployments.api.responses import ResponsesShaper
    from deployments.api.values import Submitted, ToolSettings

    req = read_request(ResponsesRequest, {"input": "x", "stream": streamed, "tools": [
        {"type": "function", "name": "w", "parameters": {"type": "object"}, "strict": False}]})[0]
    sub = Submitted(3, 20, "r", "c", 512, tools=ToolSettings(("w",), True))
    shaper = ResponsesShaper(Answer("resp_abc", "m", req, req.to_chat(), sub))
    pieces = ["Let me see. <tool_", 'call>{"name": "w", "arguments": {"c": 1}}</tool_call>',
              '<tool_call>{"name": "w", "arguments": {}}</tool_call>']
    outs: list[Output] = [Delta("resp_abc", t, 1) for t in pieces[:-1]]
    outs.append(Finish("resp_abc", pieces[-1], 1, FinishReason.STOP, prompt_tokens=3, completion_tokens=3))
    if streamed:
        raw = shaper.opening() + b"".join(shaper.events([o]) for o in outs) + shaper.closing()
        events = _events(raw)
        for e in events:
            TypeAdapter(ResponseStreamEvent).validate_python(e, strict=False)
        kinds = [e["type"] for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert kinds.count("response.function_call_arguments.done") == 2
        body = events[-1]["response"]
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert "tool_call" not in deltas and deltas.strip() == "Let me see."
    else:
        shaper.add(outs)
        body = shaper.final()
    r = Response.model_validate(body)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["w", "w"] and [c.arguments for c in calls] == ['{"c": 1}', "{}"]
    assert r.output[0].type == "message" and r.output[0].content[0].text.strip() == "Let me see."
    assert r.status == "completed" and r.tools[0].name == "w"


def test_sse_events_encode_as_openai_chunks():
    for kind in ("completion", "chat"):
        ev = SseEvents("id-1", kind, "m", include_usage=True)
        raw = ev.chunk('a "quoted" é\n', None)
        assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
        d = json.loads(raw[6:])
        assert d["id"] == "id-1" and d["model"] == "m" and d["usage"] is None
        c = d["choices"][0]
        assert c["finish_reason"] is None and c["index"] == 0
        text = c["delta"]["content"] if kind == "chat" else c["text"]
        assert text == 'a "quoted" é\n'
        assert d["object"] == ("chat.completion.chunk" if kind == "chat" else "text_completion")
        last = json.loads(ev.chunk("x", "stop")[6:])
        assert last["choices"][0]["finish_reason"] == "stop"


def _stream(include_usage: bool, n: int) -> list[dict]:
    """A streamed chat answer of ``n`` choices, as SSE chunk objects."""
    from types import SimpleNamespace

    from deployments.api.openai import ChoicesShaper

    run = SimpleNamespace(include_usage=include_usage, n=n, n_logprobs=lambda: None)
    answer = SimpleNamespace(run=run, rid="id-1", model="m", submitted=SimpleNamespace(tools=None, reasoning=None))
    shaper = ChoicesShaper(answer, "chat")
    rids = ["id-1"] + [f"id-1#{i}" for i in range(1, n)]
    raw = shaper.opening() + b"".join(shaper.events([Delta(rid, "ab", 1)])
                                      for rid in rids)
    for rid in rids:  # the choices end one after the other
        raw += shaper.events([Finish(rid, "c", 1, FinishReason.STOP, prompt_tokens=3, completion_tokens=2)])
    raw += shaper.closing()
    return [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]


@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_without_include_usage_has_its_usage_on_the_last_finishing_chunk(n):
    """As llama-server wrote it before it had stream_options (haystack reads it there); with
    include_usage, OpenAI's usage chunk (no choices) instead, and no usage anywhere else."""
    chunks = _stream(False, n)
    with_usage = [c for c in chunks if c.get("usage")]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1], chunks
    assert with_usage[0]["choices"][0]["finish_reason"] == "stop"
    assert with_usage[0]["usage"]["prompt_tokens"] == 3 and with_usage[0]["usage"]["completion_tokens"] == 2 * n
    asked = _stream(True, n)
    assert [c for c in asked if c.get("usage")] == [asked[-1]] and asked[-1]["choices"] == []
    assert asked[-1]["usage"] == with_usage[0]["usage"]
