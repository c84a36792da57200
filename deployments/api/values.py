"""The ingress's values of a request beside the engine's: what preparing its prompt gives (the
``EngineRequest`` and how to shape its answer), what resuming it needs (``ResumeSpec``, kept
by the ingress that made it), how the ingress reads a tools answer, an embedding result."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

from deployments.contract import Embedded, Submitted  # noqa: F401 - the engine's answers, re-exported
from engine.text.answer import ToolReading
from engine.types import EngineRequest

ToolSettings = ToolReading  # how the ingress reads a tools request's answer (engine.text.answer)


@dataclass(frozen=True)
class Prepared:
    """What preparing a request's prompt gives (in the ingress): the engine's request and how to
    shape its answer."""

    request: Any  # engine.types.EngineRequest (an Engine's own Request where an engine prepares it)
    echo: str | None = None  # completions' echo: the prompt's text
    tools: ToolSettings | None = None
    reasoning: Any = None  # engine.text.reasoning.ReasoningPlan


SEED_SPACE = 2**32 - 1  # the engine's seeds


@dataclass(frozen=True)
class ResumeSpec:
    """What resuming a request on another replica needs, kept by the ingress that made it: its
    prompt's token ids (packed: four bytes a token), each choice's sampling settings (its own
    seed), its token budget and its slot settings."""

    prompt: bytes
    params: tuple[Any, ...]  # engine.params.SamplingParams of each choice
    n_predict: int
    cache_prompt: bool
    id_slot: int
    media: tuple[bytes, ...] = ()  # re-sent with the continuation: its images, not an error
    preserved: tuple[int, ...] = ()
    cache_salt: str = ""

    @classmethod
    def of(cls, er: EngineRequest, res: Submitted) -> ResumeSpec:
        """The spec of the request ``er`` an engine replica took (``res``: its budget, and the
        seed it chose for several choices that asked none); choice ``i`` is seeded ``seed + i``,
        as the engine seeds its followers."""
        p = er.params
        if res.seed is not None and p.seed is None:
            p = p.model_copy(update={"seed": res.seed})
        params = [p] + [p.model_copy(update={"seed": (p.seed + i) % SEED_SPACE}) for i in range(1, er.n)]
        return cls(er.prompt, tuple(params), res.n_predict, er.cache_prompt, er.id_slot, er.media, er.preserved,
                   er.cache_salt)

    @property
    def n_prompt(self) -> int:
        return len(self.prompt) // 4

    def continuation(self, choice: int, generated: list[int], request_id: str = "") -> EngineRequest:
        """The request that goes on with choice ``choice`` after the tokens it ``generated``: those
        tokens after the prompt (``n_resumed`` of them), the budget less them, the same settings
        (a seed advanced by the tokens generated, so a seeded request stays reproducible; greedy
        is unchanged). Its prefix is reused where a slot holds it, as the first request's."""
        params = self.params[choice]
        update: dict[str, Any] = {"max_tokens": self.n_predict - len(generated), "return_progress": False}
        if params.seed is not None:
            update["seed"] = (params.seed + len(generated)) % SEED_SPACE
        return EngineRequest(request_id, self.prompt + array("i", generated).tobytes(), params.model_copy(update=update),
                             id_slot=self.id_slot, cache_prompt=self.cache_prompt, n_resumed=len(generated),
                             media=self.media, preserved=self.preserved, cache_salt=self.cache_salt)
