"""Structured output on the real model: grammars and JSON schemas hold every sampled output."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from deployments.api.openai import ChatCompletionRequest, CompletionRequest
from engine import RequestError, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "likes": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "kind": {"enum": ["cat", "dog", "human"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}


def test_sampled_outputs_all_validate_against_their_schema(make_gemma):
    e = make_gemma(n_parallel=8, n_ctx=8192)
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        "temperature": 1.0, "max_tokens": 160,
    })
    prompt = e.tokenizer.apply_chat_template(req.template_messages())

    def one(seed: int) -> tuple[str, str]:
        params = req.sampling(160).model_copy(update={"seed": seed})
        c = e.generate(prompt, params)
        return c.text, c.final.finish_reason

    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(one, range(48)))
    for text, finish in outs:
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), PERSON)
    assert len({t for t, _ in outs}) > 24  # sampled, not one answer repeated


def test_a_gbnf_grammar_holds_greedy_and_sampled_output(make_gemma):
    e = make_gemma(n_parallel=2)
    g = 'root ::= ("yes" | "no") "." '
    for temp in (0.0, 1.5):
        for seed in range(5):
            c = e.generate("Is the sky blue? Answer:", SamplingParams(temperature=temp, seed=seed, max_tokens=8, grammar=g))
            assert c.text in ("yes.", "no.") and c.final.finish_reason == "stop", c.text


def test_json_object_mode_output_parses_when_finished_and_holds_when_cut(make_gemma):
    """What the feature guarantees: an output that finished is a JSON object; one cut by
    max_tokens says ``length`` and is a prefix the grammar accepted token by token."""
    e = make_gemma(n_parallel=2)
    req = CompletionRequest.model_validate({"prompt": "A JSON object about Paris:", "response_format": {"type": "json_object"},
                                            "max_tokens": 200})
    finished = 0
    for temp, seed in [(0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3), (1.0, 4), (0.7, 5), (0.7, 6)]:
        params = req.sampling(200).model_copy(update={"temperature": temp, "seed": seed})
        outs = list(e.stream(req.prompt, params))
        text, tokens, last = "".join(o.text for o in outs), [t for o in outs for t in o.tokens], outs[-1]
        if last.finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
            finished += 1
        else:
            assert last.finish_reason == "length" and last.completion_tokens == 200, (last, text)
            g = e.grammars.compile(params.grammar)
            for t in tokens:
                assert g.allows(t), (text, t)
                g.accept(t)
            assert text.lstrip().startswith("{") and not g.accepting
    assert finished >= 2, finished  # both paths are exercised (5 of 7 finish on the machines measured)


def test_bad_grammars_and_schemas_are_the_requests_error_with_the_parsers_message(make_gemma):
    e = make_gemma(n_parallel=1)
    with pytest.raises(RequestError, match="does not parse"):
        e.make_request("x", SamplingParams(grammar='root ::= ("a"'))
    with pytest.raises(RequestError, match="does not parse.*missing"):
        e.make_request("x", SamplingParams(grammar="root ::= missing"))
    with pytest.raises(RequestError, match="does not parse"):
        e.make_request("x", SamplingParams(grammar='start ::= "a"'))
    with pytest.raises(RequestError, match="does not parse"):
        e.make_request("x", CompletionRequest.model_validate(
            {"prompt": "x", "json_schema": {"type": "object", "$ref": "#/nowhere"}}).sampling(8))
    with pytest.raises(ValueError, match="one of grammar, json_schema and response_format"):
        CompletionRequest.model_validate({"prompt": "x", "grammar": "root ::= \"a\"", "json_schema": {}}).sampling(8)
    with pytest.raises(ValueError, match="response_format type"):
        CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "yaml"}}).sampling(8)
    # the engine still serves
    assert e.generate("x", SamplingParams(temperature=0, max_tokens=2)).final.completion_tokens >= 1


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                 "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}}, "required": ["zone"]}}}


def test_forced_tool_calls_on_the_real_model_all_parse_and_validate(make_gemma):
    """Gemma's GGUF has no chat template (chatml, no tools): the tools go in a system
    message; tool_choice required makes every sampled answer calls that validate."""
    from deployments.api.openai import chat_prompt
    from engine.text.tool_calls import limit_calls, parse_tool_calls

    e = make_gemma(n_parallel=4, n_ctx=16384)
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}],
        "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "required", "temperature": 1.0,
    })
    # the grammar bounds the answer (at most 8 calls, strings of bounded length, bounded
    # whitespace, no extra keys): well under 1,700 tokens, so every answer ends by itself
    prompt, params, plan = chat_prompt(e.tokenizer, req, 1700)
    assert "get_weather" in prompt and plan.format == "generic"
    schemas = {"get_weather": WEATHER_TOOL["function"]["parameters"], "get_time": TIME_TOOL["function"]["parameters"]}

    def one(seed: int) -> tuple[str, str]:
        c = e.generate(prompt, params.model_copy(update={"seed": seed}))
        return c.text, c.final.finish_reason

    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(one, range(8)))
    for text, finish in outs:
        assert finish == "stop", (finish, text)
        content, calls = parse_tool_calls(text, plan.names)
        assert calls and content == "", text
        for call in limit_calls(calls, plan.parallel):
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


NUMBER_CASES = [
    ({"type": "integer"}, "9" * 16, True),
    ({"type": "integer"}, "4" + "0" * 16, False),  # 17 digits: instructor's endless 40000000...
    ({"type": "integer", "minimum": 0}, "1" * 17, False),  # one bound given: the other is still set
    ({"type": "integer", "minimum": 0, "maximum": 10**20}, "1" * 19, True),  # the schema's own bounds stand
    ({"type": "number"}, "-3.25", True),
    ({"type": "number"}, "3." + "1" * 11, False),  # at most 10 decimals
    ({"type": "number"}, "1e5", False),  # no exponent
    ({"type": ["number", "null"]}, "1" * 17, False),
]


def test_schema_numbers_end(make_gemma):
    """Integers and numbers are bounded as llama.cpp's converter bounds them (16 digits; decimals
    tighter: 10), where the schema sets no bound of its own."""
    from engine.text.grammar import GrammarSpec
    from engine.text.matcher import GrammarCompiler

    e = make_gemma(n_parallel=1, n_ctx=512)
    gc = GrammarCompiler(e.tokenizer)
    try:
        for schema, text, allowed in NUMBER_CASES:
            state = gc.compile(GrammarSpec.of_schema(schema))
            ok = True
            for t in e.tokenizer.encode(text, add_special=False, parse_special=False):
                if not state.allows(t):
                    ok = False
                    break
                state.accept(t)
            assert ok is allowed, (schema, text)
    finally:
        gc.close()
