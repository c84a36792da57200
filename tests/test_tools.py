"""Tool calling: template formats, the parser of each syntax, the streamed holder, the
forcing grammar on a model, and the request's checks."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from deployments.api.openai import ChatCompletionRequest
from engine import SamplingParams
from engine.text.tool_calls import ToolCallStream, parse_tool_calls
from engine.text.tools import ToolFormat, ToolPlan, detect_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer"},
                           "metric": {"type": "boolean"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
NAMES = ["get_weather", "get_time"]


@pytest.mark.parametrize(("source", "builtin", "fmt"), [
    ("chatml", True, ToolFormat.GENERIC),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", False, ToolFormat.GENERIC),
    ("{% if tools %}<tools>{{ tools | tojson }}</tools> use <tool_call>{% endif %}", False, ToolFormat.HERMES),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}{% endif %}[TOOL_CALLS]", False, ToolFormat.MISTRAL),
    ("<|start_header_id|>{% if tools %}{{ tools }}{% endif %}<|python_tag|>", False, ToolFormat.LLAMA3),
])
def test_the_template_tells_the_format(source, builtin, fmt):
    assert detect_format(source, builtin) is fmt


def calls_of(text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text, NAMES)
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_the_parser_reads_every_syntax():
    hermes = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n' \
             '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    assert calls_of(hermes) == ("Let me look.", [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})])
    mistral = '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}, {"name": "get_weather", "arguments": {}}]'
    assert calls_of(mistral) == ("", [("get_time", {"zone": "CET"}), ("get_weather", {})])
    assert calls_of('[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}') == ("", [("get_time", {"zone": "UTC"})])
    assert calls_of('{"name": "get_time", "parameters": {"zone": "UTC"}}') == ("", [("get_time", {"zone": "UTC"})])
    assert calls_of('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}') == ("", [("get_time", {"zone": "UTC"})])
    # an unclosed last block still counts when its JSON is whole (generation cut at the tag)
    assert calls_of('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}')[1] == [("get_time", {"zone": "UTC"})]


def test_text_that_only_looks_like_a_call_stays_content():
    for text in ('{"name": "rm_rf", "arguments": {}}',  # not one of the tools
                 '{"answer": 42}', "It is sunny.", "<tool_call>not json</tool_call>", "[TOOL_CALLS] nothing"):
        content, calls = calls_of(text)
        assert calls == [] and content == text.strip() or "not json" in content, (text, content, calls)


def test_the_stream_holds_only_what_can_be_a_call():
    s = ToolCallStream(NAMES)
    out = [s.feed(p) for p in ["The ", "weather: <to", "ol_call>\n{\"name\": \"get_time\", ",
                                "\"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>"]]
    assert "".join(out) == "The weather: " and out[1] == "weather: "
    content, calls = s.finish()
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_time"]
    # a held tail that turns out not to be a marker goes out with what follows
    s = ToolCallStream(NAMES)
    assert s.feed("a <to") == "a " and s.feed("olbox> b") == "<toolbox> b" and s.finish() == ("", [])
    # an answer that opens with JSON is held to the end, and given back when it is no call
    s = ToolCallStream(NAMES)
    assert s.feed(' {"answer":') == "" and s.feed(" 42}") == ""
    assert s.finish() == (' {"answer": 42}', [])  # verbatim


def test_parallel_tool_calls_false_keeps_one_call():
    s = ToolCallStream(NAMES, parallel=False)
    s.feed('<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    assert [c["function"]["name"] for c in s.finish()[1]] == ["get_time"]


@pytest.mark.parametrize("fmt", list(ToolFormat))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_the_forcing_grammar_gives_calls_that_validate(make_engine, fmt, choice):
    """Sampled on a model with random weights: only the grammar makes the output a call."""
    e = make_engine(n_parallel=2)
    plan = ToolPlan.make("", True, [WEATHER, TIME], choice, None)
    plan.format = fmt
    g = plan.grammar()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(4):
        c = e.generate("call a tool", SamplingParams(temperature=1.0, seed=seed, max_tokens=2000, grammar=g))
        assert c.final.finish_reason == "stop", c.text
        _, calls = parse_tool_calls(c.text, NAMES)
        assert calls, (fmt, c.text)
        for call in calls:
            name = call["function"]["name"]
            if isinstance(choice, dict):
                assert name == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])


def test_generic_templates_get_the_tools_in_a_system_message():
    plan = ToolPlan.make("chatml", True, [WEATHER], "auto", None)
    msgs = plan.messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ])
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.") and '"get_weather"' in msgs[0]["content"]
    assert '"arguments": {"city": "Oslo", "days": 1}' in msgs[2]["content"] and msgs[2]["content"].startswith("<tool_call>")
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert plan.template_tools() is None
    # tool_choice none: no tools offered anywhere
    assert ToolPlan.make("chatml", True, [WEATHER], "none", None).messages([{"role": "user", "content": "x"}]) == \
        [{"role": "user", "content": "x"}]


def test_jinja_templates_with_tools_get_them_and_the_calls_as_objects():
    plan = ToolPlan.make("{% if tools %}<tool_call>{% endif %}", False, [WEATHER, TIME],
                         {"type": "function", "function": {"name": "get_time"}}, None)
    assert plan.format is ToolFormat.HERMES and [t["function"]["name"] for t in plan.template_tools()] == ["get_time"]
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}], "tools": [TIME]})
    msgs = req.template_messages()
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    assert msgs[2] == {"role": "tool", "content": "12:00", "tool_call_id": "c1"}


@pytest.mark.parametrize(("body", "message"), [
    ({"tools": [{"type": "function"}]}, "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "function.name"),
    ({"tools": [WEATHER, WEATHER]}, "used twice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice 'always'"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not one of the tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]},
     "arguments is not JSON"),
])
def test_bad_tool_requests_are_refused_with_the_reason(body, message):
    with pytest.raises(ValidationError, match=message.replace("[", r"\[")):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
