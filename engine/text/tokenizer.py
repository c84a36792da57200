"""Tokenising, detokenising and chat templates over one model's vocabulary.

The vocabulary is read-only after load, so these calls are safe from any thread.

A text held to a limit in tokens (a slot's context) is refused without being tokenised in
full, and a chat template's rendering stops, once its bytes show it cannot fit: where the
vocabulary bounds the bytes of text one token stands for (``max_token_bytes``), a text of more
than that many bytes per token of the limit needs more tokens than the limit. llama.cpp's
tokeniser costs about 100 bytes of memory per byte of a long word and cannot stop early, so
this check is what keeps a 7 MB field from costing hundreds of MB and seconds of a core.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import llama_cpp

from engine.errors import RequestError
from engine.native.model import Model
from engine.text.chat import Bound, ChatTemplate, TooLong

# whitespace a special token with llama.cpp's LSTRIP / RSTRIP attribute swallows beside it
# (Python's whitespace: a superset of the Unicode White_Space llama.cpp strips)
WHITESPACE = tuple(chr(c) for c in range(0x3001) if chr(c).isspace())
_STRIPS = llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP | llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP
NOT_UTF8 = frozenset([0xC0, 0xC1, *range(0xF5, 0x100)])  # bytes no UTF-8 text holds


@dataclass(frozen=True)
class TokenLimit:
    """The most tokens a text may take where it is used, and that limit in words for the
    client (``"a slot holds 512 (n_ctx / n_parallel) ..."``)."""

    n_tokens: int
    what: str


def server_limits(n_ctx_slot: int, n_parallel: int) -> tuple[TokenLimit, TokenLimit]:
    """What a prompt may take (a slot, with at least one generated token) and what a text for
    /tokenize or /apply-template may take (the whole context)."""
    n_ctx = n_ctx_slot * n_parallel
    return (TokenLimit(n_ctx_slot - 1, f"a slot holds {n_ctx_slot} (n_ctx / n_parallel) with at least one generated token"),
            TokenLimit(n_ctx, f"this server's whole context holds {n_ctx} (n_ctx)"))


def prompt_tokens(tokenizer: Tokenizer, prompt: str | list[int], limit: TokenLimit) -> list[int]:
    """A prompt's tokens (a text tokenised with its special tokens, or token ids checked against
    the vocabulary); ``TooLong`` past ``limit``, a ``RequestError`` for what cannot be one."""
    if isinstance(prompt, str):
        tokens = tokenizer.encode(prompt, add_special=True, parse_special=True, limit=limit)
    else:
        if len(prompt) > limit.n_tokens:
            raise RequestError(f"the prompt is {len(prompt)} tokens but {limit.what}: shorten the prompt")
        tokens = list(prompt)
        bad = [t for t in tokens if not 0 <= t < tokenizer.n_vocab]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {tokenizer.n_vocab}): {bad[:5]}")
    if not tokens:
        raise RequestError("the prompt is empty")
    return tokens


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
        self.max_token_bytes, self._dropped, self._strips = self._token_bytes_bound()

    def _token_bytes_bound(self) -> tuple[int | None, bytes, bool]:
        """The most bytes of text one token stands for (None: no bound holds), the bytes
        llama.cpp drops from a text, and whether a token may swallow whitespace. SentencePiece
        and byte-level BPE vocabularies write every byte of a text in the piece of the token
        that stands for it, but llama.cpp's BPE drops a byte no token holds (SmolLM2 has none
        for six control characters and some leading bytes), and a special token with LSTRIP /
        RSTRIP swallows the whitespace beside it; WordPiece and Unigram drop whitespace and
        merge unknown runs into one token."""
        kind = llama_cpp.llama_vocab_type(self.vocab)
        if kind not in (llama_cpp.LLAMA_VOCAB_TYPE_SPM, llama_cpp.LLAMA_VOCAB_TYPE_BPE):
            return None, b"", False
        pieces = [self.piece(t) for t in range(self.n_vocab)]
        dropped = b""
        if kind == llama_cpp.LLAMA_VOCAB_TYPE_BPE:
            dropped = bytes(sorted(set(range(256)) - {p[0] for p in pieces if len(p) == 1} - NOT_UTF8))
            if any(0x80 <= b < 0xC0 for b in dropped):  # a character of no counted byte: no count of them shows it
                return None, b"", False
        strips = any(llama_cpp.llama_vocab_get_attr(self.vocab, t) & _STRIPS for t in range(self.n_vocab))
        return max(1, max(map(len, pieces))), dropped, strips

    def _counted(self, text: str, raw: bytes | None) -> int:
        """The bytes of ``text`` (``raw``) that tokens must stand for; without ``raw``, a lower
        bound of them from its characters (each at least one byte, but for one dropped whole)."""
        if raw is None:
            n = len(text) - sum(text.count(chr(b)) for b in self._dropped if b < 0x80)
        else:
            n = len(raw) - sum(raw.count(bytes([b])) for b in self._dropped)
        if self._strips:
            n -= sum(text.count(c) * (len(c.encode()) if raw is not None else 1) for c in WHITESPACE)
        return n

    def max_bytes(self, limit: TokenLimit | None) -> int | None:
        """Bytes of text past which a text surely takes more than ``limit``'s tokens (None: no
        such bound for this vocabulary, or no limit)."""
        if limit is None or self.max_token_bytes is None:
            return None
        return self.max_token_bytes * limit.n_tokens

    def check_length(self, text: str, limit: TokenLimit | None, raw: bytes | None = None) -> None:
        """Raises ``TooLong`` when ``text`` (UTF-8 ``raw`` where given) has more bytes than
        ``limit``'s tokens can stand for; refuses only what cannot fit, never a text that might."""
        most = self.max_bytes(limit)
        if most is None:
            return
        n = len(raw) if raw is not None else len(text)  # characters: at most its bytes
        if n > most and (self._dropped or self._strips):
            n = self._counted(text, raw)
        if n > most:
            kind = "bytes" if raw is not None else "characters"
            besides = " (besides those a token may drop or swallow)" if self._dropped or self._strips else ""
            raise TooLong(f"the prompt is {n} {kind}{besides}, so more than {limit.n_tokens} tokens (a token of "
                          f"this model stands for at most {self.max_token_bytes} bytes), but {limit.what}: shorten "
                          "the prompt")

    def _special_text(self, token: int) -> str:
        if not 0 <= token < self.n_vocab:  # a vocabulary without this token
            return ""
        return self.piece(token).decode("utf-8", "replace")

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True,
               limit: TokenLimit | None = None) -> list[int]:
        """``text``'s tokens. ``limit``: raises ``TooLong`` for a text of more tokens, from its
        bytes alone where they show it (``check_length``), else once tokenised, without making a
        list of more tokens than the limit."""
        self.check_length(text, limit)
        raw = text.encode("utf-8")
        self.check_length(text, limit, raw)
        cap = len(raw) + 8 if limit is None else min(len(raw) + 8, limit.n_tokens + 1)
        while True:
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), buf, cap, add_special, parse_special)
            if limit is not None and (n < 0 or n > limit.n_tokens):
                raise TooLong(f"the prompt is {abs(n)} tokens but {limit.what}: shorten the prompt", abs(n))
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
                            tools: list[dict] | None = None, kwargs: dict[str, Any] | None = None,
                            limit: TokenLimit | None = None) -> str:
        """The prompt text for ``messages``. A template that writes ``bos_token`` itself would
        give two BOS tokens once the prompt is tokenised with the model's own BOS, so a
        leading BOS text is dropped then, as llama.cpp's chat code does. ``limit``: the
        rendering stops with ``TooLong`` once the text is longer than its tokens can hold."""
        most = self.max_bytes(limit)
        count = (lambda t: self._counted(t, None)) if self._dropped or self._strips else len
        try:
            text = self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        kwargs=kwargs, bound=None if most is None else Bound(most, count))
        except TooLong:
            assert limit is not None
            raise TooLong(f"the prompt the chat template makes is over {most} characters, so more than "
                          f"{limit.n_tokens} tokens (a token of this model stands for at most {self.max_token_bytes} "
                          f"bytes), but {limit.what}: shorten the messages") from None
        if self.model.add_bos and self.bos_text and text.startswith(self.bos_text):
            text = text[len(self.bos_text):]
        return text
