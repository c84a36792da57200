"""The ingress's checks of a request before any engine sees it, after the guard
(deployments/guard.py) has read its body in time and within its size: the API key, the body as
JSON, the body as its endpoint's request model (unknown fields ignored and counted, or refused
with ``strict_request_fields``), and the model's name."""

from __future__ import annotations

import hmac
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request

from deployments.api.base import ApiError, parse_body, read_request
from deployments.client import sized

log = logging.getLogger(__name__)

MAX_FIELD_NAMES = 256  # distinct ignored field names counted (a client cannot grow the table without bound)


async def take_body(request: Request) -> bytes:
    """The request's body, read once and not kept on the request (starlette's ``body()`` would
    cache it on the request object, which a stream holds to its end)."""
    chunks = [chunk async for chunk in request.stream() if chunk]
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class RequestReader:
    def __init__(self, api_key: str | list[str] | None, strict: bool, model_names: list[str], bodies: ThreadPoolExecutor,
                 salt_by_key: bool = False) -> None:
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self.api_keys = [k.encode() for k in keys if k]
        self.api_key = bool(self.api_keys)
        self.strict, self.model_names, self.bodies = strict, model_names, bodies
        # a key's salt: a keyed hash of it, so the salt names no key where it is seen (logs, slots)
        self.key_salts = [hmac.new(b"pgroups cache salt", k, "sha256").hexdigest()[:32] for k in self.api_keys] \
            if salt_by_key else []
        self.ignored_fields: dict[str, int] = {}  # field name -> requests that sent it (each logged once)

    def check_auth(self, request: Request) -> int:
        """The index of the request's API key among the server's (0 without keys); 401 otherwise."""
        if not self.api_keys:
            return 0
        h = request.headers.get("authorization", "")
        # Anthropic's clients send the key as x-api-key
        token = (h[7:] if h[:7].lower() == "bearer " else request.headers.get("x-api-key", "")).encode()
        # every key compared, in constant time each: which one matched shows in no timing
        matched = [hmac.compare_digest(token, k) for k in self.api_keys] if token else []
        if not any(matched):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)")
        return matched.index(True)

    async def body_json(self, request: Request, raw: bytes | None = None) -> dict | None:
        """The body (``raw``, else read now) as a JSON object; None: no body."""
        if raw is None:
            raw = await take_body(request)
        if not raw:
            return None
        return await sized(self.bodies, len(raw), parse_body, raw)

    def _check_model(self, name: str | None) -> None:
        """Any name serves the one model, as llama-server does (clients left at their default,
        ``gpt-4o-mini``, work); with ``strict_request_fields`` an unknown name is OpenAI's 404."""
        if self.strict and name and name not in self.model_names:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_names[0]!r}", "model")

    def _validate(self, model_cls: type, body: dict) -> Any:
        req, unknown = read_request(model_cls, body, self.strict)
        for name in unknown:
            if name not in self.ignored_fields:
                log.warning("ignoring the unknown request field %r (logged once; set strict_request_fields to "
                            "refuse unknown fields)", name)
            if name in self.ignored_fields or len(self.ignored_fields) < MAX_FIELD_NAMES:
                self.ignored_fields[name] = self.ignored_fields.get(name, 0) + 1
        return req

    async def read(self, request: Request, model_cls: type) -> tuple[Any, int]:
        """The request's body as ``model_cls``, checked (auth, JSON, fields), and the body's
        size; raises ``ApiError``. Neither the body nor its parsed form is kept past this."""
        key = self.check_auth(request)
        raw = await take_body(request)
        n_bytes = len(raw)
        body = await self.body_json(request, raw)
        del raw
        if body is None:
            raise ApiError(400, "the request needs a JSON body")
        req = await sized(self.bodies, n_bytes, self._validate, model_cls, body)
        del body
        self._check_model(getattr(req, "model", None))
        if self.key_salts and hasattr(req, "cache_salt"):  # the key's salt before the request's own
            req.cache_salt = self.key_salts[key] + "/" + (req.cache_salt or "")
        return req, n_bytes
