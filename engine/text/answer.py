"""A model's answer read back: its reasoning, its content and its tool calls, as its family writes them.

One ``AnswerReader`` per choice, for every API: ``feed`` gives the reasoning and content that can go
out now (a tail that may begin a marker is held), ``finish`` what was held and the calls. A
harmony answer (gpt-oss) is split by its channels first (``engine.text.harmony``); any other by
its reasoning markers (``engine.text.reasoning``). The content then goes through the tool-call
parser of the request's tools (``engine.text.tool_calls``), which holds the text from a call's marker on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.text.harmony import PRESERVED, HarmonyParser
from engine.text.reasoning import ReasoningPlan, ReasoningSplitter
from engine.text.tool_calls import ArgTypes, ToolCallStream, limit_calls, new_call
from engine.text.tools import FORMAT_TOKENS, ToolFormat


@dataclass(frozen=True)
class ToolReading:
    """How a tools request's answer is read: the offered functions' names, whether several
    calls are allowed, the syntax its template shows and the parameters' types."""

    names: tuple[str, ...]
    parallel: bool
    format: str = ToolFormat.HERMES
    types: ArgTypes | None = None

    def stream(self) -> ToolCallStream:
        return ToolCallStream(list(self.names), self.parallel, self.types)


def preserved_tokens(plan: ReasoningPlan | None, tools: ToolReading | None) -> tuple[str, ...]:
    """The special tokens (as text) an answer of this family must show to be parsed."""
    out: tuple[str, ...] = PRESERVED if plan is not None and plan.harmony else ()
    if tools is not None:
        out += FORMAT_TOKENS.get(ToolFormat(tools.format), FORMAT_TOKENS[ToolFormat.HERMES])
    return out


class AnswerReader:
    """``reasoning``: None leaves thinking markers in the content (but a harmony answer's channels
    are always read: its markup is never content)."""

    def __init__(self, reasoning: ReasoningPlan | None, tools: ToolReading | None) -> None:
        self.harmony = HarmonyParser(raw_reasoning=reasoning.legacy) if reasoning and reasoning.harmony else None
        self.thinking = ReasoningSplitter(reasoning) if reasoning and not reasoning.harmony else None
        self.tools = tools
        self.calls = tools.stream() if tools is not None else None
        self.n_harmony_calls = 0  # harmony calls given out by ``ready_calls``
        self.n_given = 0  # calls given out by ``ready_calls``, of every kind

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` that can go out now."""
        if self.harmony is not None:
            parts = self.harmony.feed(text)
            reasoning, content = parts.reasoning, parts.content
        elif self.thinking is not None:
            reasoning, content = self.thinking.feed(text)
        else:
            reasoning, content = "", text
        return reasoning, (self.calls.feed(content) if self.calls is not None else content)

    def ready_calls(self) -> list[dict[str, Any]]:
        """The tool calls complete since the last look, to stream before the answer ends (a
        harmony call at its ``<|call|>``, another family's at its closing marker); ``finish``
        then gives only the others. A reader never asked gives every call at ``finish``."""
        if self.tools is None or (not self.tools.parallel and self.n_given):
            return []
        out: list[dict[str, Any]] = []
        if self.harmony is not None:
            done = self.harmony.calls[self.n_harmony_calls:]
            self.n_harmony_calls += len(done)
            out = [new_call(n, a) for n, a in done if n in self.tools.names]
        if self.calls is not None:
            out += self.calls.ready()
        out = limit_calls(out, self.tools.parallel)
        self.n_given += len(out)
        return out

    def finish(self) -> tuple[str, str, list[dict[str, Any]]]:
        """What was held: ``(reasoning, content, calls)``, the calls less those ``ready_calls``
        gave out."""
        found: list[dict[str, Any]] = []
        if self.harmony is not None:
            parts = self.harmony.finish()
            reasoning, content = parts.reasoning, parts.content
            if self.tools is not None:  # a call to a function the request did not offer is no call
                found = [new_call(n, a) for n, a in parts.calls[self.n_harmony_calls:] if n in self.tools.names]
        elif self.thinking is not None:
            reasoning, content = self.thinking.finish()
        else:
            reasoning, content = "", ""
        if self.calls is not None:
            content = self.calls.feed(content)
            rest, more = self.calls.finish()
            content += rest
            found += more
        if self.tools is not None and not self.tools.parallel:
            found = found[: max(0, 1 - self.n_given)]
        return reasoning, content, found


def harmony_only(plan: ReasoningPlan | None) -> ReasoningPlan | None:
    """For the APIs that carry no thinking (Anthropic's, Responses): a harmony answer's channels
    are still read (its analysis dropped); other thinking stays in the text as before."""
    return plan if plan is not None and plan.harmony else None


def read_answer(reasoning: ReasoningPlan | None, tools: ToolReading | None, text: str) -> tuple[str, str, list[dict]]:
    """A whole answer's ``(reasoning, content, calls)``."""
    r = AnswerReader(reasoning, tools)
    r1, c1 = r.feed(text)
    r2, c2, calls = r.finish()
    return r1 + r2, (c1 + c2).strip() if calls else c1 + c2, calls
