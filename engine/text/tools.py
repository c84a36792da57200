"""Tool calling: tools into the prompt, tool calls out of the text.

A request's tools reach the chat template as its ``tools`` variable when the template uses
one; the template's own markup tells which syntax the model was trained to answer in:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen 2.5/3)
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
- ``llama3``: a bare ``{"name": ..., "parameters": {...}}``, maybe after ``<|python_tag|>``
- ``qwen3-coder``: ``<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>``
- ``glm-4.5``: ``<tool_call>NAME<arg_key>P</arg_key><arg_value>value</arg_value>...</tool_call>``
- ``deepseek-v3.1``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...``
- ``kimi-k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>...``
- ``gpt-oss``: harmony's ``<|channel|>commentary to=functions.NAME ...<|message|>{...}<|call|>``
  (``engine.text.harmony``, which splits the whole answer)

An XML-style call's values (Qwen3-Coder's, GLM's) are text: a parameter whose schema admits a
string keeps it as a string; any other is read as JSON where it parses (a number, a boolean, an
object), as llama-server reads them, else kept as text.

A template that takes no tools (a llama.cpp built-in, or Jinja without ``tools``) gets
them in a system message instead, with the Hermes syntax to answer in (``generic``).

``tool_choice`` ``required`` or a named function is enforced with a grammar in the format's
syntax, built from the tools' parameter schemas. The parser accepts every syntax above,
whatever the format (a model does not always answer in the one its template shows), and
a bare JSON call only when it is the whole output and names one of the request's tools.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from engine.errors import RequestError
from engine.text.grammar import GrammarSpec, bounded_schema, check_schema, json_options
from engine.text.stream import partial_stop_suffix

DS_CALLS = "<｜tool▁calls▁begin｜>"  # DeepSeek V3.1's markers: fullwidth bars, U+2581 for spaces
DS_CALL, DS_SEP, DS_CALL_END, DS_CALLS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
KIMI_CALLS, KIMI_CALL, KIMI_ARGS = "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", DS_CALLS, KIMI_CALLS)
MAX_CALLS = 8  # calls one forced answer may hold (parallel_tool_calls)


class ToolFormat(StrEnum):
    HERMES = "hermes"
    MISTRAL = "mistral"
    LLAMA3 = "llama3"
    QWEN3_CODER = "qwen3-coder"
    GLM45 = "glm-4.5"
    DEEPSEEK_V31 = "deepseek-v3.1"
    KIMI_K2 = "kimi-k2"
    HARMONY = "gpt-oss"
    GENERIC = "generic"


# special tokens a format's answers are written in: rendered as text for its requests (llama.cpp's
# preserved tokens), so the parser sees them; a format not named here writes plain text
FORMAT_TOKENS: dict[ToolFormat, tuple[str, ...]] = {
    ToolFormat.HERMES: ("<tool_call>", "</tool_call>"),
    ToolFormat.QWEN3_CODER: ("<tool_call>", "</tool_call>"),
    ToolFormat.GLM45: ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    ToolFormat.MISTRAL: ("[TOOL_CALLS]", "[ARGS]"),
    ToolFormat.LLAMA3: ("<|python_tag|>",),
    ToolFormat.DEEPSEEK_V31: (DS_CALLS, DS_CALL, DS_SEP, DS_CALL_END, DS_CALLS_END),
    ToolFormat.KIMI_K2: (KIMI_CALLS, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END, "<|tool_calls_section_end|>"),
}


def detect_format(source: str, builtin: bool) -> ToolFormat:
    """The tool-call syntax a chat template shows its model, tried in llama.cpp's chat layer's
    order: the families whose markup another family's contains come first."""
    if "<|channel|>" in source and not builtin:
        return ToolFormat.HARMONY  # its answers are harmony's, tools or not
    if builtin or not re.search(r"\btools\b", source):
        return ToolFormat.GENERIC
    if DS_CALLS in source or "message['prefix'] is defined and message['prefix'] and thinking" in source:
        return ToolFormat.DEEPSEEK_V31
    if KIMI_CALLS in source:
        return ToolFormat.KIMI_K2
    if "<arg_key>" in source and "<arg_value>" in source:
        return ToolFormat.GLM45
    if "<tool_call>" in source and "<function=" in source and "<parameter=" in source:
        return ToolFormat.QWEN3_CODER
    if "<tool_call>" in source:
        return ToolFormat.HERMES
    if "[TOOL_CALLS]" in source:
        return ToolFormat.MISTRAL
    if "<|python_tag|>" in source or "<|start_header_id|>" in source:
        return ToolFormat.LLAMA3
    return ToolFormat.HERMES  # takes tools, writes no syntax of its own: ask for Hermes'


# ---- the request side -----------------------------------------------------------------------


def check_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's tools as OpenAI defines them; a malformed one is a 400."""
    seen: set[str] = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise RequestError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '.' or '-'")
        if name in seen:
            raise RequestError(f"tools[{i}]: the function name {name!r} is used twice")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def chosen(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None) -> tuple[str, str | None]:
    """``(mode, name)``: mode is ``none``, ``auto`` or ``required``; name a forced function."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestError(f"tool_choice {tool_choice!r} is not one of none, auto, required or a function")
        if tool_choice != "none" and not tools:
            raise RequestError(f"tool_choice {tool_choice!r} needs tools")
        return tool_choice, None
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise RequestError('tool_choice must be {"type": "function", "function": {"name": ...}}')
    if name not in {t["function"]["name"] for t in tools}:
        raise RequestError(f"tool_choice names {name!r}, which is not one of the tools")
    return "required", name


@dataclass
class ToolPlan:
    """What one chat request's tools do to its prompt, its sampling and its output."""

    format: ToolFormat
    tools: list[dict[str, Any]]
    mode: str  # none / auto / required
    forced_name: str | None = None
    parallel: bool = True
    names: list[str] = field(default_factory=list)

    @classmethod
    def make(cls, template_source: str, builtin: bool, tools: list[dict] | None, tool_choice: Any,
             parallel_tool_calls: bool | None) -> ToolPlan:
        tools = check_tools(tools or [])
        mode, name = chosen(tools, tool_choice)
        return cls(detect_format(template_source, builtin), tools, mode, name,
                   parallel_tool_calls is not False, [t["function"]["name"] for t in tools])

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def template_tools(self) -> list[dict] | None:
        """The ``tools`` variable for the template (None: the template takes none)."""
        if not self.active or self.format is ToolFormat.GENERIC:
            return None
        return self.offered()

    def offered(self) -> list[dict]:
        if self.forced_name is None:
            return self.tools
        return [t for t in self.tools if t["function"]["name"] == self.forced_name]

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the template takes it: for a template without tools, the
        tools go in a system message and earlier calls and results become text."""
        if self.format is not ToolFormat.GENERIC:
            return messages
        out = [_as_text(m) for m in messages]
        if not self.active:
            return out
        prompt = generic_system_prompt(self.offered(), self.parallel)
        if out and out[0]["role"] == "system":
            return [{**out[0], "content": out[0]["content"] + "\n\n" + prompt}, *out[1:]]
        return [{"role": "system", "content": prompt}, *out]

    def grammar(self) -> GrammarSpec | None:
        """For ``required`` or a named function: the grammar of the format's call syntax (Lark,
        the arguments as JSON schemas inside it)."""
        if self.mode != "required":
            return None
        key = "parameters" if self.format is ToolFormat.LLAMA3 else "arguments"
        calls = [_call_schema(t["function"], key) for t in self.offered()]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        check_schema(schema, "tools")
        many = self.parallel and self.forced_name is None

        def more(sep: str, item: str) -> str:  # further calls; a model that loops stops at MAX_CALLS
            return f" ({sep} {item}){{0,{MAX_CALLS - 1}}}" if many else ""

        if self.format is ToolFormat.MISTRAL:
            top = '"[TOOL_CALLS][" call' + more('"," " "?', "call") + ' "]"'
        elif self.format is ToolFormat.LLAMA3:
            top = "call" + more('"\\n"', "call")
        else:
            one = '"<tool_call>\\n" call "\\n</tool_call>"'
            top = one + more('"\\n"', one)
        body = json.dumps({**bounded_schema(schema), "x-guidance": json_options()})
        return GrammarSpec("lark", f"start: {top}\ncall: %json {body}\n")


def _call_schema(fn: dict[str, Any], key: str) -> dict[str, Any]:
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False}


def generic_system_prompt(tools: list[dict[str, Any]], parallel: bool) -> str:
    lines = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    many = "one <tool_call></tool_call> block per call" if parallel else "one <tool_call></tool_call> block"
    return (
        "You can call these functions:\n<tools>\n" + lines + "\n</tools>\n"
        f"To call a function, answer with {many}, each holding a JSON object "
        '{"name": <function name>, "arguments": <arguments object>}, and nothing else. '
        "Otherwise answer normally."
    )


def _as_text(m: dict[str, Any]) -> dict[str, Any]:
    """A message for a template that knows nothing of tools."""
    role, content = m["role"], m.get("content") or ""
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = m.get("tool_calls")
    if role == "assistant" and calls:
        blocks = [
            "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                         ensure_ascii=False) + "\n</tool_call>"
            for c in calls
        ]
        return {"role": "assistant", "content": "\n".join(filter(None, [content, *blocks]))}
    return {"role": role, "content": content}


def template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message with its tool fields as chat templates read them: a call's ``arguments``
    as an object (templates write it with ``tojson``), ``tool_call_id`` and ``name`` kept."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content")}
    for k in ("tool_call_id", "name"):
        if m.get(k) is not None:
            out[k] = m[k]
    if m.get("tool_calls"):
        calls = []
        for i, c in enumerate(m["tool_calls"]):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"tool_calls[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise RequestError(f"tool_calls[{i}].function.arguments is not JSON") from None
            calls.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = calls
    return out


# ---- the output side ------------------------------------------------------------------------


def new_call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": args}}


def _as_call(obj: Any) -> tuple[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in ("arguments", "parameters"):
        if key in obj:
            return obj["name"], obj[key]
    return obj["name"], {}


def _json_values(text: str) -> list[Any] | None:
    """Every JSON value of ``text`` in order (separated by space, ';' or ','), or None."""
    dec = json.JSONDecoder()
    out, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n;,":
            i += 1
        if i >= n:
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(v)


ArgTypes = dict[str, dict[str, set[str]]]  # function -> parameter -> the JSON types its schema admits


def arg_types(tools: list[dict[str, Any]]) -> ArgTypes:
    """Each offered function's parameters' JSON types (an empty set: any type)."""
    out: ArgTypes = {}
    for t in tools:
        fn = t.get("function") or {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name", "")] = {k: _schema_types(v) for k, v in props.items() if isinstance(k, str)}
    return out


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return {"string"}
    out: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            sub_types = _schema_types(sub)
            if not sub_types:
                return set()
            out |= sub_types
    return out


def xml_value(raw: str, types: set[str], trim: bool) -> Any:
    """An XML-style call's value: text where the parameter takes a string (or its type is not
    known and the text is no JSON value), else the JSON value it spells."""
    text = raw.strip() if trim else raw.strip("\n")
    if "string" in types:
        return text
    try:
        return json.loads(raw)
    except ValueError:
        return text


_QWEN_FN = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_QWEN_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)


def _xml_call(body: str, types: ArgTypes) -> tuple[str, Any] | None:
    """A Qwen3-Coder (``<function=NAME><parameter=P>``) or GLM (``NAME<arg_key>``) call's body."""
    if m := _QWEN_FN.match(body):
        name = m.group(1).strip()
        known = types.get(name, {})
        return name, {k.strip(): xml_value(v, known.get(k.strip(), set()), True)
                      for k, v in _QWEN_PARAM.findall(m.group(2))}
    name, sep, rest = body.partition("<arg_key>")
    name = name.strip()
    if sep and name and re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        known = types.get(name, {})
        return name, {k: xml_value(v, known.get(k, set()), False) for k, v in _GLM_ARG.findall(sep + rest)}
    if name and not sep and re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name) and name in types:
        return name, {}  # GLM's call of a function without arguments
    return None


def _marked_calls(text: str, begin: str, head: re.Pattern) -> tuple[str, list[dict[str, Any]]] | None:
    """DeepSeek V3.1's and Kimi K2's calls: after ``begin``, each ``head`` (naming the function)
    then its JSON arguments; None when no call parses."""
    before, _, after = text.partition(begin)
    calls = []
    for m in head.finditer(after):
        i = m.end()
        while i < len(after) and after[i] in " \t\r\n":
            i += 1
        try:
            args, _ = json.JSONDecoder().raw_decode(after, i)
        except ValueError:
            continue
        calls.append(new_call(m.group(1).strip(), args))
    return (before.strip(), calls) if calls else None


_DS_HEAD = re.compile(rf"(?:{re.escape(DS_CALL)})?([^\n<{DS_SEP[0]}]+?){re.escape(DS_SEP)}(?:json\s*)?")
_KIMI_HEAD = re.compile(rf"{re.escape(KIMI_CALL)}\s*(?:functions\.)?([A-Za-z0-9_.\-]+?)(?::\d+)?\s*{re.escape(KIMI_ARGS)}")


def parse_tool_calls(text: str, names: list[str], types: ArgTypes | None = None) -> tuple[str, list[dict[str, Any]]]:
    """``(content, calls)`` of a model's answer; content is the text outside the calls.
    ``types``: the offered functions' parameters' types, for the XML-style calls' values."""
    calls: list[dict[str, Any]] = []
    content = text
    types = types if types is not None else {n: {} for n in names}
    if DS_CALLS in text and (found := _marked_calls(text, DS_CALLS, _DS_HEAD)):
        return found
    if KIMI_CALLS in text and (found := _marked_calls(text, KIMI_CALLS, _KIMI_HEAD)):
        return found
    # Hermes: <tool_call>{...}</tool_call> blocks (an unclosed last one counts when it parses);
    # Qwen3-Coder's and GLM's XML-style bodies in the same blocks
    if "<tool_call>" in text:
        kept, rest = [], text
        while "<tool_call>" in rest:
            before, _, after = rest.partition("<tool_call>")
            body, closed, rest = after.partition("</tool_call>")
            c = _as_call(_first_json(body))
            if c is None:
                c = _xml_call(body, types)
            if c is None:
                kept.append(before + "<tool_call>" + body + closed)
                continue
            kept.append(before)
            calls.append(new_call(*c))
        return "".join(kept + [rest]).strip(), calls
    # Mistral: [TOOL_CALLS][{...}, ...] or [TOOL_CALLS]name[ARGS]{...}
    if "[TOOL_CALLS]" in text:
        before, _, after = text.partition("[TOOL_CALLS]")
        values = _json_values(after.strip())
        if values is not None:
            for v in values:
                for item in v if isinstance(v, list) else [v]:
                    c = _as_call(item)
                    if c is not None:
                        calls.append(new_call(*c))
        else:
            for m in re.finditer(r"([A-Za-z0-9_.\-]+)\[ARGS\]", after):
                try:
                    args, _ = json.JSONDecoder().raw_decode(after, m.end())
                except ValueError:
                    continue
                calls.append(new_call(m.group(1), args))
        return (before.strip(), calls) if calls else (content, [])
    # Llama 3: <|python_tag|>{...} or the whole answer a call (or calls) naming known tools
    body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
    stripped = body.strip()
    if stripped[:1] in ("{", "["):
        values = _json_values(stripped)
        items = [i for v in values or [] for i in (v if isinstance(v, list) else [v])]
        found = [_as_call(i) for i in items]
        if items and all(c is not None and c[0] in names for c in found):
            return text.split("<|python_tag|>", 1)[0].strip() if "<|python_tag|>" in text else "", \
                [new_call(*c) for c in found if c is not None]
    return content, []


def _first_json(text: str) -> Any:
    s = text.strip()
    try:
        return json.JSONDecoder().raw_decode(s)[0]
    except ValueError:
        return None


# what closes one call in the formats whose calls close one by one (the rest close at the end)
CALL_ENDS = ("</tool_call>", DS_CALL_END, KIMI_CALL_END)


class ToolCallStream:
    """Streams a tools request's text: plain text goes out as it comes, except a tail that
    could begin a call marker; from a marker on (or from an answer that opens with a JSON
    value) the text is held. Each call that is closed (``CALL_ENDS``) can go out at once
    (``ready``); the rest is parsed into calls at the end."""

    def __init__(self, names: list[str], parallel: bool = True, types: ArgTypes | None = None) -> None:
        self.names = names
        self.parallel = parallel
        self.types = types
        self.held = ""
        self.holding = False  # a call has (maybe) started: hold the rest
        self.sent_any = False
        self.n_ready = 0  # calls given out by ``ready``
        self._closed_at = 0  # the held text's length up to its last call end, when ``ready`` last looked

    def feed(self, text: str) -> str:
        self.held += text
        if self.holding:
            return ""
        if not self.sent_any:
            lead = self.held.lstrip()
            if not lead:
                return ""
            if lead[0] in "{[":
                self.holding = True
                return ""
        idx = min((self.held.find(m) for m in MARKERS if m in self.held), default=-1)
        if idx >= 0:
            self.holding = True
            out, self.held = self.held[:idx], self.held[idx:]
        else:
            keep = partial_stop_suffix(self.held, MARKERS)
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        if out:
            self.sent_any = True
        return out

    def ready(self) -> list[dict[str, Any]]:
        """The calls closed since the last look: a closed call reads the same whatever follows
        it, so it need not wait for the answer's end (the first only, without parallel calls)."""
        if not self.holding or (not self.parallel and self.n_ready):
            return []
        end = max((i + len(m) for m in CALL_ENDS if (i := self.held.rfind(m)) >= 0), default=0)
        if end <= self._closed_at:
            return []
        self._closed_at = end
        _, calls = parse_tool_calls(self.held[:end], self.names, self.types)
        new = limit_calls(calls, self.parallel)[self.n_ready:]
        self.n_ready += len(new)
        return new

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left: ``(content, calls)``, less the calls ``ready`` gave out."""
        content, calls = parse_tool_calls(self.held, self.names, self.types)
        return content, limit_calls(calls, self.parallel)[self.n_ready:]


def limit_calls(calls: list[dict[str, Any]], parallel: bool) -> list[dict[str, Any]]:
    return calls if parallel else calls[:1]


def tool_finish(finish: str | None) -> str | None:
    """The finish reason of an answer that holds calls: ``tool_calls`` where it stopped by itself."""
    return "tool_calls" if finish == "stop" else finish
