"""Fill-in-the-middle prompts (llama-server's ``/infill``, which editor plugins such as
llama.vscode and llama.vim call), from the model's own FIM tokens.

The prompt is laid out as llama-server lays it out, so a client tuned against llama-server
gets the same tokens: the extra context chunks first (a repository marker and one file
separator per chunk when the model has those tokens, else a plain-text snippet marker), BOS
where the model adds one, ``FIM_PRE`` + the prefix's tail + the request's ``prompt``,
``FIM_SUF`` + the suffix's head, then ``FIM_MID``, after which the model writes the middle.
The prefix keeps up to three quarters of a batch, the suffix what is left of a quarter, and
the extra chunks fill what the slot has beyond a batch and twice the tokens to generate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp

from engine.errors import RequestError
from engine.text.tokenizer import Tokenizer

SNIPPET = "\n\n--- snippet ---\n\n"  # between extra chunks of a model without a file separator


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int  # -1: none
    sep: int  # -1: none

    @classmethod
    def of(cls, tok: Tokenizer) -> FimTokens:
        v = tok.vocab
        t = cls(llama_cpp.llama_vocab_fim_pre(v), llama_cpp.llama_vocab_fim_suf(v), llama_cpp.llama_vocab_fim_mid(v),
                llama_cpp.llama_vocab_fim_rep(v), llama_cpp.llama_vocab_fim_sep(v))
        missing = [name for name, tid in (("prefix", t.pre), ("suffix", t.suf), ("middle", t.mid)) if tid < 0]
        if missing:
            raise RequestError(f"infill is not supported by this model: its GGUF has no FIM {', '.join(missing)} "
                               "token (tokenizer.ggml.fim_*_token_id)")
        return t


def infill_tokens(tok: Tokenizer, prefix: str, suffix: str, prompt: str,
                  extra: Sequence[tuple[str, str]], n_batch: int, n_ctx_slot: int, n_predict: int) -> list[int]:
    """The prompt's tokens; ``extra``: (filename, text) context chunks, most relevant last."""
    fim = FimTokens.of(tok)

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special=False, parse_special=False) if text else []

    extra_tokens: list[int] = []
    if fim.rep >= 0:
        extra_tokens += [fim.rep, *enc("myproject\n")]
    for filename, text in extra:
        extra_tokens += [fim.sep, *enc(filename + "\n")] if fim.sep >= 0 else enc(SNIPPET)
        extra_tokens += enc(text)
    if fim.sep >= 0:
        extra_tokens += [fim.sep, *enc("filename\n")]

    head, tail, middle = enc(prefix), enc(suffix), enc(prompt)
    n_prefix = min(len(head), 3 * (n_batch // 4))
    n_suffix = min(len(tail), max(0, n_batch // 4 - (2 + len(middle))))
    n_extra = min(max(0, n_ctx_slot - n_batch - 2 * n_predict), len(extra_tokens))
    out = extra_tokens[len(extra_tokens) - n_extra:] if n_extra else []
    if tok.model.add_bos:
        out.append(llama_cpp.llama_vocab_bos(tok.vocab))
    out += [fim.pre, *head[len(head) - n_prefix:], *middle, fim.suf, *tail[:n_suffix], fim.mid]
    return out
