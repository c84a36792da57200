"""Hostile request bodies and the checks every one of them must pass, shared by the engine-level
suite (tests/test_hostile.py) and the HTTP one (tests/e2e/test_hostile_http.py).

The cases are the ones that took a replica down or wedged it before structured output moved
to llguidance and the sampler windows were bounded; the strategies generate more of the same
kinds for property-based fuzzing."""

from __future__ import annotations

import threading
import time
from typing import Any

from hypothesis import strategies as st


def _nest(k: int) -> str:
    return "root ::= " + "(" * k + '"a"' + ")" * k


def _branching(levels: int) -> str:
    rules = "".join(f'r{i} ::= r{i + 1} "a" | r{i + 1} "b"\n' for i in range(levels))
    return f"root ::= r0\n{rules}r{levels} ::= \"x\"\n"


def _chain(n: int) -> str:
    rules = "\n".join(f'r{i} ::= "x" r{i + 1} | "y"' for i in range(n))
    return f'root ::= r0\n{rules}\nr{n} ::= "z"'


def _lark_chain(n: int) -> str:
    rules = "\n".join(f'r{i}: "x" r{i + 1} | "y"' for i in range(n))
    return f'start: r0\n{rules}\nr{n}: "z"\n'


def _ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"type": "integer"}]} for i in range(n)}
    defs[f"a{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def _deep_schema(k: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer"}
    for _ in range(k):
        s = {"type": "array", "items": s, "maxItems": 2}
    return s


def forced_tool(parameters: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "call it"}], "max_tokens": 8,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}, **extra}


# (name, route, body): route "completion" or "chat"
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("grammar: a token id outside the vocabulary", "completion",
     {"prompt": "Hello", "max_tokens": 4, "grammar": "root ::= <[999999]>"}),
    ("grammar: a byte no token begins with", "completion", {"prompt": "Hello", "max_tokens": 4, "grammar": "root ::= [\x00]"}),
    ("json_schema: const NUL", "chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
                                        "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "n", "schema": {"const": "\u0000"}}}}),
    ("forced tool with ignore_eos", "chat", forced_tool({"type": "object", "properties": {}}, ignore_eos=True)),
    ("grammar nested 400,000 deep", "completion", {"prompt": "x", "max_tokens": 4, "grammar": _nest(400_000)}),
    ("grammar nested 100,000 deep", "completion", {"prompt": "x", "max_tokens": 4, "grammar": _nest(100_000)}),
    ("json_schema: pattern a{0,100000}", "completion",
     {"prompt": "x", "max_tokens": 4, "json_schema": {"type": "string", "pattern": "^a{0,100000}$"}}),
    ("forced tool: maxItems 1,000,000", "chat", forced_tool({"type": "array", "maxItems": 1_000_000})),
    ("grammar: rules that branch two ways, 40 levels", "completion",
     {"prompt": "x", "max_tokens": 4, "grammar": _branching(40)}),
    ("json_schema: maxItems 200,000,000", "completion",
     {"prompt": "x", "max_tokens": 4, "json_schema": {"type": "array", "items": {"type": "integer"}, "maxItems": 200_000_000}}),
    ("repeat_last_n 2^31-1", "completion",
     {"prompt": "x", "max_tokens": 4, "repeat_penalty": 1.1, "repeat_last_n": 2147483647}),
    ("dry_penalty_last_n 2^31-1", "completion",
     {"prompt": "x", "max_tokens": 4, "dry_multiplier": 0.8, "dry_penalty_last_n": 2147483647}),
    ("64 long DRY breakers", "completion",
     {"prompt": "x", "max_tokens": 4, "dry_multiplier": 0.8, "dry_sequence_breakers": ["ab" * 128] * 64}),
    ("grammar: 5,000 chained rules", "completion", {"prompt": "x", "max_tokens": 4, "grammar": _chain(5000)}),
    ("grammar: 400 chained rules", "completion", {"prompt": "x", "max_tokens": 4, "grammar": _chain(400)}),
    ("lark: 3,000 chained rules", "completion", {"prompt": "x", "max_tokens": 4, "grammar": _lark_chain(3000)}),
    ("json_schema: 2,000 chained $refs", "completion", {"prompt": "x", "max_tokens": 4, "json_schema": _ref_chain(2000)}),
    ("json_schema: 400 chained $refs", "completion", {"prompt": "x", "max_tokens": 4, "json_schema": _ref_chain(400)}),
    ("json_schema nested 60 deep", "completion", {"prompt": "x", "max_tokens": 4, "json_schema": _deep_schema(60)}),
    ("json_schema nested 200 deep", "completion", {"prompt": "x", "max_tokens": 4, "json_schema": _deep_schema(200)}),
]


# ---- property-based: the fields an attacker writes ---------------------------------------------

_text = st.text(st.characters(codec="utf-8"), max_size=12)
_big = st.one_of(st.integers(0, 64), st.sampled_from([2**31 - 1, 10**9, 10**6, 100_000, 4097]))

_gbnf_atom = st.one_of(
    _text.map(lambda t: '"' + t.replace("\\", "\\\\").replace('"', '\\"') + '"'),
    st.sampled_from(["[a-z]", "[^\\n]", "[\\x00]", "[\\x00-\\xff]", ".", "<[1]>", "<[999999]>", "missing", "root",
                     "[]", '""', "[\\u0000-\\U0010FFFF]"]),
)


def _gbnf_expr(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.lists(children, min_size=1, max_size=4).map(" ".join),
        st.lists(children, min_size=2, max_size=4).map(" | ".join),
        children.map(lambda c: f"({c})"),
        st.tuples(children, st.sampled_from(["*", "+", "?", "{2}", "{0,3}", "{1,}", "{0,100000}", "{5000}"])).map("".join),
    )


gbnf = st.tuples(
    st.recursive(_gbnf_atom, _gbnf_expr, max_leaves=12),
    st.lists(st.tuples(st.sampled_from(["a", "b", "root", "c-d"]), st.recursive(_gbnf_atom, _gbnf_expr, max_leaves=6)),
             max_size=3),
).map(lambda t: "root ::= " + t[0] + "".join(f"\n{n} ::= {e}" for n, e in t[1]))

_leaf_schema = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array"])}),
    st.fixed_dictionaries({"const": st.one_of(_text, st.integers(), st.none())}),
    st.fixed_dictionaries({"enum": st.lists(st.one_of(_text, st.integers()), max_size=4)}),
    st.fixed_dictionaries({"type": st.just("string"),
                           "pattern": st.sampled_from(["^a{0,100000}$", "(a|b)*c", "[", "\\d{3}", "^$", "(((((a)))))",
                                                       ".*", "a{2,1}", "\\p{L}+"])}),
    st.fixed_dictionaries({"type": st.just("string"), "minLength": _big, "maxLength": _big}),
    st.fixed_dictionaries({"$ref": st.sampled_from(["#", "#/nowhere", "#/$defs/x", "http://example.com/s"])}),
    st.fixed_dictionaries({"type": st.just("integer"), "minimum": st.integers(-10**30, 10**30),
                           "maximum": st.integers(-10**30, 10**30)}),
)


def _schema_node(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("array"), "items": children, "minItems": _big, "maxItems": _big}),
        st.fixed_dictionaries({"type": st.just("object"),
                               "properties": st.dictionaries(_text, children, max_size=3),
                               "required": st.lists(_text, max_size=3)}),
        st.fixed_dictionaries({"anyOf": st.lists(children, max_size=3)}),
        st.fixed_dictionaries({"allOf": st.lists(children, max_size=3)}),
        st.fixed_dictionaries({"oneOf": st.lists(children, max_size=3)}),
    )


schemas = st.recursive(_leaf_schema, _schema_node, max_leaves=10)

_window = st.one_of(st.integers(-1, 64), st.sampled_from([-1, 2**31 - 1, 10**9, 10**6, 4097]))
_unit = st.floats(0, 1)
# a few fields per request, each mostly within its bounds (the engine must run them) and
# sometimes at or past them (the request's 400)
SAMPLER_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.one_of(st.floats(0, 2), st.just(-1.0)), "top_k": st.one_of(st.integers(0, 100), st.just(2**31 - 1)),
    "top_p": st.one_of(st.floats(0.01, 1), st.just(0.0)), "min_p": _unit, "repeat_penalty": st.floats(0.5, 3),
    "repeat_last_n": _window, "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "min_keep": st.one_of(st.integers(0, 50), st.just(10**6)), "typical_p": st.floats(0.05, 1),
    "top_n_sigma": st.one_of(st.just(-1.0), st.floats(0, 5)), "xtc_probability": _unit, "xtc_threshold": _unit,
    "dry_multiplier": st.floats(0, 2), "dry_base": st.floats(1, 3), "dry_allowed_length": st.integers(0, 10),
    "dry_penalty_last_n": _window, "dry_sequence_breakers": st.lists(_text, max_size=8),
    "dynatemp_range": st.floats(0, 2), "mirostat": st.integers(0, 2), "mirostat_tau": st.floats(0.1, 10),
    "samplers": st.lists(st.sampled_from(["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc",
                                          "temperature", "top_n_sigma"]), max_size=10),
    "logit_bias": st.dictionaries(st.sampled_from(["0", "1", "2", "3", "10", "999999", "x"]), st.floats(-100, 100),
                                  max_size=4),
    "seed": st.integers(0, 2**32 - 2), "ignore_eos": st.booleans(), "n": st.integers(1, 2),
    "stop": st.lists(_text, max_size=4),
}


@st.composite
def sampler_fields(draw: Any) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(sorted(SAMPLER_FIELDS)), max_size=5, unique=True))
    return {n: draw(SAMPLER_FIELDS[n]) for n in names}


def structured(draw: Any) -> dict[str, Any]:
    """One request's structured-output fields, of one of the four ways a grammar arrives."""
    way = draw(st.sampled_from(["grammar", "json_schema", "response_format", "tool"]))
    if way == "grammar":
        return {"grammar": draw(gbnf)}
    if way == "json_schema":
        return {"json_schema": draw(schemas)}
    if way == "response_format":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": draw(schemas)}}}
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": draw(schemas)}}],
            "tool_choice": draw(st.sampled_from(["required", {"type": "function", "function": {"name": "f"}}]))}


@st.composite
def hostile_bodies(draw: Any) -> tuple[str, dict[str, Any]]:
    fields = {**draw(sampler_fields()), "max_tokens": draw(st.integers(1, 6))}
    if draw(st.booleans()):
        fields.update(structured(draw))
    if "tools" in fields or draw(st.booleans()):
        return "chat", {"messages": [{"role": "user", "content": "hi"}], **fields}
    return "completion", {"prompt": "hello", **fields}


# ---- the witness: a stream beside the hostile requests -----------------------------------------


class Gaps:
    """The longest wait between two outputs of a stream that runs beside the hostile requests."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.worst = 0.0
        self.n = 0
        self._lock = threading.Lock()

    def tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            self.worst = max(self.worst, now - self.last)
            self.last = now
            self.n += 1

    def reset(self) -> None:
        with self._lock:
            self.last, self.worst = time.monotonic(), 0.0
