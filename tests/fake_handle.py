"""Stand-ins for the ingress's engine in unit tests: a Serve deployment handle
(``handle.method.remote(...)`` calls the subclass's ``_method``, and ``options(...)`` returns
the handle itself), and a prompt maker of a fake model (``fake_maker``: a chat's prompt is its
messages as JSON, a text's tokens its first characters')."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from deployments.prompts import MakerConfig, PromptMaker


class Streamed:
    """A streaming call's result as Serve's ``DeploymentResponseGenerator`` is one: iterated,
    and cancelled (``cancelled`` is set; a fake stream may wait on it to end)."""

    def __init__(self, gen: Any = None) -> None:
        self.gen = gen
        self.cancelled = asyncio.Event()

    def __aiter__(self) -> Any:
        return self.gen.__aiter__()

    def cancel(self) -> None:
        self.cancelled.set()


class FakeHandle:
    def options(self, **_: Any) -> Any:
        return self

    def __getattr__(self, name: str) -> Any:
        handler = getattr(self, "_" + name)

        class Method:
            remote = staticmethod(handler)

        return Method

    async def _info(self, **_: Any) -> dict:
        return {"healthy": True}


def fake_tokens(text: str | list[int]) -> list[int]:
    if isinstance(text, list):
        return list(text)
    return [1 + ord(ch) % 97 for ch in text[:40]] or [1]


class FakeTemplate:
    source, builtin = "", True


class FakeTokenizer:
    """The fake model's tokenizer: a chat's prompt is its messages as the router reads them, a
    text's tokens are its first characters'."""

    template = FakeTemplate()
    n_vocab = 1000

    def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> str:
        return json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)

    def encode(self, text: str, **_: Any) -> list[int]:
        return fake_tokens(text)

    def decode(self, tokens: list[int]) -> str:
        return "".join(f"<{t}>" for t in tokens)


class FakeVocab:
    n_vocab = 1000


def fake_maker() -> PromptMaker:
    return PromptMaker(FakeTokenizer(), FakeVocab(), 512, 4, MakerConfig(4, 512))
