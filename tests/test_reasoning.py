"""Reasoning models: the thinking split from the content, whole and streamed, by the markers of
the template's family (no engine, no Ray); tests/e2e/test_clients.py has it over HTTP."""

from __future__ import annotations

import json

import pytest

from deployments.api.openai import Choice, SseEvents
from engine.text.reasoning import MARKERS, ReasoningPlan, ReasoningSplitter, split_reasoning
from engine.types import Delta, Finish, FinishReason, Output

THINK = ReasoningPlan("<think>", "</think>")


@pytest.mark.parametrize("chunks, thinking, content", [
    (["<think>ab", "c</th", "ink>\nde", "f"], "abc", "def"),  # markers split over pieces
    (["<thi", "nk>x</think>y"], "x", "y"),
    (["hello ", "<think>not at the start</think>"], "", "hello <think>not at the start</think>"),
    (["  <think>cut short"], "cut short", ""),  # an answer cut inside the thinking
    (["<", "b>bold</b>"], "", "<b>bold</b>"),  # a tag that only began like the marker
])
def test_the_splitter_holds_only_what_could_be_a_marker(chunks, thinking, content):
    s = ReasoningSplitter(THINK)
    out = [s.feed(c) for c in chunks] + [s.finish()]
    assert ("".join(r for r, _ in out), "".join(c for _, c in out)) == (thinking, content)


def test_the_template_chooses_the_markers_and_may_open_the_thinking():
    assert ReasoningPlan.make("auto", "chatml without markers", "x") is None  # nothing to split
    assert ReasoningPlan.make("none", "{{ '<think>' }}", "x") is None
    cmd = ReasoningPlan.make("auto", "... <|START_THINKING|> ...", "prompt")
    assert (cmd.start, cmd.end, cmd.open) == MARKERS[1] + (False,)
    qwen = ReasoningPlan.make("auto", "{{ '<think>\\n' }}", "<|im_start|>assistant\n<think>\n")
    assert qwen.open and split_reasoning(qwen, "plan</think>\nanswer") == ("plan", "answer")
    assert ReasoningPlan.make("deepseek", "", "x") == THINK  # asked for: DeepSeek's markers
    legacy = ReasoningPlan.make("deepseek-legacy", "", "x")
    assert split_reasoning(legacy, "<think>a</think>b") == ("a", "<think>a</think>b")
    with pytest.raises(ValueError, match="reasoning_format"):
        ReasoningPlan.make("bogus", "", "x")


def _out(text: str, finish: FinishReason | None = None) -> Output:
    if finish is None:
        return Delta("r", text, 1)
    return Finish("r", text, 1, finish, prompt_tokens=3, completion_tokens=4)


def test_chat_answers_carry_reasoning_content_whole_and_streamed():
    c = Choice(0, "chat", False, None, THINK)
    c.add([_out("<think>why"), _out("</think>because", FinishReason.STOP)])
    msg = c.body()["message"]
    assert msg["reasoning_content"] == "why" and msg["content"] == "because"
    s = Choice(0, "chat", False, None, THINK)
    ev = SseEvents("r", "chat", "m", False)
    raw = s.events(ev, [_out("<think>wh")]) + s.events(ev, [_out("y</think>be"), _out("cause", FinishReason.STOP)])
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "why"
    assert "".join(d.get("content") or "" for d in deltas) == "because"
    plain = Choice(0, "completion", False, None, THINK)  # completions are never split
    plain.add([_out("<think>x</think>y", FinishReason.STOP)])
    assert plain.body()["text"] == "<think>x</think>y"
