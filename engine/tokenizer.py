"""Tokenising, detokenising and chat templates over one model's vocabulary.

The vocabulary is read-only after load, so these calls are safe from any thread.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import llama_cpp

from engine.chat import ChatTemplate
from engine.native import Model


class Tokenizer:
    def __init__(self, model: Model, chat_template: str | None = None, chat_template_file: str | None = None) -> None:
        self.model = model
        self.vocab = model.vocab
        self.n_vocab = model.n_vocab
        self._pieces: list[bytes | None] = [None] * self.n_vocab
        self._text_pieces: list[bytes | None] = [None] * self.n_vocab
        self._lock = threading.Lock()
        self.bos_text = self._special_text(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos_text = self._special_text(model.eos)
        self.template = ChatTemplate.select(
            model.chat_template(), name_or_source=chat_template, file=chat_template_file,
            bos_token=self.bos_text, eos_token=self.eos_text,
        )
        # every end-of-generation token (eos, eot, end_of_turn...): ignore_eos forbids them all
        self.eog_tokens = [t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t)]

    def _special_text(self, token: int) -> str:
        if not 0 <= token < self.n_vocab:  # a vocabulary without this token
            return ""
        return self.piece(token).decode("utf-8", "replace")

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        while True:
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), buf, cap, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def piece(self, token: int, special: bool = True) -> bytes:
        """The bytes of one token, cached. ``special=False`` renders control tokens (``<eos>``,
        ``<end_of_turn>``...) as nothing, as llama-server does in generated text."""
        cache = self._pieces if special else self._text_pieces
        p = cache[token]
        if p is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
            p = buf.raw[:n]
            cache[token] = p
        return p

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for ``messages``. A template that writes ``bos_token`` itself would
        give two BOS tokens once the prompt is tokenised with the model's own BOS, so a
        leading BOS text is dropped then, as llama.cpp's chat code does."""
        text = self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, kwargs=kwargs)
        if self.model.add_bos and self.bos_text and text.startswith(self.bos_text):
            text = text[len(self.bos_text):]
        return text
