"""Chat templates: which one a model is served with, and rendering messages to a prompt.

The choice is llama-server's: ``chat_template_file`` (a Jinja file), else ``chat_template``
(a llama.cpp built-in name such as ``chatml`` or ``gemma``, or Jinja source), else the
template in the GGUF, else ``chatml`` with a warning. Jinja renders as Hugging Face's
``apply_chat_template`` does: a sandbox with loop controls, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text, ``bos_token`` / ``eos_token``,
``add_generation_prompt``, ``tools`` and any per-request ``chat_template_kwargs``.
A built-in name is rendered by llama.cpp itself (``llama_chat_apply_template``).

Rendering can be held to a length: Jinja's output is gathered piece by piece and stops once
longer, and so does ``tojson`` (a template's ``tojson(indent=4)`` of a deeply nested value
writes far more than the body held), so a message that cannot fit costs no more than the limit.
"""

from __future__ import annotations

import contextvars
import ctypes
import datetime
import json
import logging
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import llama_cpp

from engine.errors import RequestError

log = logging.getLogger(__name__)

# the render's bound (None: none), for tojson inside it
_BOUND: contextvars.ContextVar[Bound | None] = contextvars.ContextVar("template_bound", default=None)


class TemplateError(ValueError):
    """The template cannot render these messages (HTTP 400)."""


class TooLong(RequestError):
    """A prompt longer than the tokens it may take (HTTP 400); ``n_tokens``: its length in
    tokens where it was tokenised (None: its bytes alone showed it)."""

    def __init__(self, message: str, n_tokens: int | None = None) -> None:
        super().__init__(message)
        self.n_tokens = n_tokens


class Bound:
    """At most ``most`` characters of a text being written, as ``count`` counts them (``len``,
    or fewer where a vocabulary drops or swallows some): ``tally()`` gives an ``add(parts,
    piece)`` that raises ``TooLong`` once past. Characters are counted once their number passes
    ``most``, not before."""

    def __init__(self, most: int, count: Callable[[str], int] = len) -> None:
        self.most, self.count = most, count

    def tally(self) -> Callable[[list[str], str], None]:
        raw, counted = 0, None

        def add(parts: list[str], piece: str) -> None:
            nonlocal raw, counted
            parts.append(piece)
            raw += len(piece)
            if raw <= self.most:
                return
            if counted is None:
                counted = raw if self.count is len else self.count("".join(parts))
            else:
                counted += len(piece) if self.count is len else self.count(piece)
            if counted > self.most:
                raise TooLong(f"over {self.most} characters")

        return add


@cache
def builtin_names() -> tuple[str, ...]:
    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    arr = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(arr, n)
    return tuple(sorted(x.decode() for x in arr))


class ChatTemplate:
    """One model's chat template; ``render`` is safe from any thread."""

    def __init__(self, source: str, *, builtin: bool, bos_token: str, eos_token: str, origin: str) -> None:
        self.source = source
        self.builtin = builtin
        self.bos_token, self.eos_token = bos_token, eos_token
        self.origin = origin
        self._jinja = None if builtin else _compile(source)

    @classmethod
    def select(cls, gguf_template: str | None, *, name_or_source: str | None, file: str | None,
               bos_token: str, eos_token: str) -> ChatTemplate:
        kw = {"bos_token": bos_token, "eos_token": eos_token}
        if file:
            return cls(Path(file).read_text(), builtin=False, origin=f"file {file}", **kw)
        if name_or_source:
            if name_or_source in builtin_names():
                return cls(name_or_source, builtin=True, origin=f"built-in {name_or_source}", **kw)
            if "{%" not in name_or_source and "{{" not in name_or_source:
                raise ValueError(
                    f"chat_template {name_or_source!r} is neither Jinja nor a llama.cpp built-in: "
                    + ", ".join(builtin_names())
                )
            return cls(name_or_source, builtin=False, origin="chat_template", **kw)
        if gguf_template:
            return cls(gguf_template, builtin=False, origin="the GGUF", **kw)
        log.warning("the model has no chat template and none is configured: using chatml (as llama-server)")
        return cls("chatml", builtin=True, origin="built-in chatml (fallback)", **kw)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict] | None = None, kwargs: dict[str, Any] | None = None,
               bound: Bound | None = None) -> str:
        """The prompt; ``bound``: raises ``TooLong`` as soon as it is longer."""
        if self.builtin:
            text = self._render_builtin(messages, add_generation_prompt)
            if bound is not None:
                bound.tally()([], text)
            return text
        ctx = {**(kwargs or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
               "bos_token": self.bos_token, "eos_token": self.eos_token}
        if tools is not None:
            ctx["tools"] = tools
        token = _BOUND.set(bound)
        try:
            parts: list[str] = []
            if bound is None:
                parts.extend(self._jinja.generate(**ctx))
            else:
                add = bound.tally()
                for piece in self._jinja.generate(**ctx):
                    add(parts, piece)
            return "".join(parts)
        except (TemplateError, TooLong):
            raise
        except Exception as e:  # a template that fails on these messages is the request's problem
            raise TemplateError(f"chat template failed: {e}") from None
        finally:
            _BOUND.reset(token)

    def _render_builtin(self, messages: list[dict[str, Any]], add_ass: bool) -> str:
        keep = [(str(m.get("role", "")).encode(), _text(m.get("content")).encode()) for m in messages]
        arr = (llama_cpp.llama_chat_message * len(keep))(
            *[llama_cpp.llama_chat_message(role=r, content=c) for r, c in keep])
        cap = 2 * sum(len(r) + len(c) for r, c in keep) + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(cap)
            n = llama_cpp.llama_chat_apply_template(self.source.encode(), arr, len(keep), add_ass, buf, cap)
            if n < 0:
                raise TemplateError(f"llama.cpp cannot render the built-in template {self.source!r}")
            if n <= cap:
                return buf.raw[:n].decode("utf-8", "replace")
            cap = n
        raise TemplateError("chat template output did not fit")


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _raise(message: str) -> None:
    raise TemplateError(f"chat template error: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,  # noqa: ANN001
            sort_keys: bool = False) -> str:
    bound = _BOUND.get()
    kw = dict(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    if bound is None or indent is None:  # compact JSON is about as long as the body that held it
        return json.dumps(x, **kw)
    parts: list[str] = []
    add = bound.tally()
    for chunk in json.JSONEncoder(**kw).iterencode(x):  # indented: stop once longer than the prompt may be
        add(parts, chunk)
    return "".join(parts)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _compile(source: str):  # noqa: ANN202 - a jinja2 Template
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja: {e}") from None
