"""gpt-oss's answers (OpenAI's "harmony" format) split into reasoning, content and tool calls.

A template that writes ``<|channel|>`` is harmony's; its generation prompt ends with
``<|start|>assistant``, so an answer is a run of messages, each a header and a body::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

(the recipient may also stand before the channel: ``to=functions.NAME<|channel|>commentary json``).
The ``analysis`` channel is reasoning; ``final``, and ``commentary`` without a recipient (a
preamble), are content; a message to ``functions.NAME`` is a tool call whose body is its JSON
arguments. An unknown header's message is skipped. A text that opens with no header at all is
content whole. A body cut by ``max_tokens`` counts as far as it came: analysis as reasoning,
final as content, a call whose JSON is incomplete as nothing (its text is not content either).

The markers are special tokens: the engine renders them only where the request names them
(``PRESERVED``), as llama-server's preserved tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from engine.text.stream import partial_stop_suffix

PRESERVED = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>", "<|call|>", "<|return|>")
_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_MESSAGE = "<|message|>"
_RECIPIENT = re.compile(r"\bto=functions\.([^<\s]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


def is_harmony(template_source: str) -> bool:
    return "<|channel|>" in template_source


@dataclass
class HarmonyParts:
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, Any]] = field(default_factory=list)  # (name, arguments)


class HarmonyParser:
    """Streams a harmony answer: ``feed`` returns the reasoning and content that can go out now;
    each call is whole in ``calls`` once its message ends (``open_call``: the one being written). ``raw_reasoning``: the analysis messages go to the content as
    written (llama-server's ``reasoning_format: none``)."""

    def __init__(self, raw_reasoning: bool = False) -> None:
        self.raw_reasoning = raw_reasoning
        self.held = ""
        self.kind: str | None = None  # the open message's: reasoning, content, call, skip; None: a header
        self.header = ""
        self.call_name = ""
        self.plain = False  # the text opened with no header: content whole
        self.started = False
        self.calls: list[tuple[str, Any]] = []
        self.call_at: list[int] = []  # each call's message, counted from 1
        self.n_messages = 0  # headers read

    def feed(self, text: str) -> HarmonyParts:
        self.held += text
        out = HarmonyParts()
        while self.held:
            if self.plain:
                out.content += self.held
                self.held = ""
                break
            if self.kind is None:
                if not self._read_header(out):
                    break
                continue
            if not self._read_body(out):
                break
        return out

    def finish(self) -> HarmonyParts:
        out = self.feed("")
        rest, self.held = self.held, ""
        if self.kind in ("reasoning", "content"):
            self._emit(out, self.kind, rest)
        elif self.kind == "call":
            self._end_call(rest)
        elif self.kind is None and not self.started and rest and not rest.lstrip().startswith("<|"):
            out.content += rest
        out.calls = self.calls
        return out

    # ---- the parts of a message ---------------------------------------------------------------

    def _read_header(self, out: HarmonyParts) -> bool:
        """A message's header, when its ``<|message|>`` has come; False: wait for more."""
        if not self.started:
            lead = self.held.lstrip()
            if lead and not lead.startswith(("<|", "to=")):
                if "<|".startswith(lead[:2]) or "to=".startswith(lead[:3]):
                    return False  # could still open a header
                self.plain = True  # no header: the model answered plainly
                return True
        i = self.held.find(_MESSAGE)
        if i < 0:
            return False
        header, self.held = self.held[:i], self.held[i + len(_MESSAGE):]
        self.started = True
        self.n_messages += 1
        self.header = header
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        name = channel.group(1) if channel else ""
        if recipient:
            self.kind, self.call_name = "call", recipient.group(1)
        elif name == "analysis":
            self.kind = "reasoning"
        elif name in ("final", "commentary"):
            self.kind = "content"
        else:
            self.kind = "skip"
        if self.kind == "reasoning" and self.raw_reasoning:
            out.content += header + _MESSAGE
        return True

    def _read_body(self, out: HarmonyParts) -> bool:
        """The open message's body up to its end marker; False: wait for more."""
        ends = [(j, m) for m in _ENDS if (j := self.held.find(m)) >= 0]
        if not ends:
            keep = partial_stop_suffix(self.held, _ENDS)
            body, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
            if self.kind == "call":
                self.held = body + self.held  # a call's JSON is read whole
                return False
            self._emit(out, self.kind, body)
            return False
        j, marker = min(ends)
        body = self.held[:j]
        # <|start|> opens the next message's header; the other markers end this message
        self.held = self.held[j:] if marker == "<|start|>" else self.held[j + len(marker):]
        if self.kind == "call":
            self._end_call(body)
        else:
            self._emit(out, self.kind, body)
            if self.kind == "reasoning" and self.raw_reasoning and marker != "<|start|>":
                out.content += marker
        self.kind = None
        if self.held.startswith("<|start|>"):
            self.held = self.held[len("<|start|>"):]
            if self.held.startswith("assistant"):
                self.held = self.held[len("assistant"):]
        return True

    def _emit(self, out: HarmonyParts, kind: str | None, text: str) -> None:
        if kind == "reasoning":
            if self.raw_reasoning:
                out.content += text
            else:
                out.reasoning += text
        elif kind == "content":
            out.content += text

    def _end_call(self, body: str) -> None:
        try:
            args = json.loads(body) if body.strip() else {}
        except ValueError:
            return  # cut or malformed: not a call
        self.calls.append((self.call_name, args))
        self.call_at.append(self.n_messages)

    def open_call(self) -> tuple[int, str, str] | None:
        """The call being written: ``(its message, the function's name, its body so far)``."""
        return (self.n_messages, self.call_name, self.held) if self.kind == "call" else None


def parse_harmony(text: str, raw_reasoning: bool = False) -> HarmonyParts:
    """A whole harmony answer's parts."""
    p = HarmonyParser(raw_reasoning)
    first = p.feed(text)
    last = p.finish()
    return HarmonyParts(first.reasoning + last.reasoning, first.content + last.content, last.calls)
