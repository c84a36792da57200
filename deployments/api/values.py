"""The values that cross Ray between the ingress and an engine replica, besides the requests
themselves: what a replica says of a request it took (and what resuming it needs), the
request that resumes one choice, how the ingress reads a tools answer, an embedding result."""

from __future__ import annotations

from array import array
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


SEED_SPACE = 2**32 - 1  # the engine's seeds


def _ids(raw: bytes) -> list[int]:
    a = array("i")
    a.frombytes(raw)
    return a.tolist()


@dataclass(frozen=True)
class ResumeSpec:
    """What resuming a request on another replica needs of the engine's request: its prompt's
    token ids (packed: four bytes a token), each choice's sampling settings (its own seed),
    its token budget and its slot settings."""

    prompt: bytes
    params: tuple[Any, ...]  # engine.params.SamplingParams of each choice
    n_predict: int
    cache_prompt: bool
    id_slot: int

    @classmethod
    def of(cls, r: Any) -> ResumeSpec:
        """The spec of an ``engine.types.Request`` and its followers."""
        return cls(array("i", r.prompt_tokens).tobytes(), tuple(m.params for m in r.family), r.n_predict,
                   r.cache_prompt, r.id_slot)

    @property
    def n_prompt(self) -> int:
        return len(self.prompt) // 4

    def continuation(self, choice: int, generated: list[int]) -> Continuation:
        """The request that goes on with choice ``choice`` after the tokens it ``generated``: those
        tokens after the prompt, the budget less them, the same settings (a seed advanced by the
        tokens generated, so a seeded request stays reproducible; greedy is unchanged)."""
        params = self.params[choice]
        update: dict[str, Any] = {"max_tokens": self.n_predict - len(generated), "return_progress": False}
        if params.seed is not None:
            update["seed"] = (params.seed + len(generated)) % SEED_SPACE
        return Continuation(self.prompt + array("i", generated).tobytes(), len(generated),
                            params.model_copy(update=update), self.cache_prompt, self.id_slot)


@dataclass(frozen=True)
class Continuation:
    """The request that resumes one choice on an engine replica: its prompt is the original
    prompt and the tokens it generated (``n_resumed`` of them) before its replica failed it.
    Submitted as an API request is (``prepare`` on the replica)."""

    prompt: bytes  # token ids, packed
    n_resumed: int
    params: Any  # engine.params.SamplingParams
    cache_prompt: bool
    id_slot: int
    n: int = 1

    def prepare(self, engine: Any, request_id: str) -> Prepared:
        r = engine.make_request(_ids(self.prompt), self.params, request_id, cache_prompt=self.cache_prompt,
                                id_slot=self.id_slot, n_resumed=self.n_resumed)
        return Prepared(r)


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
    resume: ResumeSpec | None = None  # how to resume it where it was (not for a continuation's own)


@dataclass(frozen=True)
class Embedded:
    """What the engine replica returns for an embedding request."""

    vectors: list  # numpy float32 arrays, one per input
    n_tokens: int
