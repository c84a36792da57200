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
    def __init__(self, tokenizer: Any, model: Any, n_ctx_slot: int, n_parallel: int, config: MakerConfig,
                 modalities: dict[str, bool] | None = None) -> None:
        from engine.text.tokenizer import server_limits

        self.tokenizer, self.model, self.config = tokenizer, model, config
        self.modalities = modalities or {}
        self.n_ctx_slot = n_ctx_slot
        self.slot_limit, self.context_limit = server_limits(n_ctx_slot, n_parallel)

    @classmethod
    def of_engine(cls, engine: Any) -> PromptMaker:
        """The maker of an engine in this process (tests, tools): its own tokenizer."""
        c = engine.config
        return cls(engine.tokenizer, engine.model, engine.n_ctx_slot, c.n_parallel,
                   MakerConfig(c.n_slots_per_group, c.n_batch), engine.modalities)

    @classmethod
    def load(cls, info: dict[str, Any]) -> PromptMaker:
        """The maker of the model an engine replica serves (its ``info()``), from the GGUF's
        vocabulary on this node."""
        from engine.native.model import Model
        from engine.text.tokenizer import Tokenizer

        model = Model(info["model_path"], devices=[], vocab_only=True, release_offloaded=False)
        tok = Tokenizer(model, info.get("chat_template"), info.get("chat_template_file"))
        return cls(tok, model, info["n_ctx_slot"], info["n_parallel"],
                   MakerConfig(info["n_slots_per_group"], info["n_batch"]), info.get("modalities"))

    def tokenize_prompt(self, prompt: str | list[int], limit: Any = None) -> list[int]:
        """A prompt's tokens, as the engine's ``tokenize_prompt``; ``limit`` (default: a slot's,
        which leaves room for a generated token): ``TooLong`` past it (a 400)."""
        from engine.text.tokenizer import prompt_tokens

        return prompt_tokens(self.tokenizer, prompt, limit or self.slot_limit)

    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                     cache_prompt: bool = True, n: int = 1, id_slot: int = -1, n_resumed: int = 0,
                     media: tuple[bytes, ...] = (), marker: str = "", preserved: tuple[str, ...] = (),
                     cache_salt: str = "") -> EngineRequest:
        """The request the engine runs; raises ``RequestError`` for what no slot can take. With
        ``media``, the text prompt holds ``marker`` where each goes: the text between is
        tokenised piece by piece (as mtmd does), each medium one ``MEDIA_SLOT`` the engine
        replaces by its rows. ``preserved``: the special tokens (by their text) the answer shows
        as text; ``cache_salt``: its prefixes are shared only with requests of the same salt."""
        tokens = self.media_tokens(prompt, media, marker) if media else self.tokenize_prompt(prompt)
        return EngineRequest.of(request_id, tokens, params, n=n, id_slot=id_slot, cache_prompt=cache_prompt,
                                n_resumed=n_resumed, media=tuple(media), preserved=self.special_ids(preserved),
                                cache_salt=cache_salt)

    def special_ids(self, texts: tuple[str, ...]) -> tuple[int, ...]:
        """The ids of the texts that are one special token of this vocabulary (others: none)."""
        out = []
        for t in texts:
            ids = self.tokenizer.encode(t, add_special=False, parse_special=True)
            if len(ids) == 1:
                out.append(ids[0])
        return tuple(out)

    def media_tokens(self, prompt: str | list[int], media: tuple[bytes, ...], marker: str) -> list[int]:
        from engine.errors import RequestError
        from engine.media import MEDIA_SLOT

        if not any(self.modalities.values()):
            raise RequestError("this model takes text only: it is served without a projector (mmproj)")
        if not isinstance(prompt, str):
            raise RequestError("media go with a text prompt, which holds a marker where each goes")
        pieces = prompt.split(marker)
        if len(pieces) - 1 != len(media):
            raise RequestError(f"the prompt holds {len(pieces) - 1} media markers ({marker}) for {len(media)} media")
        tokens: list[int] = []
        for k, piece in enumerate(pieces):
            if k:
                tokens.append(MEDIA_SLOT)
            if piece or k == 0:
                tokens += self.tokenizer.encode(piece, add_special=k == 0, parse_special=True, limit=self.slot_limit)
            if len(tokens) > self.slot_limit.n_tokens:
                raise RequestError(f"the prompt is over {self.slot_limit.n_tokens} tokens but {self.slot_limit.what}: "
                                   "shorten the prompt")
        return tokens


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
