"""Structured output: GBNF grammars for llama.cpp's grammar sampler, from JSON schemas too.

A grammar is checked where the request is made (``check_grammar``: a bad one is the
request's error, with llama.cpp's parser message), and sampled by rejection as
llama-server does: the request's chain picks a token, the grammar only checks that one,
and only when it refuses is the grammar applied to every candidate before picking again.
"""

from __future__ import annotations

import json
from typing import Any

import llama_cpp

from engine.types import RequestError

# any JSON object (OpenAI's response_format {"type": "json_object"})
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def schema_to_grammar(schema: Any, what: str = "json_schema") -> str:
    """GBNF for a JSON schema (llama-cpp-python's converter, llama.cpp's own port)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    if not isinstance(schema, dict):
        raise RequestError(f"{what} must be a JSON object (a JSON schema)")
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # the converter's own message says what it cannot handle
        raise RequestError(f"{what} cannot be turned into a grammar: {e}") from None


def init_grammar(vocab: Any, grammar: str) -> Any:
    """A grammar sampler; raises ``RequestError`` with the parser's message when it does not parse."""
    from engine.native import native_errors

    with native_errors() as errors:
        ptr = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    if not ptr:
        parser = [e.split("error parsing grammar:", 1)[1].strip() for e in errors if "error parsing grammar:" in e]
        detail = "; ".join(dict.fromkeys(parser or [e for e in errors if e])) or "see the server log"
        raise RequestError(f"the grammar does not parse: {detail}")
    return ptr


def check_grammar(vocab: Any, grammar: str) -> None:
    llama_cpp.llama_sampler_free(init_grammar(vocab, grammar))

