"""A model's answer read back: its reasoning, its content and its tool calls, as its family writes them.

One ``AnswerReader`` per choice, for every API: ``feed`` gives the reasoning and content that can go
out now (a tail that may begin a marker is held), ``finish`` what was held and the calls. A
harmony answer (gpt-oss) is split by its channels first (``engine.text.harmony``); any other by
its reasoning markers (``engine.text.reasoning``). The content then goes through the tool-call
parser of the request's tools (``engine.text.tool_calls``), which holds the text from a call's marker on.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from engine.text.call_args import CallPart, JsonArgs, calls_of, whole_call
from engine.text.harmony import PRESERVED, HarmonyParser
from engine.text.reasoning import ReasoningPlan, ReasoningSplitter
from engine.text.tool_calls import ArgTypes, ToolCallStream, new_call
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
    are always read: its markup is never content).

    Its calls go out as ``CallPart``s (``engine.text.call_args``): a call's id and name as soon as
    its head is read, its arguments as they are written, its end once it is closed; the parts of
    each call, joined, are the call the whole answer's reading gives. A harmony call is followed
    here, any other by the tool-call stream; each call's index is the answer's, in the order the
    calls began."""

    def __init__(self, reasoning: ReasoningPlan | None, tools: ToolReading | None) -> None:
        self.harmony = HarmonyParser(raw_reasoning=reasoning.legacy) if reasoning and reasoning.harmony else None
        self.thinking = ReasoningSplitter(reasoning) if reasoning and not reasoning.harmony else None
        self.tools = tools
        self.calls = tools.stream() if tools is not None else None
        self.index: dict[tuple[str, int], int] = {}  # (harmony's message or the stream's index) -> the answer's
        self.h_live: tuple[int, str, str, JsonArgs] | None = None  # the harmony call followed: message, id, name
        self.h_done: set[int] = set()  # the harmony calls' messages gone out
        self.h_sent = ""  # the followed harmony call's arguments so far
        self.h_cut = False  # a followed harmony call read as none: no more calls

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

    def call_parts(self) -> list[CallPart]:
        """The calls' parts written since the last look, to stream before the answer ends."""
        if self.tools is None:
            return []
        out = self._harmony_parts(follow=True) if self.harmony is not None else []
        if self.calls is not None:
            out += self._number("t", self.calls.parts())
        return out

    def finish(self) -> tuple[str, str, list[CallPart]]:
        """What was held: ``(reasoning, content, parts)``, the parts less those ``call_parts``
        gave out. A reader never asked reads the answer's calls whole here."""
        out: list[CallPart] = []
        if self.harmony is not None:
            parts = self.harmony.finish()
            reasoning, content = parts.reasoning, parts.content
            if self.tools is not None:
                out = self._harmony_parts(follow=False)
        elif self.thinking is not None:
            reasoning, content = self.thinking.finish()
        else:
            reasoning, content = "", ""
        if self.calls is not None:
            content = self.calls.feed(content)
            rest, more = self.calls.finish()
            content += rest
            out += self._number("t", more)
        return reasoning, content, out

    def _number(self, source: str, parts: list[CallPart]) -> list[CallPart]:
        """``parts`` under the answer's call indexes (without parallel calls, the first call's only)."""
        out = []
        for p in parts:
            key = (source, p.index)
            if key not in self.index:
                if self.index and not self.tools.parallel:
                    continue
                self.index[key] = len(self.index)
            p.index = self.index[key]
            if self.tools.parallel or p.index == 0:
                out.append(p)
        return out

    def _harmony_parts(self, follow: bool) -> list[CallPart]:
        """Harmony's calls (to the functions the request offered): the one followed ends once its
        message has, the others whole; ``follow``: the call being written is followed."""
        h, out = self.harmony, []
        assert h is not None and self.tools is not None
        if self.h_cut:
            return []
        offered = self.tools.names
        live = self.h_live
        open_call = h.open_call() if follow else None
        if live is not None:
            msg, cid, name, reader = live
            if open_call is not None and open_call[0] == msg:
                piece = reader.feed(open_call[2])
                self.h_sent += piece
                return self._number("h", [CallPart(msg, cid, name, piece)] if piece else [])
            self.h_live = None
            self.h_done.add(msg)
            if msg not in h.call_at:  # its body was no JSON, or was cut: it ends as it went out
                self.h_cut = True
                return self._number("h", [CallPart(msg, cid, name, "", last=True)])
            args = new_call(name, h.calls[h.call_at.index(msg)][1])["function"]["arguments"]
            rest = args[len(self.h_sent):] if args.startswith(self.h_sent) else ""
            out.append(CallPart(msg, cid, name, rest, last=True))
        for (name, args), msg in zip(h.calls, h.call_at, strict=True):
            if msg not in self.h_done and name in offered:
                self.h_done.add(msg)
                out.append(whole_call(msg, new_call(name, args)))
        if open_call is not None and open_call[1] in offered and open_call[0] not in self.h_done:
            msg, name, body = open_call
            reader = JsonArgs()
            cid = "call_" + uuid.uuid4().hex[:24]
            self.h_live, self.h_sent = (msg, cid, name, reader), reader.feed(body)
            out += [CallPart(msg, cid, name, "", first=True)] + ([CallPart(msg, cid, name, self.h_sent)]
                                                                  if self.h_sent else [])
        return self._number("h", out)


def harmony_only(plan: ReasoningPlan | None) -> ReasoningPlan | None:
    """For the APIs that carry no thinking (Anthropic's, Responses): a harmony answer's channels
    are still read (its analysis dropped); other thinking stays in the text as before."""
    return plan if plan is not None and plan.harmony else None


def read_answer(reasoning: ReasoningPlan | None, tools: ToolReading | None, text: str) -> tuple[str, str, list[dict]]:
    """A whole answer's ``(reasoning, content, calls)``."""
    r = AnswerReader(reasoning, tools)
    r1, c1 = r.feed(text)
    r2, c2, parts = r.finish()
    calls = calls_of(parts)
    return r1 + r2, (c1 + c2).strip() if calls else c1 + c2, calls
