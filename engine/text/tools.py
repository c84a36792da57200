"""Tool calling, the request side: tools into the prompt, the syntax a template shows, the grammar
of a forced call. The calls are read back out of the answer by ``engine.text.tool_calls``.

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
own syntax, built from the tools' parameter schemas (``engine.text.forcing``). The parser accepts every syntax above,
whatever the format (a model does not always answer in the one its template shows), and
a bare JSON call only when it is the whole output and names one of the request's tools.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from engine.errors import RequestError
from engine.text.forcing import call_grammar
from engine.text.grammar import GrammarSpec
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
)


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

    def grammar(self, after: str | None = None) -> GrammarSpec | None:
        """For ``required`` or a named function: the grammar of a call in the format's own
        syntax (``engine.text.forcing``); ``after``: the marker that must close a thinking the
        prompt opened first (the call is content, never inside the thinking)."""
        if self.mode != "required":
            return None
        return call_grammar(self.format, self.offered(), self.parallel and self.forced_name is None, after)


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
