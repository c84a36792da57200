"""Tool calls read out of a model's answer, in every syntax ``engine.text.tools`` names (the request
side: tools into the prompt, the format a template shows, the forced-call grammar).

``parse_tool_calls`` reads a whole answer; ``ToolCallStream`` streams one: plain text goes out as
it comes, the text from a call's marker on is held, and each call goes out as it is written (its
name, then its arguments a piece at a time: ``engine.text.call_args``). An XML-style call's values (Qwen3-Coder's, GLM's) are typed by the offered tools' parameter
schemas (``arg_types``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.text.call_args import (
    CallPart,
    Head,
    JsonArgs,
    XmlArgs,
    canonical,
    find_head,
    whole_call,
)
from engine.text.stream import partial_stop_suffix

DS_CALLS = "<｜tool▁calls▁begin｜>"  # DeepSeek V3.1's markers: fullwidth bars, U+2581 for spaces
DS_CALL, DS_SEP, DS_CALL_END, DS_CALLS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
KIMI_CALLS, KIMI_CALL, KIMI_ARGS = "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", DS_CALLS, KIMI_CALLS)

def new_call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else canonical(arguments)
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
        out[fn.get("name", "")] = {k: schema_types(v) for k, v in props.items() if isinstance(k, str)}
    return out


def schema_types(schema: Any) -> set[str]:
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
            sub_types = schema_types(sub)
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
# heads of the calls whose arguments follow a marker, for streaming them (``call_args.find_head``)
_HEADS = tuple(re.compile(p.pattern + r"(?=\s*[\[{])") for p in (_DS_HEAD, _KIMI_HEAD))
# what opens one call (its text begins there, for a reading that ends where a call began)
OPENERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", DS_CALLS, KIMI_CALLS)
# what may stand between the calls of one answer (and before the first): markup, no text
_BETWEEN = re.compile("(?:\\s|[\\[\\],;}]|" + "|".join(map(re.escape, (
    "<tool_call>", "</tool_call>", "</function>", "[TOOL_CALLS]", "<|python_tag|>", DS_CALLS, DS_CALL_END,
    KIMI_CALLS, KIMI_CALL_END))) + ")*")


@dataclass
class _Live:
    """A call streamed while it is written."""

    index: int
    id: str
    head: Head
    reader: JsonArgs | XmlArgs
    start: int  # where its text begins: its marker, or its head where it has none of its own
    sent: str = ""  # its arguments as far as they went out
    closed: bool = False


class ToolCallStream:
    """Streams a tools request's text: plain text goes out as it comes, except a tail that
    could begin a call marker; from a marker on (or from an answer that opens with a JSON
    value) the text is held.

    ``parts`` gives the calls as they are written: a call's id and name once its head is read,
    its arguments' canonical JSON as far as it is certain (``engine.text.call_args``), and its
    end once the call is closed (``CALL_ENDS``) and read as the whole answer reads it (whatever
    of its arguments had not gone out). A call the stream cannot follow (a head in an order or
    place it does not know, a name the request did not offer) goes out whole once it is closed,
    and so does every call after it. ``finish`` gives the content and what is left of the
    calls. A reader never asked for ``parts`` reads the answer whole at ``finish``.

    A streamed call that the whole reading does not take for a call (cut by ``max_tokens``,
    or its arguments no JSON) ends with the arguments that went out, and the answer's reading
    ends where that call began: its text is no content."""

    def __init__(self, names: list[str], parallel: bool = True, types: ArgTypes | None = None) -> None:
        self.names = names
        self.parallel = parallel
        self.types = types
        self.held = ""
        self.holding = False  # a call has (maybe) started: hold the rest
        self.sent_any = False
        self.live: list[_Live] = []
        self.following = True  # the calls are followed as they are written
        self.n_given = 0  # calls begun in ``parts``, followed or whole
        self.cut_at: int | None = None  # where a streamed call that read as none began
        self._closed_at = 0  # the held text's length up to its last call end, when ``parts`` last looked
        self._looked = 0  # the held text's length when ``parts`` last looked

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
            cut = idx
        else:
            cut = len(self.held) - partial_stop_suffix(self.held, MARKERS)
        # the space before a call is no content (the whole reading strips it): hold it until text follows
        cut = len(self.held[:cut].rstrip())
        out, self.held = self.held[:cut], self.held[cut:]
        if out:
            self.sent_any = True
        return out

    def parts(self) -> list[CallPart]:
        """The calls' parts written since the last look, in the calls' order."""
        if not self.holding or self.cut_at is not None:
            return []
        out = self._follow()
        # only the text since the last look can hold a new call end (one may straddle it)
        start = max(0, self._looked - max(map(len, CALL_ENDS)))
        self._looked = len(self.held)
        end = max((i + len(m) for m in CALL_ENDS if (i := self.held.rfind(m, start)) >= 0), default=0)
        if end > self._closed_at:
            self._closed_at = end
            out += self._settle(parse_tool_calls(self.held[:end], self.names, self.types)[1])
        return sorted(out, key=lambda p: p.index)  # stable: each call's parts stay in order

    def finish(self) -> tuple[str, list[CallPart]]:
        """What is left: ``(content, parts)``."""
        if self.cut_at is not None:
            return parse_tool_calls(self.held[:self.cut_at], self.names, self.types)[0], []
        content, calls = parse_tool_calls(self.held, self.names, self.types)
        out = self._settle(calls)
        if self.cut_at is None and (unread := [c for c in self.live if not c.closed]):
            out += self._cut(unread[0])  # cut by the answer's end: no call to the whole reading
        if self.cut_at is not None:
            content = parse_tool_calls(self.held[:self.cut_at], self.names, self.types)[0]
        return content, sorted(out, key=lambda p: p.index)

    def _follow(self) -> list[CallPart]:
        """The parts of the calls being written: the open call's arguments, then each head read."""
        out: list[CallPart] = []
        while self.following:
            cur = self.live[-1] if self.live else None
            if cur is not None:
                piece = cur.reader.feed(self.held[cur.head.args:])
                if piece:
                    cur.sent += piece
                    out.append(CallPart(cur.index, cur.id, cur.head.name, piece))
                if cur.reader.broken:
                    self.following = False  # its end comes with the whole reading
                if not cur.reader.done:
                    break
            if self.n_given and not self.parallel:
                break
            pos = cur.head.args + cur.reader.read if cur is not None else 0
            head = find_head(self.held, pos, _HEADS)
            if head is None:
                break
            if head.name not in self.names or not _BETWEEN.fullmatch(self.held, pos, head.start):
                self.following = False
                break
            reader = JsonArgs() if head.kind == "json" else XmlArgs(head.kind == "glm", (self.types or {}).get(
                head.name, {}), xml_value)
            opener = max((self.held.rfind(m, pos, head.start) for m in OPENERS), default=-1)
            c = _Live(self.n_given, "call_" + uuid.uuid4().hex[:24], head, reader, opener if opener >= 0 else head.start)
            self.live.append(c)
            self.n_given += 1
            out.append(CallPart(c.index, c.id, head.name, "", first=True))
        return out

    def _settle(self, calls: list[dict[str, Any]]) -> list[CallPart]:
        """The ends of the calls the whole reading found (``calls``, in order): a streamed one gets
        what of its arguments had not gone out, the others go out whole."""
        out: list[CallPart] = []
        for k, call in enumerate(limit_calls(calls, self.parallel)):
            fn = call["function"]
            if k < len(self.live):
                c = self.live[k]
                if c.closed:
                    continue
                c.closed = True
                if fn["name"] != c.head.name or not fn["arguments"].startswith(c.sent):
                    return out + self._cut(c)
                out.append(CallPart(k, c.id, c.head.name, fn["arguments"][len(c.sent):], last=True))
                c.sent = fn["arguments"]
            elif k >= self.n_given:
                self.following = False  # a call the stream did not follow: the rest come whole
                self.n_given = k + 1
                out.append(whole_call(k, call))
        return out

    def _cut(self, c: _Live) -> list[CallPart]:
        """A streamed call the whole reading does not take for one: it ends as it went out, and
        so does the answer's reading (every later call with it)."""
        self.cut_at, self.following = c.start, False
        return [CallPart(x.index, x.id, x.head.name, "", last=True) for x in self.live[c.index:]
                if x is c or not x.closed]


def limit_calls(calls: list[dict[str, Any]], parallel: bool) -> list[dict[str, Any]]:
    return calls if parallel else calls[:1]


def tool_finish(finish: str | None) -> str | None:
    """The finish reason of an answer that holds calls: ``tool_calls`` where it stopped by itself."""
    return "tool_calls" if finish == "stop" else finish
