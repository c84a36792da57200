"""Answers of the model families users split, read back as llama-server ``--jinja`` reads them:
gpt-oss (harmony), Qwen3-Coder, GLM 4.5, DeepSeek V3.1, Kimi K2, beside Hermes. Each fixture is an
answer as the family writes it (plain, thinking, one call, parallel calls, arguments with quotes,
newlines and unicode, a call cut by max_tokens); each is read whole and streamed a character at
a time, and both must agree."""

from __future__ import annotations

import json

import pytest

from engine.text.answer import AnswerReader, ToolReading, preserved_tokens, read_answer
from engine.text.call_args import CallPart, calls_of
from engine.text.harmony import parse_harmony
from engine.text.reasoning import ReasoningPlan
from engine.text.tool_calls import arg_types
from engine.text.tools import ToolFormat, ToolPlan, detect_format

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"},
        "units": {"enum": ["c", "f"]}, "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}}}}},
]
NAMES = ("get_weather", "search")

# templates reduced to the markup each family's chat template shows (the models' own templates
# hold these; llama.cpp's chat layer detects the family by them)
TEMPLATES = {
    ToolFormat.HARMONY: "{{- '<|start|>assistant<|channel|>final<|message|>' }}{% for tool in tools %}{% endfor %}",
    ToolFormat.QWEN3_CODER: "{% if tools %}<tools>{% for tool in tools %}{% endfor %}<tool_call>\n<function=name>\n"
                            "<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>{% endif %}<|im_start|>",
    ToolFormat.GLM45: "[gMASK]<sop>{% if tools %}<tool_call>{function-name}\n<arg_key>{k}</arg_key>\n"
                      "<arg_value>{v}</arg_value>\n</tool_call>{% endif %}",
    ToolFormat.DEEPSEEK_V31: "{% if tools %}{% endif %}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>",
    ToolFormat.KIMI_K2: "{% if tools %}<|tool_calls_section_begin|><|tool_call_begin|>{% endif %}",
    ToolFormat.HERMES: "{% if tools %}<tools></tools><tool_call>{\"name\": ...}</tool_call>{% endif %}",
}


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_each_family_is_told_by_its_template(fmt: ToolFormat) -> None:
    assert detect_format(TEMPLATES[fmt], builtin=False) is fmt


def test_a_template_without_tools_stays_generic_but_harmony_is_harmony_always() -> None:
    assert detect_format("{{ messages }}", builtin=False) is ToolFormat.GENERIC
    assert detect_format("<|start|>{{ messages }}<|channel|>", builtin=False) is ToolFormat.HARMONY


def reading(fmt: ToolFormat, parallel: bool = True) -> ToolReading:
    return ToolReading(NAMES, parallel, fmt, arg_types(TOOLS))


def streamed(plan: ReasoningPlan | None, tools: ToolReading | None, text: str,
             step: int = 1) -> tuple[str, str, list[CallPart]]:
    """The answer read as a stream, ``step`` characters at a time: its reasoning, its content
    and its calls' parts (each call checked to begin with its id and name and end once)."""
    r = AnswerReader(plan, tools)
    texts, parts = [], []
    for i in range(0, len(text), step):
        texts.append(r.feed(text[i:i + step]))
        parts += r.call_parts()  # the calls stream as they are written, before the answer ends
    more, rest, last = r.finish()
    parts += last
    for i in {p.index for p in parts}:
        mine = [p for p in parts if p.index == i]
        assert mine[0].first and mine[-1].last and sum(p.first for p in mine) == sum(p.last for p in mine) == 1
    return "".join(t[0] for t in texts) + more, "".join(t[1] for t in texts) + rest, parts


def both_ways(plan: ReasoningPlan | None, tools: ToolReading | None, text: str,
              cut: bool = False) -> tuple[str, str, list[dict]]:
    """The whole answer's reading, checked against the stream's (a character a step, and all
    at once). ``cut``: the answer ends inside a call, which the stream had begun and ends as it
    went out, and the whole reading takes for none."""
    whole = read_answer(plan, tools, text)
    for step in (1, 7, len(text) or 1):
        thinking, content, parts = streamed(plan, tools, text, step)
        calls = calls_of(parts)
        assert thinking == whole[0]
        assert content.strip() == whole[1].strip()
        if cut:
            *calls, broken = calls
            with pytest.raises(ValueError):
                json.loads(broken["function"]["arguments"])
        assert [c["function"] for c in calls] == [c["function"] for c in whole[2]]
    return whole


def args(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


# ---- gpt-oss: harmony ------------------------------------------------------------------------------

HARMONY = ReasoningPlan.make("auto", TEMPLATES[ToolFormat.HARMONY], "<|start|>assistant")


def test_harmony_plain_answer_is_content_and_its_analysis_reasoning() -> None:
    text = ("<|channel|>analysis<|message|>The user greets. Answer briefly.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?")
    assert both_ways(HARMONY, None, text) == ("The user greets. Answer briefly.", "Hello! How can I help?", [])


def test_harmony_a_call_is_a_tool_call_with_its_arguments() -> None:
    text = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris \\"Nord\\"\\nline", "days": 2}')
    reasoning, content, calls = both_ways(HARMONY, reading(ToolFormat.HARMONY), text)
    assert reasoning == "Need weather." and content == ""
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert args(calls[0]) == {"city": 'Paris "Nord"\nline', "days": 2}


def test_harmony_the_recipient_before_the_channel_and_parallel_calls() -> None:
    text = ('<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"q": "日本"}<|call|>'
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}')
    _, content, calls = both_ways(HARMONY, reading(ToolFormat.HARMONY), text)
    assert content == "" and [(c["function"]["name"], args(c)) for c in calls] == [
        ("search", {"q": "日本"}), ("get_weather", {"city": "Oslo"})]
    _, _, one = read_answer(HARMONY, reading(ToolFormat.HARMONY, parallel=False), text)
    assert len(one) == 1


def test_harmony_a_preamble_is_content_and_an_unoffered_function_is_no_call() -> None:
    text = ("<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.delete_all <|constrain|>json<|message|>{"x": 1}')
    assert both_ways(HARMONY, reading(ToolFormat.HARMONY), text) == ("", "Let me look.", [])


def test_harmony_cut_by_max_tokens() -> None:
    cut_thinking = "<|channel|>analysis<|message|>Thinking about the"
    assert both_ways(HARMONY, None, cut_thinking) == ("Thinking about the", "", [])
    cut_call = '<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"q": "una'
    assert both_ways(HARMONY, reading(ToolFormat.HARMONY), cut_call, cut=True) == ("", "", [])
    cut_header = "<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>fin"
    assert both_ways(HARMONY, None, cut_header) == ("ok", "", [])


def test_harmony_a_plain_text_answer_is_content_whole() -> None:
    assert both_ways(HARMONY, None, "Just text, no channels.") == ("", "Just text, no channels.", [])


def test_harmony_with_reasoning_format_none_keeps_the_analysis_in_the_content() -> None:
    plan = ReasoningPlan.make("none", TEMPLATES[ToolFormat.HARMONY], "")
    assert plan is not None and plan.harmony
    text = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>done"
    parts = parse_harmony(text, raw_reasoning=True)
    assert parts.reasoning == "" and parts.content == "<|channel|>analysis<|message|>think<|end|>done"
    assert read_answer(plan, None, text)[:2] == ("", "<|channel|>analysis<|message|>think<|end|>done")


def test_harmony_markers_are_rendered_for_its_requests() -> None:
    assert "<|channel|>" in preserved_tokens(HARMONY, None) and "<|message|>" in preserved_tokens(HARMONY, None)
    assert preserved_tokens(None, None) == ()


def test_harmony_is_read_for_an_api_without_thinking_too() -> None:
    from engine.text.answer import harmony_only

    assert harmony_only(HARMONY) is HARMONY and harmony_only(ReasoningPlan("<think>", "</think>")) is None


# ---- Qwen3-Coder's XML calls ----------------------------------------------------------------------

THINK = ReasoningPlan("<think>", "</think>")


def test_qwen3_coder_calls_with_typed_values() -> None:
    text = ("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo \"centro\"\n"
            "two lines\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n007\n</parameter>\n"
            "<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
            "<function=search>\n<parameter=q>\n42\n</parameter>\n</function>\n</tool_call>")
    _, content, calls = both_ways(None, reading(ToolFormat.QWEN3_CODER), text)
    assert content == "I'll check."
    assert args(calls[0]) == {"city": 'São Paulo "centro"\ntwo lines', "days": 3, "zip": "007", "opts": {"a": [1, 2]}}
    assert calls[1]["function"]["name"] == "search" and args(calls[1]) == {"q": "42"}  # a string parameter


def test_qwen3_coder_thinking_then_a_call_cut_in_its_parameter() -> None:
    text = "<think>plan</think>\n\n<tool_call>\n<function=search>\n<parameter=q>\nhalf a que"
    reasoning, content, calls = both_ways(THINK, reading(ToolFormat.QWEN3_CODER), text)
    assert reasoning == "plan" and content == ""
    assert [(c["function"]["name"], args(c)) for c in calls] == [("search", {"q": "half a que"})]


# ---- GLM 4.5 ----------------------------------------------------------------------------------------


def test_glm_calls_after_thinking() -> None:
    text = ("<think>The user wants weather.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Zürich\nnord</arg_value>\n<arg_key>days</arg_key>\n<arg_value>5</arg_value>\n"
            "<arg_key>units</arg_key>\n<arg_value>c</arg_value>\n</tool_call>")
    reasoning, content, calls = both_ways(THINK, reading(ToolFormat.GLM45), text)
    assert reasoning == "The user wants weather." and content == ""
    assert args(calls[0]) == {"city": "Zürich\nnord", "days": 5, "units": "c"}


def test_glm_plain_answer_and_markup_are_detected_before_hermes() -> None:
    assert both_ways(THINK, reading(ToolFormat.GLM45), "<think>x</think>\nHi there") == ("x", "Hi there", [])
    plan = ToolPlan.make(TEMPLATES[ToolFormat.GLM45], False, TOOLS, None, None)
    assert plan.format is ToolFormat.GLM45 and "<arg_key>" in preserved_tokens(None, reading(plan.format))


# ---- DeepSeek V3.1, Kimi K2 -------------------------------------------------------------------------


def test_deepseek_v31_calls() -> None:
    text = ("Checking both.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            '{"city": "Lyon"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"q": "a\\"b"}'
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    _, content, calls = both_ways(None, reading(ToolFormat.DEEPSEEK_V31), text)
    assert content == "Checking both."
    assert [(c["function"]["name"], args(c)) for c in calls] == [("get_weather", {"city": "Lyon"}),
                                                                 ("search", {"q": 'a"b'})]


def test_kimi_k2_calls() -> None:
    text = ("<think>hm</think>Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0"
            '<|tool_call_argument_begin|>{"q": "ü"}<|tool_call_end|><|tool_calls_section_end|>')
    reasoning, content, calls = both_ways(THINK, reading(ToolFormat.KIMI_K2), text)
    assert (reasoning, content) == ("hm", "Sure.") and args(calls[0]) == {"q": "ü"}


def test_a_kimi_call_cut_before_its_arguments_end_is_no_call() -> None:
    text = '<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{"q": '
    assert read_answer(None, reading(ToolFormat.KIMI_K2), text)[2] == []


# ---- Hermes stays as it was -----------------------------------------------------------------------


def test_hermes_calls_and_plain_text() -> None:
    text = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    assert args(both_ways(None, reading(ToolFormat.HERMES), text)[2][0]) == {"q": "x"}
    assert both_ways(None, reading(ToolFormat.HERMES), "no call here") == ("", "no call here", [])


def calls_streamed_before_the_end(tools: ToolReading, plan: ReasoningPlan | None, text: str) -> list:
    """The calls ended once ``text`` has been fed a character at a time (the answer goes on)."""
    r = AnswerReader(plan, tools)
    parts: list[CallPart] = []
    for ch in text:
        r.feed(ch)
        parts += r.call_parts()
    return [p.name for p in parts if p.last]


@pytest.mark.parametrize("fmt", [ToolFormat.HERMES, ToolFormat.QWEN3_CODER, ToolFormat.DEEPSEEK_V31,
                                 ToolFormat.HARMONY])
def test_of_parallel_calls_the_first_streams_as_soon_as_it_is_closed(fmt: ToolFormat) -> None:
    first, second = {
        ToolFormat.HERMES: ('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>\n',
                            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
        ToolFormat.QWEN3_CODER: ("<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</function>\n"
                                 "</tool_call>\n", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
                                 "</parameter>\n</function>\n</tool_call>"),
        ToolFormat.DEEPSEEK_V31: ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"q": "x"}<｜tool▁call▁end｜>',
                                  '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
                                  "<｜tool▁calls▁end｜>"),
        ToolFormat.HARMONY: ('<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"q": "x"}<|call|>',
                             '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
                             '<|message|>{"city": "Oslo"}<|call|>'),
    }[fmt]
    plan = HARMONY if fmt is ToolFormat.HARMONY else None
    text = first + second
    assert calls_streamed_before_the_end(reading(fmt), plan, first) == ["search"]
    assert calls_streamed_before_the_end(reading(fmt), plan, first.rstrip()[:-1]) == []  # not before its end
    _, _, calls = both_ways(plan, reading(fmt), text)
    assert [c["function"]["name"] for c in calls] == ["search", "get_weather"]
    # without parallel calls the first is the only one, streamed or not
    assert calls_streamed_before_the_end(reading(fmt, parallel=False), plan, text) == ["search"]
    r = AnswerReader(plan, reading(fmt, parallel=False))
    for ch in text:
        r.feed(ch)
        r.call_parts()
    assert r.finish()[2] == []


# ---- through the chat API's choices: whole and as SSE chunks ---------------------------------------


def test_a_harmony_chat_answer_whole_and_streamed_through_the_openai_shapes() -> None:
    from deployments.api.openai import Choice, SseEvents
    from engine.types import Delta, Finish, FinishReason

    pieces = ["<|channel|>analysis<|message|>Need", " weather.<|end|><|start|>assistant<|channel|>commentary to=",
              'functions.get_weather <|constrain|>json<|message|>{"city": ', '"Oslo"}']
    outs = [Delta("r", p, 1) for p in pieces[:-1]] + [Finish("r", pieces[-1], 1, FinishReason.STOP, prompt_tokens=3,
                                                             completion_tokens=4)]
    tools = reading(ToolFormat.HARMONY)
    whole = Choice(0, "chat", False, tools, HARMONY)
    whole.add(outs)
    body = whole.body()
    assert body["finish_reason"] == "tool_calls"
    assert body["message"]["reasoning_content"] == "Need weather." and body["message"]["content"] is None
    assert [c["function"]["name"] for c in body["message"]["tool_calls"]] == ["get_weather"]
    s, ev = Choice(0, "chat", False, tools, HARMONY), SseEvents("r", "chat", "m", False)
    raw = b"".join(s.events(ev, [o]) for o in outs).decode()
    chunks = [json.loads(line[6:])["choices"][0] for line in raw.split("\n") if line.startswith("data: ")]
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need weather."
    assert not "".join(d.get("content") or "" for d in deltas)  # no markup ever reaches the content
    pieces = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert len(pieces) == 2 and "id" in pieces[0] and "id" not in pieces[1]  # the arguments in two pieces
    assert json.loads("".join(tc["function"]["arguments"] for tc in pieces)) == {"city": "Oslo"}
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_anthropic_and_responses_answers_of_harmony_carry_no_markup() -> None:
    from types import SimpleNamespace

    from deployments.api.anthropic import MessagesShaper
    from deployments.api.responses import ResponsesRequest, ResponsesShaper
    from engine.types import Finish, FinishReason

    text = "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>Hello there"
    fin = Finish("r", text, 5, FinishReason.STOP, prompt_tokens=3, completion_tokens=5)
    sub = SimpleNamespace(tools=None, reasoning=HARMONY, prompt_tokens=3)
    a = MessagesShaper(SimpleNamespace(rid="chatcmpl-1", model="m", submitted=sub))
    a.add([fin])
    assert a.final()["content"] == [{"type": "text", "text": "Hello there"}]
    req = ResponsesRequest.model_validate({"input": "hi"})
    r = ResponsesShaper(SimpleNamespace(rid="resp_1", model="m", submitted=sub, request=req))
    r.add([fin])
    assert r.final()["output"][0]["content"][0]["text"] == "Hello there"


def test_streamed_chat_calls_go_out_one_by_one_with_their_indices() -> None:
    from deployments.api.openai import Choice, SseEvents
    from engine.types import Delta, Finish, FinishReason

    first = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>\n'
    second = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    s, ev = Choice(0, "chat", False, reading(ToolFormat.HERMES), None), SseEvents("r", "chat", "m", False)

    def deltas(raw: bytes) -> list[dict]:
        return [json.loads(line[6:])["choices"][0] for line in raw.decode().split("\n") if line.startswith("data: ")]

    early = deltas(s.events(ev, [Delta("r", "Checking. " + first, 1)]))  # the answer is not over
    assert [d["delta"].get("content") for d in early if d["delta"].get("content")] == ["Checking."]
    assert [(tc["index"], tc["function"]["name"]) for d in early for tc in d["delta"].get("tool_calls", [])] == \
        [(0, "search")]
    late = deltas(s.events(ev, [Finish("r", second, 1, FinishReason.STOP, prompt_tokens=3, completion_tokens=9)]))
    assert [(tc["index"], tc["function"]["name"]) for d in late for tc in d["delta"].get("tool_calls", [])] == \
        [(1, "get_weather")]
    assert late[-1]["finish_reason"] == "tool_calls"
    assert not any(d["delta"].get("content") for d in late)


def test_a_responses_stream_gives_each_call_its_item_as_soon_as_it_is_closed() -> None:
    from types import SimpleNamespace

    from deployments.api.responses import ResponsesRequest, ResponsesShaper
    from engine.types import Delta, Finish, FinishReason

    first = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>\n'
    second = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    sub = SimpleNamespace(tools=reading(ToolFormat.HERMES), reasoning=None, prompt_tokens=3)
    r = ResponsesShaper(SimpleNamespace(rid="resp_1", model="m", submitted=sub,
                                        request=ResponsesRequest.model_validate({"input": "hi"})))

    def events(raw: bytes) -> list[dict]:
        return [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: ")]

    early = events(r.opening() + r.events([Delta("r", "Checking. " + first, 1)]))
    done = [e["item"] for e in early if e["type"] == "response.output_item.done"]
    # the message before the call is closed, then the call's item streams whole
    assert [(i["type"], i.get("name")) for i in done] == [("message", None), ("function_call", "search")]
    r.last = Finish("r", second, 1, FinishReason.STOP, prompt_tokens=3, completion_tokens=9)
    late = events(r.events([r.last]) + r.closing())
    added = [(e["output_index"], e["item"].get("name")) for e in late if e["type"] == "response.output_item.added"]
    assert added == [(2, "get_weather")]
    final = late[-1]["response"]
    assert late[-1]["type"] == "response.completed"
    assert [(o["type"], o.get("name")) for o in final["output"]] == [
        ("message", None), ("function_call", "search"), ("function_call", "get_weather")]
    assert final["output"][0]["content"][0]["text"] == "Checking."  # the space before the call is none of it
    seqs = [e["sequence_number"] for e in early + late]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_an_anthropic_stream_gives_each_tool_use_its_block_as_soon_as_it_is_closed() -> None:
    from types import SimpleNamespace

    from deployments.api.anthropic import MessagesShaper
    from engine.types import Delta, Finish, FinishReason

    first = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>\n'
    second = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    sub = SimpleNamespace(tools=reading(ToolFormat.HERMES), reasoning=None, prompt_tokens=3)
    a = MessagesShaper(SimpleNamespace(rid="msg-1", model="m", submitted=sub))

    def events(raw: bytes) -> list[dict]:
        return [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: ")]

    early = events(a.opening() + a.events([Delta("r", "Checking. " + first, 1)]))
    started = [(e["index"], e["content_block"]["type"]) for e in early if e["type"] == "content_block_start"]
    assert started == [(0, "text"), (1, "tool_use")]
    assert [e["index"] for e in early if e["type"] == "content_block_stop"] == [0, 1]
    late = events(a.events([Finish("r", second, 1, FinishReason.STOP, prompt_tokens=3, completion_tokens=9)])
                  + a.closing())
    started = [(e["index"], e["content_block"].get("name")) for e in late if e["type"] == "content_block_start"]
    assert started == [(2, "get_weather")]
    assert [e["delta"]["stop_reason"] for e in late if e["type"] == "message_delta"] == ["tool_use"]


def test_text_after_a_streamed_call_is_a_responses_message_item_of_its_own() -> None:
    from types import SimpleNamespace

    from deployments.api.responses import ResponsesRequest, ResponsesShaper
    from engine.types import Delta, Finish, FinishReason

    first = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>\n'
    sub = SimpleNamespace(tools=reading(ToolFormat.HERMES), reasoning=None, prompt_tokens=3)
    r = ResponsesShaper(SimpleNamespace(rid="resp_1", model="m", submitted=sub,
                                        request=ResponsesRequest.model_validate({"input": "hi"})))
    raw = r.opening() + r.events([Delta("r", "Hi. " + first, 1)])
    r.last = Finish("r", "and more", 1, FinishReason.STOP, prompt_tokens=3, completion_tokens=9)
    raw += r.events([r.last]) + r.closing()
    events = [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: ")]
    done = [(e["output_index"], e["item"]["id"]) for e in events if e["type"] == "response.output_item.done"]
    assert done == [(0, "msg_1"), (1, "fc_1_0"), (2, "msg_1_1")]
    output = events[-1]["response"]["output"]
    assert [o["id"] for o in output] == ["msg_1", "fc_1_0", "msg_1_1"]
    assert output[0]["content"][0]["text"] == "Hi." and output[2]["content"][0]["text"] == "and more"
