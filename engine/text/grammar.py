"""Structured output fit for untrusted input: one path from every request field to a matcher.

A grammar arrives as llama-server's ``grammar`` (GBNF, or Lark), ``json_schema``, OpenAI's
``response_format`` or a forced tool call; each becomes a ``GrammarSpec`` and goes the same
way:

1. ``check_source``: size, nesting depth and counted repetitions are checked in Python,
   before any parser sees the text (a recursive parser given 400,000 nested parentheses
   overflows its stack; a repetition count of millions expands into millions of rules);
2. ``GrammarCompiler.compile`` (``engine.text.matcher``): llguidance (a constrained-decoding engine made for untrusted
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
from dataclasses import dataclass
from typing import Any, Literal

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


def json_options() -> dict[str, Any]:
    """How JSON is written under a schema: bounded whitespace; keywords llguidance does not
    implement (``format`` values it does not know, annotations) are ignored, as llama.cpp's
    own converter ignores them, rather than refused."""
    return {"whitespace_pattern": JSON_WHITESPACE, "lenient": True}
