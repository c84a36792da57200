"""What every API module is made of: the body boundary (JSON in, a validated request out,
or a 4xx), error values and shapes, JSON out with no non-finite number, and the two kinds of
endpoint object the ingress serves (a generating endpoint with its shaper, a call).

The boundary holds by construction: whatever a body holds, ``read_request`` ends in the
request or in an ``ApiError`` (a 400 naming the field where one is known), never in
another exception; the shapers write with ``dumps``, which cannot write NaN or Infinity.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator

from deployments.errors import CLIENT_ERRORS, ERROR_TYPES, ApiError, error_type  # noqa: F401 - their home

MAX_PROMPT_CHARS = 1_000_000
MAX_JSON_DEPTH = 64  # objects and arrays inside each other in a request body
# What a body may hold, whatever its size: a value costs far more once parsed and validated than
# it takes in JSON (an empty object 3 bytes, a dict of 64; a failed item of a list, an error of
# about a kilobyte each), so 8 MB of small values would cost gigabytes before their 400.
MAX_JSON_CONTAINERS = 65_536  # objects and arrays in a request body
MAX_JSON_STRINGS = 262_144  # strings (object keys too) in a request body
MAX_ARRAY = 65_536  # items of an array, but for one of token ids (integers) in a field that takes them
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
MAX_FIELD_NAME = 100  # characters of an unknown field's name that are kept (logged, counted)
MAX_UNKNOWN_PER_BODY = 32  # unknown field names kept of one body
NEG_INF_LOGPROB = -9999.0  # how OpenAI and vLLM write a log probability of minus infinity


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ApiError(400, f"the body holds the number {text[:40]}, which is not finite")
    return v


def _no_constant(name: str) -> float:
    raise ApiError(400, f"the body holds {name}, which is not JSON (non-finite numbers are refused)")


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as JSON, or ``ApiError`` with what is wrong: not JSON, not an object,
    nested deeper than ``MAX_JSON_DEPTH``, a number that is not finite (``NaN``, ``Infinity``,
    ``1e999``), or text that is not Unicode (a lone surrogate escape such as ``"\\ud800"``
    parses, but no answer that echoes it could be encoded), or more values than the
    ``MAX_JSON_*`` bounds and ``MAX_ARRAY`` allow (counted before it is parsed)."""
    _count_values(raw)
    try:
        body = json.loads(raw, parse_float=_finite_float, parse_constant=_no_constant)
    except ApiError:
        raise
    except RecursionError:
        raise ApiError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, list) and len(node) > MAX_ARRAY:
            if not all(type(x) is int for x in node):
                raise ApiError(400, f"the body holds an array of {len(node)} items: at most {MAX_ARRAY}, but for "
                                "token ids (integers)")
            continue
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            for text in (k, v):
                if isinstance(text, str) and not text.isascii():
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        raise ApiError(400, "the body holds a lone surrogate (\\ud800-\\udfff escape) that is "
                                        "not text") from None
            if isinstance(v, dict | list):
                stack.append((v, depth + 1))
    return body


def _count_values(raw: bytes) -> None:
    """``ApiError`` for a JSON text of more objects, arrays or strings than a body may hold. The
    quick count takes brackets and quotes inside strings too; only when it is over a bound are
    the strings walked, counting the brackets between them, until a bound is passed."""
    if raw.count(b"{") + raw.count(b"[") <= MAX_JSON_CONTAINERS and raw.count(b'"') <= 2 * MAX_JSON_STRINGS:
        return
    n_containers, n_strings, at = 0, 0, 0
    for m in _JSON_STRING.finditer(raw):
        n_containers += raw.count(b"{", at, m.start()) + raw.count(b"[", at, m.start())
        n_strings, at = n_strings + 1, m.end()
        if n_containers > MAX_JSON_CONTAINERS or n_strings > MAX_JSON_STRINGS:
            break
    else:
        n_containers += raw.count(b"{", at) + raw.count(b"[", at)
    if n_containers > MAX_JSON_CONTAINERS:
        raise ApiError(413, f"the body holds over {MAX_JSON_CONTAINERS} objects and arrays, the most it may")
    if n_strings > MAX_JSON_STRINGS:
        raise ApiError(413, f"the body holds over {MAX_JSON_STRINGS} strings, the most it may")


def _takes_ids(annotation: Any) -> bool:
    """Whether a field of this type takes a list of token ids (``list[int]``, inside a union)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        return args == (int,)
    return origin is not None and any(_takes_ids(a) for a in args)


@functools.cache
def _id_fields(cls: type[BaseModel]) -> frozenset[str]:
    """The body names of ``cls``'s fields that take token ids: arrays of any length."""
    return frozenset(f.alias or name for name, f in cls.model_fields.items() if _takes_ids(f.annotation))


class Bounded(BaseModel):
    """A model that takes an array longer than ``MAX_ARRAY`` only in a field of token ids:
    pydantic validates every item and keeps an error for each that fails (4 million numbers
    where strings belong: 4.8 GB and 33 s), so a long array anywhere else is refused first."""

    @model_validator(mode="before")
    @classmethod
    def _short_arrays(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for k, v in data.items():
                if isinstance(v, list) and len(v) > MAX_ARRAY and k not in _id_fields(cls) \
                        and k in _body_names(cls):
                    raise ValueError(f"{str(k)[:MAX_FIELD_NAME]}: an array of {len(v)} items, at most {MAX_ARRAY}")
        return data


@functools.cache
def _body_names(cls: type[BaseModel]) -> frozenset[str]:
    """The names a body gives ``cls``'s fields: each field's alias (llama-server's
    ``speculative.n_max``), else its name."""
    return frozenset(f.alias or name for name, f in cls.model_fields.items())


class ApiModel(Bounded):
    """A request body read as llama-server and vLLM read theirs: a field it does not know is
    set aside (its name, cut to ``MAX_FIELD_NAME`` characters, goes to the validation
    context's ``unknown`` list, for the ingress to log and count, or to refuse with
    ``strict_request_fields``), and ``null`` is the field's default, for every field."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _lenient(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data
        known = _body_names(cls)
        unknown = [k for k in data if k not in known]
        names = info.context.get("unknown") if info.context is not None else None
        if unknown and names is not None:
            qualified = info.context.get("qualified")
            for k in unknown[:max(0, MAX_UNKNOWN_PER_BODY - len(names))]:
                k = str(k)[:MAX_FIELD_NAME]
                names.append(f"{cls.__name__}.{k}" if qualified else k)
        return {k: v for k, v in data.items() if v is not None and k in known}

    def served_as(self) -> Any:
        """The request the engine runs for this one: itself, or (Responses, Messages) the chat
        request it is served as."""
        return self

    def check(self) -> None:
        """What the fields mean together, checked once the body is read (a generating request:
        its sampling); raises what a bad body causes."""


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """The first errors of a validation, each with its field, and the first field's name."""
    parts, first = [], None
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        first = first or loc or None
        msg = str(err.get("msg", "invalid"))[:300]
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts), first


def read_request(model_cls: type[BaseModel], body: dict[str, Any], strict: bool = False) -> tuple[Any, list[str]]:
    """``body`` as ``model_cls`` and the names of the fields it ignored, or ``ApiError``:
    whatever a validator or a conversion it calls raises on a body of the wrong shape (a
    TypeError or an AttributeError too, which pydantic lets through) is the client's 400.
    ``strict``: ignored fields are a 400 too."""
    unknown: list[str] = []
    try:
        req = model_cls.model_validate(body, context={"unknown": unknown})
        if isinstance(req, ApiModel):
            req.served_as().check()
    except ValidationError as e:
        message, param = validation_message(e)
        raise ApiError(400, message, param) from None
    except ApiError:
        raise
    except CLIENT_ERRORS as e:
        raise ApiError(400, f"the body's shape is not one {model_cls.__name__} takes: {str(e)[:300] or type(e).__name__}") \
            from None
    if strict and unknown:
        raise ApiError(400, f"unknown fields {sorted(set(unknown))}: Extra inputs are not permitted "
                        "(strict_request_fields is on)")
    return req, unknown


# ---- errors --------------------------------------------------------------------------------------

def error_body(message: str, type_: str, code: int | str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def openai_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return error_body(message, error_type(status), status, param)


ErrorShape = Callable[..., dict[str, Any]]  # (status, message[, param]) -> the error body


# ---- JSON out ------------------------------------------------------------------------------------


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced: minus infinity (a log probability of a
    token the chain removed) as ``NEG_INF_LOGPROB``, plus infinity as its opposite, NaN as null."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        if math.isnan(obj):
            return None
        return NEG_INF_LOGPROB if obj < 0 else -NEG_INF_LOGPROB
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """JSON text that any client can read: never NaN or Infinity (``finite``), Unicode as is.
    The common case costs one ``json.dumps``; only an answer holding a non-finite number is
    walked."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(finite(obj), ensure_ascii=False, allow_nan=False)


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + dumps(obj).encode() + b"\n\n"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# ---- choices -------------------------------------------------------------------------------------


def member_ids(rid: str, n: int) -> list[str]:
    """The engine's request id of each choice of a request with ``n`` choices."""
    return [rid] + [f"{rid}#{i}" for i in range(1, n)]


def choice_index(request_id: str) -> int:
    _, sep, tail = request_id.rpartition("#")
    return int(tail) if sep else 0


def by_choice(batch: list[Any]) -> dict[int, list[Any]]:
    """A batch of outputs split per choice, each in arrival order."""
    out: dict[int, list[Any]] = {}
    for o in batch:
        out.setdefault(choice_index(o.request_id), []).append(o)
    return out


# ---- the endpoint objects ------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """What a shaper is made from: one request, as the engine replica took it."""

    rid: str
    model: str  # the served model's name
    request: Any  # the API's request, validated
    run: Any  # the request the engine runs (a Responses or Messages request's chat request)
    submitted: Any  # api.values.Submitted


class Shaper(Protocol):
    """One request's answer in its API's shape: ``add`` each batch of outputs and ``final``
    (the whole answer's JSON body), or, streamed, ``opening``, ``events`` per batch and
    ``closing`` after every choice's last output, or ``failed`` in its place."""

    def add(self, batch: list[Any]) -> None: ...

    def final(self) -> Any: ...

    def opening(self) -> bytes: ...

    def events(self, batch: list[Any]) -> bytes: ...

    def closing(self) -> bytes: ...

    def failed(self, status: int, message: str) -> bytes: ...


@dataclass(frozen=True)
class Generate:
    """A generating endpoint: its paths (the first documented), the request model that reads
    its body, the id prefix of its answers, the shaper of its answer and its error shape."""

    paths: tuple[str, ...]
    request: type[BaseModel]
    id_prefix: str
    shaper: Callable[[Answer], Shaper]
    error: ErrorShape = openai_error
    summary: str = ""


@dataclass(frozen=True)
class Call:
    """An endpoint whose body is one call and one JSON answer: ``call(engine_handle, request,
    body_bytes)`` is awaited, a call on an engine replica; None (the default): the request's own
    ``run(maker)`` in the ingress, which needs only the model's vocabulary and template
    (``deployments.prompts``). ``answer(result, request, model)`` is the body of a result that
    is not an ``ApiError``."""

    paths: tuple[str, ...]
    request: type[BaseModel]
    call: Callable[[Any, Any, int], Awaitable[Any]] | None = None
    answer: Callable[[Any, Any, str], Any] = lambda result, _req, _model: result
    error: ErrorShape = openai_error
    summary: str = ""

