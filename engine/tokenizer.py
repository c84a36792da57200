"""Tokenising, detokenising and chat templates over one model's vocabulary.

The vocabulary is read-only after load, so these calls are safe from any thread.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import llama_cpp

from engine.native import Model


class Tokenizer:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.vocab = model.vocab
        self.n_vocab = model.n_vocab
        self._pieces: list[bytes | None] = [None] * self.n_vocab
        self._lock = threading.Lock()
        self._template = None
        src = model.chat_template()
        if src:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(src)
        self.bos_text = self.piece(llama_cpp.llama_vocab_bos(self.vocab)).decode("utf-8", "replace")
        self.eos_text = self.piece(model.eos).decode("utf-8", "replace")

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        while True:
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), buf, cap, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def piece(self, token: int) -> bytes:
        """The bytes of one token (special tokens render as text), cached."""
        p = self._pieces[token]
        if p is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, 64, 0, True)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, -n, 0, True)
            p = buf.raw[:n]
            self._pieces[token] = p
        return p

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_text,
            eos_token=self.eos_text,
        )


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")
