"""The configuration reference, generated from the code: every key of a Serve config's ``args:``
(``AppArgs``, which holds every key of the engine's ``EngineConfig``) with its type, default and
description, one source. ``python -m deployments.reference`` writes the tables into
docs/configuration.md between its markers; tests/test_docs.py fails when page and code differ."""

from __future__ import annotations

import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from deployments.args import AppArgs
from engine.config import EngineConfig
from engine.models import MODELS

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
ROOT = MODELS.parent
SECTIONS = {"engine config": "engine", "app args": "app"}


def _type(t: Any) -> str:
    """A field's type as a config author writes it: ``int``, ``list[str]``, ``"a" | "b"``."""
    origin = typing.get_origin(t)
    if origin is typing.Literal:
        return " \\| ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in typing.get_args(t))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in typing.get_args(t))
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type(a) for a in typing.get_args(t))}]"
    if t is type(None):
        return "null"
    if isinstance(t, type) and issubclass(t, BaseModel):
        return "mapping"
    return getattr(t, "__name__", str(t))


def _default(f: FieldInfo) -> str:
    if f.is_required():
        return "required"
    value = f.get_default(call_default_factory=True)
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    text = str(value)
    if text.startswith(str(ROOT) + "/"):  # a shipped file: the path from the repository's root
        text = text[len(str(ROOT)) + 1:]
    return f"`{text}`"


def _nested(t: Any) -> type[BaseModel] | None:
    for a in (t, *typing.get_args(t)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _rows(model: type[BaseModel], keys: list[str], prefix: str = "") -> list[str]:
    rows = []
    for key in keys:
        f = model.model_fields[key]
        text = re.sub(r"\s+", " ", (f.description or "").strip()).replace("|", "\\|")
        rows.append(f"| `{prefix}{key}` | {_type(f.annotation)} | {_default(f)} | {text} |")
        sub = _nested(f.annotation)
        if sub is not None:
            rows += _rows(sub, list(sub.model_fields), f"{prefix}{key}.")
    return rows


def table(section: str) -> str:
    """``engine``: the keys the engine reads (with the defaults the app gives them); ``app``:
    the keys the deployment adds."""
    engine_keys = list(EngineConfig.model_fields)
    keys = engine_keys if section == "engine" else [k for k in AppArgs.model_fields if k not in engine_keys]
    head = ["| key | type | default | meaning |", "|---|---|---|---|"]
    return "\n".join(head + _rows(AppArgs, keys)) + "\n"


def render(page: str) -> str:
    """``page`` with every generated section replaced by the code's tables."""
    for marker, section in SECTIONS.items():
        begin, end = f"<!-- BEGIN GENERATED: {marker} -->", f"<!-- END GENERATED: {marker} -->"
        if begin not in page or end not in page:
            raise ValueError(f"{PAGE.name} lacks the markers of the {marker!r} table")
        before, rest = page.split(begin, 1)
        _, after = rest.split(end, 1)
        page = f"{before}{begin}\n{table(section)}{end}{after}"
    return page


def main(argv: list[str]) -> int:
    page = PAGE.read_text()
    new = render(page)
    if "--check" in argv:
        if new != page:
            print(f"{PAGE} differs from the code: run python -m deployments.reference", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
