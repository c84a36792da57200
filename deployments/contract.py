"""What an engine replica answers the ingress with. ``Submitted``: what the ingress cannot know
of a request it made (the replica and output stream that took it, its budget in that
replica's slots, the seed the engine chose), and nothing of how the answer is shaped: the
ingress adds that (``dataclasses.replace``) from what it prepared. ``Embedded``: an embedding
request's vectors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Submitted:
    prompt_tokens: int
    n_predict: int
    replica: str
    conn: str  # the output stream the request's outputs come by
    n_ctx: int  # tokens per slot
    seed: int | None = None  # the seed the engine gave a request of several choices that asked none
    # the ingress's own, from what it prepared (never sent by the engine):
    echo: str | None = None  # completions' echo: the prompt's text
    tools: Any = None  # api.values.ToolSettings
    reasoning: Any = None  # engine.text.reasoning.ReasoningPlan: how a chat answer's thinking is split
    resume: Any = None  # api.values.ResumeSpec: how to resume it where it was (not for a continuation's own)


@dataclass(frozen=True)
class Embedded:
    vectors: list  # numpy float32 arrays, one per input
    n_tokens: int
