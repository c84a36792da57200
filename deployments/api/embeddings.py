"""OpenAI's ``/v1/embeddings`` (and llama-server's ``/embedding``, which names the input
``content``): the request, its call on an engine replica's embedder (a context and thread of
its own), and its answer, floats or base64."""

from __future__ import annotations

import base64
from collections.abc import Awaitable
from typing import Any, Literal

from pydantic import Field, model_validator

from deployments.api.base import MAX_PROMPT_CHARS, ApiError, ApiModel, Call
from deployments.contract import Embedded


class EmbeddingRequest(ApiModel):
    """``POST /v1/embeddings`` (OpenAI's); llama-server's ``/embedding`` names the input ``content``."""

    model: str | None = None
    # token ids before texts: a strict match of ids comes first, not a million failed strings (each an error)
    input: str | list[int] | list[str] | list[list[int]] | None = None
    content: str | list[int] | list[str] | list[list[int]] | None = Field(default=None, description="llama-server's input.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, description="Must be the model's own (vectors are not cut).")
    user: str | None = None

    @model_validator(mode="after")
    def _one_input(self) -> EmbeddingRequest:
        if (self.input is None) == (self.content is None):
            raise ValueError("give the text to embed as input (or llama-server's content)")
        items = self.inputs()
        if not items or len(items) > 2048:
            raise ValueError("input holds 1 to 2048 texts or token lists")
        if sum(len(x) for x in items) > MAX_PROMPT_CHARS:
            raise ValueError(f"input longer than {MAX_PROMPT_CHARS} characters")
        return self

    def inputs(self) -> list[str | list[int]]:
        x = self.input if self.input is not None else self.content
        if isinstance(x, str) or (isinstance(x, list) and x and isinstance(x[0], int)):
            return [x]  # one text, or one list of token ids
        return list(x or [])


def embed(engine: Any, req: EmbeddingRequest, n_bytes: int) -> Awaitable[Embedded | ApiError]:
    """The vectors, on an engine replica (its embedder has a context and thread of its own)."""
    return engine.embed.remote(req.inputs(), req.dimensions, n_bytes=n_bytes)


def _embeddings_answer(res: Embedded, req: EmbeddingRequest, model: str) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if req.encoding_format == "base64"
             else v.tolist()} for i, v in enumerate(res.vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": res.n_tokens, "total_tokens": res.n_tokens}}


EMBEDDINGS = Call(("/v1/embeddings", "/embeddings"), EmbeddingRequest, call=embed, answer=_embeddings_answer, summary="OpenAI's embeddings: a normalised vector per input, as floats or "
                  "base64 (float32)")
