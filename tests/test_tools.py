"""Tool calling: template formats, the parser of each syntax, the streamed holder, the
forcing grammar on a model, and the request's checks."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest
from pydantic import ValidationError

from deployments.api.openai import ChatCompletionRequest
from engine import SamplingParams
from engine.text.call_args import calls_of as joined_calls
from engine.text.harmony import parse_harmony
from engine.text.tool_calls import ToolCallStream, arg_types, parse_tool_calls
from engine.text.tools import FORMAT_TOKENS, ToolFormat, ToolPlan, detect_format
from tests.conftest import engine_factory
from tests.models.synthetic import write_model

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
    # the space before a call is held (the whole reading strips it), the text before it goes out
    assert "".join(out) == "The weather:" and out == ["The", " weather:", "", ""]
    content, parts = s.finish()
    assert content == "" and [c["function"]["name"] for c in joined_calls(parts)] == ["get_time"]
    # a held tail that turns out not to be a marker goes out with what follows
    s = ToolCallStream(NAMES)
    assert s.feed("a <to") == "a" and s.feed("olbox> b") == " <toolbox> b" and s.finish() == ("", [])
    # an answer that opens with JSON is held to the end, and given back when it is no call
    s = ToolCallStream(NAMES)
    assert s.feed(' {"answer":') == "" and s.feed(" 42}") == ""
    assert s.finish() == (' {"answer": 42}', [])  # verbatim


def test_parallel_tool_calls_false_keeps_one_call():
    s = ToolCallStream(NAMES, parallel=False)
    s.feed('<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    assert [c["function"]["name"] for c in joined_calls(s.finish()[1])] == ["get_time"]


MARKUP = tuple(dict.fromkeys(t for ts in FORMAT_TOKENS.values() for t in ts))


@pytest.fixture(scope="module")
def markup_model(tmp_path_factory, small_shape):
    """A small synthetic model whose vocabulary holds every format's markup as control tokens
    and adds no space before a text, as the families' own (BPE) vocabularies: a forced text
    after a special token is not tokenised with a leading space (docs/models.md, Limits)."""
    path = write_model(tmp_path_factory.mktemp("markup") / "markup.gguf",
                       replace(small_shape, n_vocab=2048, space_prefix=False, extra=(*MARKUP, "<|channel|>", "<|constrain|>", "<|message|>")))
    engines = engine_factory(model=str(path), n_threads=1, n_parallel=2)
    yield next(engines)()
    next(engines, None)  # closes the engine


SYNTAX = {ToolFormat.HERMES: "<tool_call>\n{", ToolFormat.GENERIC: "<tool_call>\n{", ToolFormat.MISTRAL: "[TOOL_CALLS][",
          ToolFormat.LLAMA3: "{", ToolFormat.QWEN3_CODER: "<tool_call>\n<function=get_", ToolFormat.GLM45: "<tool_call>get_",
          ToolFormat.DEEPSEEK_V31: "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_",
          ToolFormat.KIMI_K2: "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_",
          ToolFormat.HARMONY: "<|channel|>commentary to=functions.get_"}


@pytest.mark.parametrize("fmt", [f for f in ToolFormat if f is not ToolFormat.DEEPSEEK_V31])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_the_forcing_grammar_gives_calls_that_validate(markup_model, fmt, choice):
    """Sampled on a model with random weights: only the grammar makes the output a call, in the
    format's own syntax, its markup written as the tokens the vocabulary has for it."""
    e = markup_model
    plan = ToolPlan.make("", True, [WEATHER, TIME], choice, None)
    plan.format = fmt
    g = plan.grammar()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(4):
        c = e.generate("call a tool", SamplingParams(temperature=1.0, seed=seed, max_tokens=2000, grammar=g))
        assert c.final.finish_reason == "stop", c.text
        if fmt is ToolFormat.HARMONY:  # harmony's reader takes its whole answer
            calls = [(n, a) for n, a in parse_harmony(c.text).calls]
        else:
            calls = [(x["function"]["name"], json.loads(x["function"]["arguments"]))
                     for x in parse_tool_calls(c.text, NAMES, arg_types([WEATHER, TIME]))[1]]
        assert calls, (fmt, c.text)
        for name, args in calls:
            if isinstance(choice, dict):
                assert name == "get_weather"
            jsonschema.validate(args, schemas[name])
        assert c.text.startswith(SYNTAX[fmt]), (fmt, c.text)  # in the format's own syntax


def test_the_deepseek_forcing_grammar_takes_its_calls_in_its_own_tokens_and_no_other_syntax(markup_model):
    """DeepSeek's markup spells ``▁`` (U+2581), which an SPM vocabulary's pieces cannot write (its
    ``▁`` is a space), so the synthetic model cannot generate it piece by piece as a BPE one
    can; the grammar is checked by its matcher instead: DeepSeek's calls, in the vocabulary's
    tokens, are taken whole and complete it; a Hermes call is refused at its first token."""
    e = markup_model
    plan = ToolPlan.make("", True, [WEATHER, TIME], "required", None)
    plan.format = ToolFormat.DEEPSEEK_V31
    from engine.text.tool_calls import DS_CALL, DS_CALL_END, DS_CALLS, DS_CALLS_END, DS_SEP

    calls = (f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Oslo", "days": 2}}{DS_CALL_END}'
             f'{DS_CALL}get_time{DS_SEP}{{"zone": "CET"}}{DS_CALL_END}{DS_CALLS_END}')
    toks = e.tokenizer.encode(calls, add_special=False)
    assert len(toks) < len(calls) // 2  # its markup as one token each
    g = e.grammars.compile(plan.grammar())
    for t in toks:
        assert g.allows(t), e.tokenizer.decode([t])
        g.accept(t)
    assert g.accepting
    assert [n for n, _ in [(c["function"]["name"], 0) for c in parse_tool_calls(calls, NAMES)[1]]] == NAMES
    hermes = e.grammars.compile(plan.grammar())
    assert not hermes.allows(e.tokenizer.encode("<tool_call>", add_special=False)[0])


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
