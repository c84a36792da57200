"""The grammar of a forced tool call (``tool_choice`` ``required`` or a named function), in the
syntax the model's template shows it (``engine.text.tools.ToolFormat``), as llama-server's chat
layer forces each format's own: a model is held to the markup it was trained to write, not
made to write another family's.

A grammar is Lark (llguidance), its markup literal strings: a family's special tokens stand for
their text in the matcher (``engine.text.matcher``), so ``"<tool_call>"`` admits the one token
the model writes it with. Arguments are JSON schemas inside it (``%json``), each tool's own;
an XML-style syntax's values (Qwen3-Coder's, GLM's) are text where the parameter takes a string
(held to its ``enum`` or ``const``, not to a ``pattern`` or a length: a raw value has no quotes
to bound it) and JSON otherwise, as ``engine.text.tool_calls`` reads them back.

- ``hermes`` (and ``generic``): ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
- ``mistral``: ``[TOOL_CALLS][{...}, ...]``; ``llama3``: ``{"name": ..., "parameters": ...}``
- ``qwen3-coder``: ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>``
- ``glm-4.5``: ``<tool_call>NAME\\n<arg_key>P</arg_key>\\n<arg_value>value</arg_value>\\n</tool_call>``
- ``deepseek-v3.1``, ``kimi-k2``: their call sections, JSON arguments
- ``gpt-oss``: harmony's ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``,
  one call (its ``<|call|>`` ends the answer)
"""

from __future__ import annotations

import json
from typing import Any

from engine.text.grammar import GrammarSpec, bounded_schema, check_schema, json_options
from engine.text.tool_calls import (
    DS_CALL,
    DS_CALL_END,
    DS_CALLS,
    DS_CALLS_END,
    DS_SEP,
    KIMI_ARGS,
    KIMI_CALL,
    KIMI_CALL_END,
    KIMI_CALLS,
    schema_types,
)

MAX_CALLS = 8  # calls one forced answer may hold (parallel_tool_calls)
XML_FORMATS = ("qwen3-coder", "glm-4.5")


def lit(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _json(schema: Any) -> str:
    """A JSON value of ``schema`` (bounded), as a Lark rule's body."""
    return "%json " + json.dumps({**bounded_schema(schema), "x-guidance": json_options()}, ensure_ascii=False)


class _Rules:
    """A Lark grammar's rules as they are made: each JSON schema a rule of its own."""

    def __init__(self) -> None:
        self.rules: list[str] = []

    def add(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def json(self, schema: Any) -> str:
        return self.add(_json(schema))

    def value(self, schema: Any) -> str:
        """An XML-style call's value for ``schema``: raw text where it takes a string (never
        holding ``</``, which begins the tag that ends it), the JSON it spells otherwise."""
        if not isinstance(schema, dict) or "string" not in schema_types(schema):
            return self.json(schema if isinstance(schema, dict) else {})
        if isinstance(schema.get("const"), str):
            return lit(schema["const"])
        if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
            return "(" + " | ".join(lit(v) for v in schema["enum"]) + ")"
        return self.add(r"/([^<]|<[^\/])*/")

    def xml_call(self, fmt: str, fn: dict[str, Any]) -> str:
        params = fn.get("parameters") or {}
        required = set(params.get("required") or [])
        nl = "\n"
        parts = [lit(f"<tool_call>{nl}<function={fn['name']}>{nl}" if fmt == "qwen3-coder" else f"<tool_call>{fn['name']}{nl}")]
        for key, schema in (params.get("properties") or {}).items():
            if fmt == "qwen3-coder":
                one = f"{lit(f'<parameter={key}>{nl}')} {self.value(schema)} {lit(f'{nl}</parameter>{nl}')}"
            else:
                one = f"{lit(f'<arg_key>{key}</arg_key>{nl}<arg_value>')} {self.value(schema)} {lit(f'</arg_value>{nl}')}"
            parts.append(one if key in required else f"({one})?")
        parts.append(lit(f"</function>{nl}</tool_call>" if fmt == "qwen3-coder" else "</tool_call>"))
        return " ".join(parts)

    def json_call(self, fmt: str, fn: dict[str, Any]) -> str:
        args = self.json(fn.get("parameters") or {"type": "object", "properties": {}})
        if fmt == "deepseek-v3.1":
            return f"{lit(DS_CALL + fn['name'] + DS_SEP)} {args} {lit(DS_CALL_END)}"
        if fmt == "kimi-k2":
            return f"{lit(KIMI_CALL + 'functions.' + fn['name'] + ':')} /[0-9]/ {lit(KIMI_ARGS)} {args} {lit(KIMI_CALL_END)}"
        return f"{lit('<|channel|>commentary to=functions.' + fn['name'] + ' <|constrain|>json<|message|>')} {args}"


def _whole_json_call(fmt: str, offered: list[dict[str, Any]], many: bool, g: _Rules) -> str:
    """Hermes', Mistral's and Llama 3's calls: one JSON object a call, name and arguments; the
    top rule's body (``g`` takes the call's rule)."""
    key = "parameters" if fmt == "llama3" else "arguments"
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               key: t["function"].get("parameters") or {"type": "object", "properties": {}}},
              "required": ["name", key], "additionalProperties": False} for t in offered]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    check_schema(schema, "tools")
    call = g.json(schema)
    if fmt == "mistral":
        comma = '"," " "?'
        return f'"[TOOL_CALLS][" {call}{_more(many, comma, call)} "]"'
    if fmt == "llama3":
        return call + _more(many, lit("\n"), call)
    one = f"{lit('<tool_call>' + chr(10))} {call} {lit(chr(10) + '</tool_call>')}"
    return one + _more(many, lit("\n"), one)


def _more(many: bool, sep: str, item: str) -> str:
    """Further calls after the first (``sep`` between them, if any); a model that loops stops
    at ``MAX_CALLS``."""
    if not many:
        return ""
    return f" ({sep + ' ' if sep else ''}{item}){{0,{MAX_CALLS - 1}}}"


def call_grammar(fmt: str, offered: list[dict[str, Any]], many: bool, after: str | None = None) -> GrammarSpec:
    """The grammar of a forced answer in ``fmt``: a call to one of ``offered`` (several with
    ``many``, in the syntaxes that hold several); with ``after``, the thinking the prompt
    opened is closed by that marker first (and blanks), as llama-server's forced grammar lets a
    reasoning model close it, here not optionally: a call left inside the thinking would be
    read as thinking."""
    g = _Rules()
    if fmt in (*XML_FORMATS, "deepseek-v3.1", "kimi-k2", "gpt-oss"):
        top = _call_sections(fmt, offered, many, g)
    else:
        top = _whole_json_call(fmt, offered, many, g)
    if after:
        top = f"{lit(after)} /[ \\n]{{0,4}}/ {top}"
    return GrammarSpec("lark", "\n".join([f"start: {top}", *g.rules]) + "\n")


def _call_sections(fmt: str, offered: list[dict[str, Any]], many: bool, g: _Rules) -> str:
    """The calls of the XML syntaxes, DeepSeek's and Kimi's sections and harmony's: the top
    rule's body (``g`` takes the rest)."""
    calls = []
    for t in offered:
        check_schema(t["function"].get("parameters") or {}, "tools")
        calls.append(g.add(g.xml_call(fmt, t["function"]) if fmt in XML_FORMATS else g.json_call(fmt, t["function"])))
    call = g.add(" | ".join(calls))
    if fmt == "deepseek-v3.1":
        return f"{lit(DS_CALLS)} {call}{_more(many, '', call)} {lit(DS_CALLS_END)}"
    if fmt == "kimi-k2":
        return f"{lit(KIMI_CALLS)} {call}{_more(many, '', call)} {lit('<|tool_calls_section_end|>')}"
    if fmt == "gpt-oss":
        return call
    return call + _more(many, lit("\n"), call)
