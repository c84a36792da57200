"""Structured output fit for untrusted input: one path from every request field to a matcher.

A grammar arrives as llama-server's ``grammar`` (GBNF, or Lark), ``json_schema``, OpenAI's
``response_format`` or a forced tool call; each becomes a ``GrammarSpec`` and goes the same
way:

1. ``check_source``: size, nesting depth and counted repetitions are checked in Python,
   before any parser sees the text (a recursive parser given 400,000 nested parentheses
   overflows its stack; a repetition count of millions expands into millions of rules);
2. ``GrammarCompiler.compile``: llguidance (a constrained-decoding engine made for untrusted
   grammars: an Earley parser and a lazy lexer, each step bounded by ``LLParserLimits``)
   builds the matcher and its first token mask on a compile thread of its own, with a time
   budget: past the budget the request is refused (400); llguidance's fuel limits stop the
   work itself. Neither an event loop nor a group thread ever compiles.
3. ``GrammarState``: sampling asks it whether the chain's pick is allowed (one token, cheap)
   and only when it is not, masks the row with the full token mask and picks again, as
   llama-server's rejection sampling does; a token the grammar refuses is never accepted,
   and a grammar that allows no token ends its own request with an error.

llama.cpp's grammar sampler is not used: its parser recurses without a depth limit, its
left-recursion check is exponential in branching rules, and a token its grammar refuses
throws through the C boundary (the process aborts). The README has the measurements.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from engine.errors import RequestError

log = logging.getLogger(__name__)

GrammarKind = Literal["gbnf", "lark", "json_schema"]

# any JSON object (OpenAI's response_format {"type": "json_object"})
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

MAX_GRAMMAR_BYTES = 256 * 1024
MAX_NESTING = 64  # brackets of a grammar, or objects and arrays of a schema, inside each other
MAX_RULES = 500  # rules of a grammar; $refs and definitions of a schema
MAX_REPEAT = 10_000  # the largest count of a counted repetition ({m,n}) in a grammar or a pattern
MAX_SCHEMA_COUNT = 100_000  # the largest minItems, maxLength... of a schema
# JSON whitespace between tokens, as llama.cpp's converter allows it: one space, or a newline and
# up to 20 of indentation (a model cannot fill max_tokens with blanks)
JSON_WHITESPACE = r"( |\n[ \t]{0,20})?"

_SCHEMA_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
                  "minContains", "maxContains")


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar as a request gave it: its language and its text (a schema as JSON text)."""

    kind: GrammarKind
    text: str

    @classmethod
    def of_schema(cls, schema: Any, what: str = "json_schema") -> GrammarSpec:
        if not isinstance(schema, dict):
            raise RequestError(f"{what} must be a JSON object (a JSON schema)")
        check_schema(schema, what)
        return cls("json_schema", json.dumps(bounded_schema(schema)))


MAX_DIGITS = 16  # an integer's (or a number's integer part's) digits, as llama.cpp's converter allows
MAX_DECIMALS = 10  # a number's decimals (llama.cpp's converter: 16; llguidance takes 10 as a multipleOf)
_LIMIT = 10**MAX_DIGITS - 1


def _types(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def bounded_schema(schema: Any) -> Any:
    """A copy of ``schema`` that a model's output ends under, as llama.cpp's converter reads
    schemas: an object with ``properties`` and no ``additionalProperties`` allows no others
    (JSON Schema itself would allow any: a small model otherwise keeps inventing keys until
    max_tokens); an integer has at most ``MAX_DIGITS`` digits and a number as many before its
    point and ``MAX_DECIMALS`` after it, no exponent, where the schema sets no bound (a small
    model otherwise writes digits without end: 40000000...)."""
    schema = json.loads(json.dumps(schema))
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            types = _types(node)
            if types & {"integer", "number"}:
                if "minimum" not in node and "exclusiveMinimum" not in node:
                    node["minimum"] = -_LIMIT
                if "maximum" not in node and "exclusiveMaximum" not in node:
                    node["maximum"] = _LIMIT
                if "number" in types and "integer" not in types and "multipleOf" not in node:
                    node["multipleOf"] = 10.0**-MAX_DECIMALS
            stack.extend(v for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, dict | list))
    return schema


# ---- 1. limits, before any parser ------------------------------------------------------------


def check_source(spec: GrammarSpec) -> None:
    """Refuse what no parser should be handed; raises ``RequestError``."""
    if len(spec.text.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise RequestError(f"the grammar is larger than {MAX_GRAMMAR_BYTES} bytes")
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except (ValueError, RecursionError):
            raise RequestError("json_schema is not valid JSON") from None
        check_schema(schema, "json_schema")
        return
    _check_grammar_text(spec.text)


_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w.]*\s*(\.\s*-?\d+\s*)?:(?!:)", re.M)


def _check_grammar_text(text: str) -> None:
    """Rules, nesting of () [] {} outside string literals, and the counts of ``{m,n}``
    repetitions. llguidance recurses along chains of rules (a 3,000-rule chain overflows an
    8 MiB stack and kills the process), and its GBNF converter is quadratic in rules."""
    n_rules = max(text.count("::="), len(_LARK_RULE.findall(text)))
    if n_rules > MAX_RULES:
        raise RequestError(f"the grammar has more than {MAX_RULES} rules ({n_rules})")
    depth = most = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':  # a string literal: skip to its end, escapes included
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c == "[":  # a character class: its brackets are characters
            i += 1
            while i < n and text[i] != "]":
                i += 2 if text[i] == "\\" else 1
        elif c == "/" and i + 1 < n and text[i + 1] not in "/*":  # a Lark regex literal
            i += 1
            while i < n and text[i] not in "/\n":
                i += 2 if text[i] == "\\" else 1
        elif c == "#" or (c == "/" and i + 1 < n and text[i + 1] == "/"):  # a comment
            while i < n and text[i] != "\n":
                i += 1
        elif c in "({":
            depth += 1
            most = max(most, depth)
        elif c in ")}":
            depth -= 1
        i += 1
        if most > MAX_NESTING:
            raise RequestError(f"the grammar nests deeper than {MAX_NESTING} levels")
    _check_counts(text, "a counted repetition in the grammar")  # regex literals' too


_COUNTED = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def _check_counts(text: str, what: str) -> None:
    """Every ``{m}``, ``{m,}``, ``{m,n}`` and ``{,n}`` at most ``MAX_REPEAT``."""
    for m in _COUNTED.finditer(text):
        if any(g and int(g) > MAX_REPEAT for g in m.groups()):
            raise RequestError(f"{what} exceeds {MAX_REPEAT}")


def check_schema(schema: Any, what: str = "json_schema") -> None:
    """Depth, size and counts of a JSON schema, walked without recursion."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    seen = refs = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if depth > MAX_NESTING:
            raise RequestError(f"{what} nests deeper than {MAX_NESTING} levels")
        if seen > 100_000:
            raise RequestError(f"{what} is too large")
        if isinstance(node, dict):
            # chains of definitions nest as deep as nesting does, for the compiler
            refs += ("$ref" in node) + sum(len(node[k]) for k in ("$defs", "definitions")
                                            if isinstance(node.get(k), dict))
            if refs > MAX_RULES:
                raise RequestError(f"{what} has more than {MAX_RULES} $refs and definitions")
            for k in _SCHEMA_COUNTS:
                v = node.get(k)
                if isinstance(v, int | float) and not isinstance(v, bool) and v > MAX_SCHEMA_COUNT:
                    raise RequestError(f"{what}: {k} {v} exceeds {MAX_SCHEMA_COUNT}")
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                _check_regex(pattern, what)
            for k, v in node.items():
                if k == "patternProperties" and isinstance(v, dict):
                    for p in v:
                        _check_regex(p, what)
                if isinstance(v, dict | list):
                    stack.append((v, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def _check_regex(pattern: str, what: str) -> None:
    if len(pattern) > 4096:
        raise RequestError(f"{what}: a pattern is longer than 4096 characters")
    _check_counts(pattern, f"{what}: a counted repetition in a pattern")
    depth = most = 0
    for c in pattern:
        depth += c == "("
        depth -= c == ")"
        most = max(most, depth)
    if most > MAX_NESTING:
        raise RequestError(f"{what}: a pattern nests deeper than {MAX_NESTING} levels")


# ---- 2. compilation, with a budget -----------------------------------------------------------


def _limits() -> Any:
    import llguidance

    # llguidance's own defaults but for the grammar size, a tenth of it: no request needs more
    # and the per-step fuel keeps a mask computation within milliseconds
    return llguidance.LLParserLimits(max_grammar_size=50_000, verbose_errors=False)


def json_options() -> dict[str, Any]:
    """How JSON is written under a schema: bounded whitespace; keywords llguidance does not
    implement (``format`` values it does not know, annotations) are ignored, as llama.cpp's
    own converter ignores them, rather than refused."""
    return {"whitespace_pattern": JSON_WHITESPACE, "lenient": True}


def to_llguidance(spec: GrammarSpec) -> str:
    """The grammar in llguidance's own form; raises ``RequestError`` for a text that does not
    convert."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=json_options())
        lark = spec.text if spec.kind == "lark" else any_to_lark(spec.text)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except RecursionError:
        raise RequestError(f"the grammar nests deeper than {MAX_NESTING} levels") from None
    except Exception as e:  # the converter's message says what it cannot read
        raise RequestError(f"the grammar does not parse: {e}") from None


class GrammarCompiler:
    """Compiles grammars for one vocabulary on its own threads, each within ``budget_s``.

    A compilation past its budget is the request's 400; the thread it ran on finishes it
    within llguidance's fuel limits and is counted in ``overrun`` meanwhile, so a burst of
    hostile grammars cannot take every compile thread: past ``max_overrun`` grammars are
    refused at once until those threads are back."""

    def __init__(self, tokenizer: Any, budget_s: float = 5.0, threads: int = 2) -> None:
        """``tokenizer``: the engine's ``engine.tokenizer.Tokenizer`` (its vocabulary)."""
        self.vocab_of = tokenizer
        self.n_vocab = tokenizer.n_vocab
        self.budget_s = budget_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-compile")
        self._tok: Any = None
        self._tok_lock = threading.Lock()
        self._lock = threading.Lock()
        self.overrun = 0
        self.max_overrun = max(1, threads - 1)

    def tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, made once (about a second for 262,144 tokens)."""
        with self._tok_lock:
            if self._tok is None:
                self._tok = _lltokenizer(self.vocab_of)
            return self._tok

    def compile(self, spec: GrammarSpec) -> GrammarState:
        """The matcher of ``spec``, its first mask computed; raises ``RequestError``."""
        check_source(spec)
        with self._lock:
            if self.overrun >= self.max_overrun:
                raise RequestError("the server is still compiling earlier grammars that ran past their "
                                   f"budget of {self.budget_s:g} s; retry later")
        fut = self._pool.submit(self._build, spec)
        try:
            return fut.result(timeout=self.budget_s)
        except FutureTimeout:
            with self._lock:
                self.overrun += 1
            fut.add_done_callback(self._back)
            raise RequestError(f"the grammar took longer than {self.budget_s:g} s to compile; simplify it") from None
        except RequestError:
            raise
        except Exception as e:  # whatever else a hostile grammar makes the compiler raise
            log.warning("grammar compilation failed: %r", e)
            raise RequestError(f"the grammar cannot be compiled: {_short(str(e))}") from None

    def _back(self, _fut: object) -> None:
        with self._lock:
            self.overrun -= 1

    def _build(self, spec: GrammarSpec) -> GrammarState:
        import llguidance

        t0 = time.perf_counter()
        grammar = to_llguidance(spec)
        m = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=_limits())
        if m.is_error():
            raise RequestError(f"the grammar does not parse: {_short(m.get_error())}")
        state = GrammarState(m, self.n_vocab)
        try:
            first = state.refresh_mask()
        except GrammarDeadEnd as e:
            raise RequestError(f"the grammar allows no token of this model's vocabulary at its start: {e}") from None
        if not first.any():
            raise RequestError("the grammar allows no token of this model's vocabulary at its start")
        state.compile_s = time.perf_counter() - t0
        return state

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _lltokenizer(tok: Any) -> Any:
    """llguidance's tokenizer over a llama.cpp vocabulary: each token's bytes, control tokens
    marked as llguidance expects (a 0xFF byte first), and llama.cpp's own tokenizer for text."""
    import ctypes

    import llama_cpp
    import llguidance

    control = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    user = llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    pieces = []
    for t in range(tok.n_vocab):
        p = tok.piece(t)
        attr = llama_cpp.llama_vocab_get_attr(tok.vocab, t)
        if attr & control or (attr & user and p.startswith(b"<") and p.endswith(b">")):
            p = b"\xff" + p
        pieces.append(p)
    fptr = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return llguidance.LLTokenizer.from_llamacpp(tokens=pieces, vocab_ptr=tok.vocab, tokenize_fptr=fptr,
                                                eos_token=list(tok.eog_tokens) or None, slices=None)


def _short(msg: str) -> str:
    return msg if len(msg) <= 500 else msg[:500] + "..."


# ---- 3. sampling -----------------------------------------------------------------------------


class GrammarDeadEnd(RuntimeError):
    """The grammar allows no token at this point of the output."""


class GrammarState:
    """One request's matcher: which tokens may come next, and the tokens it has taken.
    Used by one thread at a time (the request's group, or its sampling pool's thread)."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self.m = matcher
        self.n_vocab = n_vocab
        self._bits = np.full((n_vocab + 31) // 32, -1, dtype=np.int32)
        self._fresh = False  # _bits is the mask of the current state
        self.compile_s = 0.0

    def copy(self) -> GrammarState:
        g = GrammarState(self.m.deep_copy(), self.n_vocab)
        g._bits[:] = self._bits
        g._fresh = self._fresh
        return g

    def allows(self, token: int) -> bool:
        return self.m.validate_tokens([token]) == 1

    def refresh_mask(self) -> np.ndarray:
        """The allowed tokens (bools over the vocabulary) in the current state."""
        if not self._fresh:
            self.m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            if self.m.is_error():
                raise GrammarDeadEnd(_short(self.m.get_error()))
            self._fresh = True
        return np.unpackbits(self._bits.view(np.uint8), count=self.n_vocab, bitorder="little").view(bool)

    @property
    def accepting(self) -> bool:
        return self.m.is_accepting()

    def accept(self, token: int) -> None:
        if not self.m.consume_token(token) or self.m.is_error():
            raise GrammarDeadEnd(f"the grammar refused token {token}: {_short(self.m.get_error())}")
        self._fresh = False
