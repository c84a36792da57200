"""A tool call's arguments streamed while the model writes them, as OpenAI streams them: the call's
id and name once its head is read, then its arguments' JSON a piece at a time.

What goes out is the canonical JSON the whole answer's call carries (``canonical``), written as
far as it is certain:

- ``JsonArgs`` rewrites arguments the model writes as JSON (Hermes, Mistral, Llama 3, DeepSeek,
  Kimi, harmony): each punctuation mark at once, a string's text as its characters come (an
  escape once it is whole), a number or a literal once it has ended.
- ``XmlArgs`` writes the JSON object of a Qwen3-Coder or GLM call's parameters: a string
  parameter's text as it comes (the whitespace its reading trims held until more text follows),
  any other value once its closing tag is read.

``find_head`` finds where a call begins in the held text of an answer: the function's name and
where its arguments start, in every syntax ``engine.text.tool_calls`` reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.text.stream import partial_stop_suffix


@dataclass
class CallPart:
    """A piece of one streamed call: ``first`` carries its id and name, ``last`` ends it; the
    ``arguments`` of a call's parts, joined, are its arguments."""

    index: int
    id: str
    name: str
    arguments: str
    first: bool = False
    last: bool = False


def calls_of(parts: list[CallPart]) -> list[dict[str, Any]]:
    """The whole calls that ``parts`` spell, in their order."""
    calls: dict[int, dict[str, Any]] = {}
    for p in parts:
        c = calls.setdefault(p.index, {"id": p.id, "type": "function", "function": {"name": p.name, "arguments": ""}})
        c["function"]["arguments"] += p.arguments
    return [calls[i] for i in sorted(calls)]


def whole_call(index: int, call: dict[str, Any]) -> CallPart:
    """A call read whole, as one part."""
    fn = call["function"]
    return CallPart(index, call["id"], fn["name"], fn["arguments"], first=True, last=True)


_LONE = re.compile("[\ud800-\udfff]")


def canonical(value: Any) -> str:
    """A call's arguments as they go out: JSON with its text as text, but a surrogate half the model
    wrote as an escape and left unpaired kept as that escape (no UTF-8 can carry it)."""
    return _LONE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


_dumps = canonical


_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = set("0123456789+-.eE")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})')
_HIGH = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}$")


class JsonArgs:
    """Arguments written as JSON, rewritten into their canonical text as they come. ``feed``
    takes the text from the arguments' start on (all of it, each time) and returns what can go
    out now; ``done`` once the value is whole (``read``: where it ended), ``broken`` where the
    text is no JSON (nothing more goes out)."""

    def __init__(self) -> None:
        self.read = 0  # characters of the arguments' text consumed
        self.stack: list[str] = []  # the open containers' closing marks
        self.expect = "value"  # value, key, colon, comma (or a close), string
        self.empty = False  # the innermost container was just opened
        self.in_key = False  # the open string is a key
        self.string_sent = 0  # where the open string's text not yet out starts
        self.done = False
        self.broken = False

    def feed(self, text: str) -> str:
        out: list[str] = []
        while not (self.done or self.broken) and self.read < len(text):
            if self.expect == "string":
                if not self._string(text, out):
                    break
                continue
            ch = text[self.read]
            if ch in " \t\r\n":
                self.read += 1
                continue
            if self.stack and ch == self.stack[-1] and (self.expect == "comma" or self.empty):
                self.stack.pop()
                self._took(ch, out)
                self._value_ended()
            elif self.expect in ("value", "key") and ch == '"':
                self.in_key = self.expect == "key"
                self._took(ch, out)
                self.expect, self.string_sent = "string", self.read
            elif self.expect == "value" and ch in "{[":
                self.stack.append("}" if ch == "{" else "]")
                self._took(ch, out)
                self.expect, self.empty = ("key" if ch == "{" else "value"), True
            elif self.expect == "colon" and ch == ":":
                self._took(": ", out, 1)
                self.expect = "value"
            elif self.expect == "comma" and ch == ",":
                self._took(", ", out, 1)
                self.expect = "key" if self.stack[-1] == "}" else "value"
            elif self.expect == "value":
                if not self._scalar(text, out):
                    break
            else:
                self.broken = True
        return "".join(out)

    def _took(self, piece: str, out: list[str], n: int = 1) -> None:
        self.read += n
        self.empty = False
        out.append(piece)

    def _value_ended(self) -> None:
        if self.stack:
            self.expect = "comma"
        else:
            self.done = True

    def _string(self, text: str, out: list[str]) -> bool:
        """The open string's text as far as it is whole; False: wait for more."""
        i, n = self.read, len(text)
        while i < n and text[i] != '"':
            if text[i] == "\\":
                m = _ESCAPE.match(text, i)
                if m is None:
                    if not re.fullmatch(r"\\(u[0-9a-fA-F]{0,3})?", text[i:]):
                        self.broken = True  # no escape JSON knows
                    break  # else: an escape not yet whole
                i = m.end()
            elif text[i] < " ":
                self.broken = True  # JSON's strings hold no raw control characters
                break
            else:
                i += 1
        closed = i < n and text[i] == '"' and not self.broken
        upto = i
        if not closed and _HIGH.search(text[self.string_sent:upto]):
            upto -= 6  # a surrogate's first half waits for its second
        if upto > self.string_sent:
            out.append(_dumps(json.loads('"' + text[self.string_sent:upto] + '"'))[1:-1])
            self.string_sent = upto
        self.read = i
        if not closed:
            return False
        self.read = i + 1
        out.append('"')
        if self.in_key:
            self.expect = "colon"
        else:
            self._value_ended()
        return True

    def _scalar(self, text: str, out: list[str]) -> bool:
        """A number or a literal once it has ended; False: wait for more."""
        rest = text[self.read:self.read + 9]
        for lit in _LITERALS:
            if rest.startswith(lit):
                self.read += len(lit)
                out.append(_dumps(json.loads(lit)))
                self._value_ended()
                return True
            if lit.startswith(rest):
                return False
        end = self.read
        while end < len(text) and text[end] in _NUMBER_CHARS:
            end += 1
        if end == len(text):
            return False  # the number may go on
        m = _NUMBER.fullmatch(text, self.read, end)
        if m is None:
            self.broken = True  # "1.", "1e", "01", "x": no number
            return False
        self.read = m.end()
        out.append(_dumps(json.loads(m.group(0))))
        self._value_ended()
        return True


class XmlArgs:
    """A Qwen3-Coder (``<parameter=P>value</parameter>``) or GLM
    (``<arg_key>P</arg_key><arg_value>value</arg_value>``) call's parameters as a JSON object.
    ``feed`` takes the call's body from its head on (all of it, each time) and returns what can
    go out; ``done`` once the body's end is read (``read``: where it is). ``value_of`` reads a
    value as the whole answer's reading does: ``(raw, types, trim) -> value``."""

    def __init__(self, glm: bool, types: dict[str, set[str]], value_of: Callable[[str, set[str], bool], Any]) -> None:
        self.glm = glm
        self.types = types
        self.value_of = value_of
        self.read = 0
        self.n_params = 0
        self.opened = False
        self.key: str | None = None  # the open parameter's name
        self.sent = 0  # how much of a string value's trimmed text went out
        self.scanned = 0  # the text looked at for the open value's end
        self.done = False
        self.broken = False
        self.ends = ("</tool_call>",) if glm else ("</function>", "</tool_call>")
        self.lead = "<arg_key>" if glm else "<parameter="
        self.value_ends = (("</arg_value>",) if glm else ("</parameter>", "<parameter=")) + self.ends
        self.head = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>" if glm else r"<parameter=([^>\n]+)>", re.S)
        self.trim_chars = "\n" if glm else None  # GLM's values lose their newlines, Qwen's every space

    def feed(self, text: str) -> str:
        out: list[str] = [] if self.opened else ["{"]
        self.opened = True
        while not self.done and self.read < len(text):
            if not (self._next_key(text, out) if self.key is None else self._value(text, out)):
                break
        return "".join(out)

    def _next_key(self, text: str, out: list[str]) -> bool:
        """The next parameter's head, the body's end, or text between parameters (skipped, as the
        whole reading skips it); False: wait for more."""
        rest = text[self.read:]
        if m := self.head.match(text, self.read):
            self.key = m.group(1) if self.glm else m.group(1).strip()
            self.read, self.sent, self.scanned = m.end(), 0, 0
            out.append((", " if self.n_params else "") + _dumps(self.key) + ": " + ('"' if self._is_string() else ""))
            self.n_params += 1
            return True
        if rest.startswith(self.ends):
            self.done = True
            out.append("}")
            return False
        if any(m.startswith(rest) for m in (self.lead, *self.ends)) or (rest.startswith(self.lead) and len(rest) < 4096):
            return False  # may still become a head or the end
        self.read += 1
        return True

    def _is_string(self) -> bool:
        return "string" in self.types.get(self.key or "", set())

    def _value(self, text: str, out: list[str]) -> bool:
        start = max(self.read, self.scanned)  # no value end begins before what was looked at
        ends = [(j, e) for e in self.value_ends if (j := text.find(e, start)) >= 0]
        j, end = min(ends) if ends else (len(text) - partial_stop_suffix(text, self.value_ends), None)
        self.scanned = len(text) - max(map(len, self.value_ends))
        raw = text[self.read:j]
        if not self._is_string():
            if end is None:
                return False
            out.append(_dumps(self.value_of(raw, self.types.get(self.key or "", set()), not self.glm)))
        else:  # what is certain of the trimmed text: all of it once it has ended, else less its trailing space
            lead = raw.lstrip(self.trim_chars)
            certain = lead.strip(self.trim_chars) if end is not None else lead.rstrip(self.trim_chars)
            if len(certain) > self.sent:
                out.append(_dumps(certain[self.sent:])[1:-1])
                self.sent = len(certain)
            if end is None:
                return False
            out.append('"')
        self.key = None
        self.read = j + len(end) if end in ("</parameter>", "</arg_value>") else j
        return True


# ---- where a call begins ---------------------------------------------------------------------------

_NAME = r"[A-Za-z0-9_.\-]{1,64}"
_JSON_HEAD = re.compile(rf'\{{\s*"name"\s*:\s*"({_NAME})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
_QWEN_HEAD = re.compile(r"<tool_call>\s*<function=([^>\n]+)>")
_GLM_HEAD = re.compile(rf"<tool_call>\s*({_NAME})\s*(?=<arg_key>|</tool_call>)")
_ARGS_HEAD = re.compile(rf"({_NAME})\[ARGS\]\s*(?=\S)")  # Mistral's name[ARGS]{{...}}


@dataclass(frozen=True)
class Head:
    start: int  # where the call's text begins
    name: str
    args: int  # where its arguments begin
    kind: str  # json, qwen, glm


def find_head(text: str, pos: int, extra: tuple[re.Pattern, ...]) -> Head | None:
    """The next call head in ``text`` from ``pos`` whose arguments have begun. ``extra``: more
    JSON-argument heads (DeepSeek's, Kimi's), each naming the function in its group 1."""
    found = [Head(m.start(), m.group(1).strip(), m.end(), kind)
             for pat, kind in ((_JSON_HEAD, "json"), (_QWEN_HEAD, "qwen"), (_GLM_HEAD, "glm"), (_ARGS_HEAD, "json"),
                               *((p, "json") for p in extra))
             if (m := pat.search(text, pos)) is not None]
    if not found:
        return None
    return min(found, key=lambda h: h.start)
