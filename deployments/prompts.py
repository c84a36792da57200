"""Where the ingress makes a request's prompt: the API layer's view of the engine
(``PromptMaker``), in the ingress's process, never beside the engine's group threads.

An API module's ``prepare(maker, request_id)`` renders its chat template, tokenises and checks
its request against a slot (``TokenLimit``: past it, a 400 from the bytes alone where they show
it) through this object, as it would through the engine: ``tokenizer``, ``n_ctx_slot``,
``slot_limit``, ``context_limit``, ``config`` (the slots of a group, the batch), ``model``
(the vocabulary) and ``make_request``, which gives the ``EngineRequest`` that crosses Ray.
The tokenizer is the model's own, loaded without its weights (llama.cpp's ``vocab_only``:
the vocabulary, its merges and the chat template from the GGUF, megabytes, no device).

The engine checks again what it must (the ids, the room, the slot pin, the grammar it
compiles), so a maker that disagreed with it could only turn a 400 into another 400.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from engine.params import SamplingParams
from engine.types import EngineRequest

# engine.tokenizer (llama.cpp) is imported where a maker is made: importing the ingress maps no
# native code, its first prompt does (the vocabulary: no weights, no device)


@dataclass(frozen=True)
class MakerConfig:
    """What of the engine's config the API layer reads."""

    n_slots_per_group: int
    n_batch: int


class PromptMaker:
    def __init__(self, tokenizer: Any, model: Any, n_ctx_slot: int, n_parallel: int, config: MakerConfig) -> None:
        from engine.tokenizer import server_limits

        self.tokenizer, self.model, self.config = tokenizer, model, config
        self.n_ctx_slot = n_ctx_slot
        self.slot_limit, self.context_limit = server_limits(n_ctx_slot, n_parallel)

    @classmethod
    def of_engine(cls, engine: Any) -> PromptMaker:
        """The maker of an engine in this process (tests, tools): its own tokenizer."""
        c = engine.config
        return cls(engine.tokenizer, engine.model, engine.n_ctx_slot, c.n_parallel,
                   MakerConfig(c.n_slots_per_group, c.n_batch))

    @classmethod
    def load(cls, info: dict[str, Any]) -> PromptMaker:
        """The maker of the model an engine replica serves (its ``info()``), from the GGUF's
        vocabulary on this node."""
        from engine.native import Model
        from engine.tokenizer import Tokenizer

        model = Model(info["model_path"], devices=[], vocab_only=True, release_offloaded=False)
        tok = Tokenizer(model, info.get("chat_template"), info.get("chat_template_file"))
        return cls(tok, model, info["n_ctx_slot"], info["n_parallel"],
                   MakerConfig(info["n_slots_per_group"], info["n_batch"]))

    def tokenize_prompt(self, prompt: str | list[int], limit: Any = None) -> list[int]:
        """A prompt's tokens, as the engine's ``tokenize_prompt``; ``limit`` (default: a slot's,
        which leaves room for a generated token): ``TooLong`` past it (a 400)."""
        from engine.tokenizer import prompt_tokens

        return prompt_tokens(self.tokenizer, prompt, limit or self.slot_limit)

    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                     cache_prompt: bool = True, n: int = 1, id_slot: int = -1, n_resumed: int = 0) -> EngineRequest:
        """The request the engine runs; raises ``RequestError`` for what no slot can take."""
        tokens = self.tokenize_prompt(prompt)
        return EngineRequest.of(request_id, tokens, params, n=n, id_slot=id_slot, cache_prompt=cache_prompt,
                                n_resumed=n_resumed)


class Makers:
    """An ingress's maker, made once from the first engine replica that answers (its model's
    vocabulary, loaded on a thread), then shared by every request."""

    def __init__(self) -> None:
        self._maker: PromptMaker | None = None
        self._lock = threading.Lock()

    def get(self, info: dict[str, Any]) -> PromptMaker:
        with self._lock:
            if self._maker is None:
                self._maker = PromptMaker.load(info)
            return self._maker

    @property
    def ready(self) -> PromptMaker | None:
        return self._maker
