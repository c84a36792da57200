"""A tool call's arguments streamed while the model writes them, in every syntax the families
write calls in: the call's id and name once its head is read, its arguments a piece at a time,
and the pieces joined are, character for character, the arguments the whole answer's reading
gives. Through the chat, Responses and Anthropic streams, assembled as their clients assemble
them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from pydantic import TypeAdapter

from engine.text.answer import AnswerReader, ToolReading, read_answer
from engine.text.call_args import CallPart, JsonArgs, calls_of
from engine.text.reasoning import ReasoningPlan
from engine.text.tool_calls import DS_CALL, DS_CALL_END, DS_CALLS, DS_CALLS_END, DS_SEP, arg_types
from engine.text.tools import ToolFormat
from engine.types import Delta, Finish, FinishReason

TOOLS = [
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
        "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}}}}},
]
NAMES = ("write_file", "search")
HARMONY = ReasoningPlan.make("auto", "<|start|>assistant<|channel|>final<|message|>", "<|start|>assistant")

# a file's text as a coding agent writes one: quotes, backslashes, tabs, newlines, unicode, an emoji
FILE = 'def f(x):\n\treturn "a\\\\b" + \'ü\'  # 😀 done\n' * 3 + "end"
ARGS = {"path": "src/ä.py", "content": FILE, "mode": 420, "opts": {"a": [1, 2.5, True, None], "e": {}}}
SECOND = {"q": 'say "hi"'}


def _json(v: dict, compact: bool = False) -> str:
    return json.dumps(v, ensure_ascii=compact, separators=(",", ":") if compact else None)


def _qwen(name: str, args: dict) -> str:
    body = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else _json(v)}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _glm(name: str, args: dict) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else _json(v)}</arg_value>\n"
                   for k, v in args.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


def _harmony(name: str, args: dict) -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{_json(args, True)}<|call|>"


# each family's answer with two calls: (format, plan, text)
ANSWERS = {
    "hermes": (ToolFormat.HERMES, None, "I'll write it.\n" + "\n".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {_json(a, True)}}}\n</tool_call>'
        for n, a in (("write_file", ARGS), ("search", SECOND)))),
    "qwen3-coder": (ToolFormat.QWEN3_CODER, None, _qwen("write_file", ARGS) + "\n" + _qwen("search", SECOND)),
    "glm-4.5": (ToolFormat.GLM45, None, _glm("write_file", ARGS) + _glm("search", SECOND)),
    "deepseek-v3.1": (ToolFormat.DEEPSEEK_V31, None, DS_CALLS + "".join(
        f"{DS_CALL}{n}{DS_SEP}{_json(a)}{DS_CALL_END}" for n, a in (("write_file", ARGS), ("search", SECOND)))
        + DS_CALLS_END),
    "kimi-k2": (ToolFormat.KIMI_K2, None, "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{_json(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate((("write_file", ARGS), ("search", SECOND)))) + "<|tool_calls_section_end|>"),
    "mistral": (ToolFormat.MISTRAL, None, "[TOOL_CALLS][" + ", ".join(
        f'{{"name": "{n}", "arguments": {_json(a)}}}' for n, a in (("write_file", ARGS), ("search", SECOND))) + "]"),
    "mistral [ARGS]": (ToolFormat.MISTRAL, None, "[TOOL_CALLS]write_file[ARGS]" + _json(ARGS)),
    "llama3": (ToolFormat.LLAMA3, None, '<|python_tag|>{"name": "write_file", "parameters": ' + _json(ARGS) + "}"),
    "gpt-oss": (ToolFormat.HARMONY, HARMONY, "<|channel|>analysis<|message|>Write it.<|end|><|start|>assistant"
                + _harmony("write_file", ARGS) + "<|start|>assistant" + _harmony("search", SECOND)),
}


def reading(fmt: ToolFormat, parallel: bool = True) -> ToolReading:
    return ToolReading(NAMES, parallel, fmt, arg_types(TOOLS))


def stream(plan: ReasoningPlan | None, tools: ToolReading, text: str, step: int) -> tuple[str, list[list[CallPart]]]:
    """The content and the calls' parts of each step, the answer fed ``step`` characters at a time."""
    r = AnswerReader(plan, tools)
    content, steps = "", []
    for i in range(0, len(text), step):
        content += r.feed(text[i:i + step])[1]
        steps.append(r.call_parts())
    _, rest, last = r.finish()
    return content + rest, steps + [last]


@pytest.mark.parametrize("name", list(ANSWERS))
@pytest.mark.parametrize("step", [1, 3])
def test_each_familys_calls_stream_as_written_and_join_to_the_whole_readings_arguments(name: str, step: int) -> None:
    fmt, plan, text = ANSWERS[name]
    whole = read_answer(plan, reading(fmt), text)
    content, steps = stream(plan, reading(fmt), text, step)
    parts = [p for s in steps for p in s]
    # the same calls, their arguments the same text, character for character
    assert [c["function"] for c in calls_of(parts)] == [c["function"] for c in whole[2]]
    assert content.strip() == whole[1].strip()
    first = calls_of(parts)[0]["function"]
    assert first["name"] == "write_file" and json.loads(first["arguments"]) == ARGS
    # the first call's arguments went out in many pieces, most of them before the call was closed
    mine = [(i, p) for i, s in enumerate(steps) for p in s if p.index == 0]
    ended = next(i for i, p in mine if p.last)
    before = "".join(p.arguments for i, p in mine if i < ended)
    assert len([p for _, p in mine if p.arguments]) > 10
    assert len(before) > len(first["arguments"]) * 0.8
    # its id and name come once, first; the answer's calls are numbered in order
    assert mine[0][1].first and sum(p.first for _, p in mine) == 1
    assert sorted({p.index for p in parts}) == list(range(len(whole[2])))


def test_a_file_being_written_reaches_the_client_while_the_model_writes_it() -> None:
    fmt, plan, text = ANSWERS["qwen3-coder"]
    half = text.index("done", text.index("<parameter=content>")) + 4  # inside the file's text
    r = AnswerReader(plan, reading(fmt))
    parts = []
    for i in range(half):
        r.feed(text[i])
        parts += r.call_parts()
    sent = "".join(p.arguments for p in parts)
    assert sent.startswith('{"path": "src/ä.py", "content": "def f(x):\\n\\treturn \\"a\\\\\\\\b\\"')
    assert sent.endswith("😀 done")  # every character written so far, none held but trailing space


@pytest.mark.parametrize("raw", ['{"a": 1, "b": [1, 2.50, -0, 1e3, true, null, {}, []], "c": "x\\"y\\n\\u00e9\\ud83d'
                                 '\\ude00 z\\/", "d": {"e": [[]]}}', '{ "q" :"日本" }', "{}", "[1,[2,[3]]]",
                                 '{"a": -Infinity, "b": NaN, "c": -1.5E-3}'])
def test_json_arguments_are_rewritten_to_their_canonical_text_a_character_at_a_time(raw: str) -> None:
    r, out = JsonArgs(), ""
    for i in range(len(raw) + 1):
        out += r.feed(raw[:i])
    assert r.done and not r.broken
    assert out == json.dumps(json.loads(raw), ensure_ascii=False)


def test_an_unpaired_surrogate_escape_stays_an_escape_streamed_and_whole() -> None:
    from deployments.api.base import dumps

    text = '<tool_call>{"name": "search", "arguments": {"q": "a\\ud800b\\ud83d\\ude00"}}</tool_call>'
    whole = read_answer(None, reading(ToolFormat.HERMES), text)[2]
    _, steps = stream(None, reading(ToolFormat.HERMES), text, 1)
    [call] = calls_of([p for s in steps for p in s])
    assert call["function"] == whole[0]["function"]
    assert call["function"]["arguments"] == '{"q": "a\\ud800b😀"}'
    dumps(whole).encode()  # UTF-8 carries it


@pytest.mark.parametrize("raw", ['{"a": oops}', '{"a": 01}', '{"a" 1}', '{"a": "x\ny"}', '{"a": 1,}', '{"a": "\\x"}'])
def test_arguments_that_are_no_json_stop_streaming_where_they_break(raw: str) -> None:
    r, out = JsonArgs(), ""
    for i in range(len(raw) + 1):
        out += r.feed(raw[:i])
    assert r.broken and not r.done
    assert raw.replace(" ", "").startswith(out.replace(" ", "").rstrip('"'))  # what went out was right so far


def test_a_call_cut_by_max_tokens_ends_as_it_went_out_and_its_text_is_no_content() -> None:
    for name in ("hermes", "qwen3-coder", "gpt-oss", "kimi-k2"):
        fmt, plan, text = ANSWERS[name]
        cut = text[: text.index("return") + 3]
        content, steps = stream(plan, reading(fmt), cut, 1)
        [call] = calls_of([p for s in steps for p in s])
        assert call["function"]["name"] == "write_file" and '"content": "def f(x):\\n\\tret' in call["function"]["arguments"]
        assert "<" not in content and "{" not in content, (name, content)
        whole = read_answer(plan, reading(fmt), cut)
        assert whole[2] == [] or name == "qwen3-coder"  # whole, a cut JSON call is no call (llama-server's reading)


def test_a_call_the_stream_cannot_follow_goes_out_whole_once_it_is_closed() -> None:
    odd = '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>\n'  # its name after its arguments
    nxt = '<tool_call>{"name": "write_file", "arguments": {"path": "a"}}</tool_call>'
    content, steps = stream(None, reading(ToolFormat.HERMES), odd + nxt, 1)
    parts = [p for s in steps for p in s]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls_of(parts)] == [
        ("search", {"q": "x"}), ("write_file", {"path": "a"})]
    assert all(p.first and p.last for p in parts)  # each whole: the stream stopped following
    # a function the request did not offer is no head to follow either; the whole reading decides
    unoffered = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    parts = [p for s in stream(None, reading(ToolFormat.HERMES), unoffered, 1)[1] for p in s]
    assert calls_of(parts)[0]["function"] == read_answer(None, reading(ToolFormat.HERMES), unoffered)[2][0]["function"]


@pytest.mark.parametrize("name", ["hermes", "qwen3-coder", "gpt-oss", "deepseek-v3.1"])
def test_without_parallel_calls_only_the_first_streams(name: str) -> None:
    fmt, plan, text = ANSWERS[name]
    _, steps = stream(plan, reading(fmt, parallel=False), text, 2)
    parts = [p for s in steps for p in s]
    assert {p.index for p in parts} == {0} and [c["function"]["name"] for c in calls_of(parts)] == ["write_file"]


# ---- through the APIs' streams, assembled as their clients assemble them ----------------------------

def _outputs(text: str, n: int = 5) -> list:
    pieces = [text[i:i + n] for i in range(0, len(text), n)]
    return [Delta("r", p, 1) for p in pieces[:-1]] + [
        Finish("r", pieces[-1], 1, FinishReason.STOP, prompt_tokens=3, completion_tokens=len(pieces))]


def _events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: ") and
            line != "data: [DONE]"]


@pytest.mark.parametrize("name", ["hermes", "gpt-oss", "glm-4.5"])
def test_the_chat_stream_gives_openai_tool_call_deltas_the_sdk_assembles(name: str) -> None:
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from deployments.api.openai import Choice, SseEvents

    fmt, plan, text = ANSWERS[name]
    whole = read_answer(plan, reading(fmt), text)
    s, ev = Choice(0, "chat", False, reading(fmt), plan), SseEvents("r", "chat", "m", False)
    chunks = [ChatCompletionChunk.model_validate(e) for e in _events(b"".join(s.events(ev, [o]) for o in _outputs(text)))]
    deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas if d.id] == [0, 1] and all(d.function.name for d in deltas if d.id)
    assert len(deltas) > 20 and not any(d.function.name for d in deltas if not d.id)
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(c)
    msg = state.get_final_completion().choices[0].message
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole[2]]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_responses_stream_gives_argument_deltas_that_join_to_the_done_arguments() -> None:
    from deployments.api.responses import ResponsesRequest, ResponsesShaper

    fmt, plan, text = ANSWERS["qwen3-coder"]
    sub = SimpleNamespace(tools=reading(fmt), reasoning=None, prompt_tokens=3)
    r = ResponsesShaper(SimpleNamespace(rid="resp_1", model="m", submitted=sub,
                                        request=ResponsesRequest.model_validate({"input": "hi"})))
    raw = r.opening()
    for o in _outputs(text):
        r.last = o
        raw += r.events([o])
    events = _events(raw + r.closing())
    for item in (e["item"] for e in events if e["type"] == "response.output_item.done"):
        deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                  and e["item_id"] == item["id"]]
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done" and
                    e["item_id"] == item["id"])
        assert len(deltas) > 1 and "".join(deltas) == done["arguments"] == item["arguments"]
    final = events[-1]["response"]
    assert [json.loads(o["arguments"]) for o in final["output"]] == [ARGS, SECOND]
    seqs = [e["sequence_number"] for e in events]
    assert seqs == list(range(len(seqs)))


def test_the_anthropic_stream_gives_input_json_deltas_its_sdk_assembles() -> None:
    import anthropic
    from anthropic.lib.streaming._messages import accumulate_event

    from deployments.api.anthropic import MessagesShaper

    fmt, plan, text = ANSWERS["kimi-k2"]
    sub = SimpleNamespace(tools=reading(fmt), reasoning=None, prompt_tokens=3)
    a = MessagesShaper(SimpleNamespace(rid="msg-1", model="m", submitted=sub))
    raw = a.opening()
    for o in _outputs(text):
        a.last = o
        raw += a.events([o])
    events = _events(raw + a.closing())
    snapshot, adapter, bufs = None, TypeAdapter(anthropic.types.RawMessageStreamEvent), {}
    for e in (e for e in events if e["type"] != "ping"):  # the SDK's own accumulation (its stream skips pings)
        snapshot = accumulate_event(event=adapter.validate_python(e), current_snapshot=snapshot, json_bufs=bufs)
    uses = [b for b in snapshot.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("write_file", ARGS), ("search", SECOND)]
    assert len([e for e in events if e["type"] == "content_block_delta"]) > 20
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == stops == [0, 1]  # one block after the other
