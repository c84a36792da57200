"""The values that cross Ray between the ingress and an engine replica, besides the requests
themselves: what a replica says of a request it took, how the ingress reads a tools answer,
an embedding result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.tools import ToolCallStream, limit_calls, parse_tool_calls


@dataclass(frozen=True)
class ToolSettings:
    """How the ingress reads a tools request's answer: the offered functions' names, and
    whether several calls are allowed."""

    names: tuple[str, ...]
    parallel: bool

    def read(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """``(content, calls)`` of a whole answer, the calls cut to one without parallel calls."""
        content, calls = parse_tool_calls(text, list(self.names))
        return content, limit_calls(calls, self.parallel)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(list(self.names), self.parallel)


@dataclass(frozen=True)
class Prepared:
    """What preparing a request's prompt gives the engine replica: the engine's request and,
    for the ingress, how to shape its answer."""

    request: Any  # engine.types.Request
    echo: str | None = None  # completions' echo: the prompt's text
    tools: ToolSettings | None = None
    reasoning: Any = None  # engine.reasoning.ReasoningPlan


@dataclass(frozen=True)
class Submitted:
    """What an engine replica tells the ingress of a request it took (the value that crosses
    Ray back from ``submit``)."""

    prompt_tokens: int
    n_predict: int
    replica: str
    conn: str  # the output stream the request's outputs come by
    n_ctx: int  # tokens per slot
    echo: str | None = None  # completions' echo: the prompt's text
    tools: ToolSettings | None = None
    reasoning: Any = None  # engine.reasoning.ReasoningPlan: how a chat answer's thinking is split


@dataclass(frozen=True)
class Embedded:
    """What the engine replica returns for an embedding request."""

    vectors: list  # numpy float32 arrays, one per input
    n_tokens: int
