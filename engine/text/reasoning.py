"""Reasoning models: the thinking part of an answer, split from its content.

A model of a reasoning family writes its thinking between its template's markers
(``<think>`` ... ``</think>`` for DeepSeek R1, Qwen 3 and QwQ; the others llama.cpp's chat
parser knows in ``MARKERS``). With ``reasoning_format`` ``auto`` or ``deepseek`` (llama-server's
names) that part goes out as ``reasoning_content`` (the message's, and the stream's deltas) and
the rest as ``content``; ``deepseek-legacy`` also keeps the whole text in ``content``; ``none``
leaves the text whole. A template that opens the thinking
itself (its generation prompt ends with the start marker) starts the answer inside it.
gpt-oss's harmony answers carry their thinking in a channel of their own (``engine.text.harmony``;
``none`` leaves it in the content as written).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.text.harmony import is_harmony

# (start, end) of the thinking part, by template family
MARKERS = (
    ("<think>", "</think>"),  # DeepSeek R1, Qwen 3, QwQ, GLM, Granite's thinking
    ("<|START_THINKING|>", "<|END_THINKING|>"),  # Command R7B
    ("[THINK]", "[/THINK]"),  # Magistral
    ("<seed:think>", "</seed:think>"),  # Seed-OSS
)
FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")


def opened_thinking(template_source: str, prompt: str) -> str | None:
    """The end marker of the thinking a prompt opens itself (its generation prompt ends with
    its template's start marker), else None."""
    pair = next(((s, e) for s, e in MARKERS if s in template_source), None)
    return pair[1] if pair is not None and prompt.rstrip().endswith(pair[0]) else None


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's answer is split: its markers, and whether it starts inside them."""

    start: str
    end: str
    open: bool = False
    legacy: bool = False  # deepseek-legacy: the content keeps the whole text too
    harmony: bool = False  # gpt-oss: the analysis channel is the thinking (engine.text.harmony)

    @classmethod
    def make(cls, fmt: str | None, template_source: str, prompt: str) -> ReasoningPlan | None:
        """None: the answer is not split (``none``, or ``auto`` for a template of no reasoning
        family)."""
        fmt = fmt or "auto"
        if fmt not in FORMATS:
            raise ValueError(f"reasoning_format {fmt!r} is not one of {', '.join(FORMATS)}")
        if is_harmony(template_source):  # its answers are read as harmony whatever the format
            return cls("", "", legacy=fmt == "none", harmony=True)  # legacy here: the analysis left as written
        if fmt == "none":
            return None
        pair = next(((s, e) for s, e in MARKERS if s in template_source), None)
        if pair is None:
            if fmt == "auto":
                return None
            pair = MARKERS[0]  # deepseek asked for: its markers
        return cls(pair[0], pair[1], open=prompt.rstrip().endswith(pair[0]), legacy=fmt == "deepseek-legacy")


class ReasoningSplitter:
    """Streams an answer's text as (reasoning, content) pieces; a tail that could begin a
    marker is held until the next piece tells."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self.plan = plan
        self.inside = plan.open
        self.seen_start = plan.open
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = self._feed(text)
        return reasoning, (text if self.plan.legacy else content)

    def _feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning, content = [], []
        while self.held:
            if not self.inside:
                # the thinking opens only at the start of the answer (leading blanks aside)
                lead = self.held.lstrip()
                if not self.seen_start and lead.startswith(self.plan.start):
                    self.held = lead[len(self.plan.start):]
                    self.inside = self.seen_start = True
                    continue
                if not self.seen_start and self.plan.start.startswith(lead):
                    break  # could still become the start marker
                self.seen_start = True  # no thinking: all content from here
                content.append(self.held)
                self.held = ""
                break
            i = self.held.find(self.plan.end)
            if i >= 0:
                reasoning.append(self.held[:i])
                self.held = self.held[i + len(self.plan.end):].lstrip("\n")
                self.inside = False
                continue
            keep = _prefix_len(self.held, self.plan.end)
            reasoning.append(self.held[: len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held: reasoning when inside the thinking (an answer cut there), else content."""
        rest, self.held = self.held, ""
        if self.plan.legacy:
            return (rest if self.inside else ""), ""
        return (rest, "") if self.inside else ("", rest)


def split_reasoning(plan: ReasoningPlan, text: str) -> tuple[str, str]:
    """``(reasoning, content)`` of a whole answer."""
    s = ReasoningSplitter(plan)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2


def _prefix_len(text: str, marker: str) -> int:
    """The longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
