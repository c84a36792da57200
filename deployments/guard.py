"""The HTTP layer's own limits and browser safety, as one ASGI middleware in front of every
route: what no request gets past, whatever its route.

- **Browser safety.** Served on a loopback address without an API key, only loopback
  ``Host`` names are answered (a page the user visits cannot reach the server through DNS
  rebinding); a request from a foreign ``Origin`` is refused unless the config lists that
  origin (``cors_origins``; listed ones get llama-server's CORS headers and preflight); a
  browser's POST (one with an ``Origin``) must say ``application/json`` (no CSRF with a
  ``text/plain`` form post).
- **Bodies arrive in time.** A body must arrive within ``body_timeout_s`` plus its size at
  ``min_body_rate``, or the connection gets a 408 and is closed: half-sent bodies hold nothing
  for long. A body over ``max_body_bytes`` is a 413 as soon as that shows. The body is read
  here, once, and handed to the route whole.
- **Ongoing requests per client address** are bounded (``max_requests_per_client``: 429), so
  one address stalling thousands of sockets leaves the others served.

Errors come in the route's own error shape (``error_shape``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from deployments.api.base import ErrorShape, openai_error

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")
EXEMPT_PATHS = ("/health", "/v1/health")  # a load balancer's probe, from any Host


@dataclass
class GuardSettings:
    """The guard's settings (the app's arguments, set when the ingress starts)."""

    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout_s: float = 10.0
    min_body_rate: float = 1024 * 1024  # bytes/s: a body may take body_timeout_s + size / rate
    max_requests_per_client: int = 256
    max_requests: int = 2048  # in flight in all (the ingress deployment's max_ongoing_requests)
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    keyless: bool = True  # no api_key: the Host check applies on loopback
    error_shape: Callable[[str], ErrorShape] = field(default=lambda _path: openai_error)
    refused: dict[str, int] = field(default_factory=dict)  # status -> requests the guard refused


def is_loopback_host(name: str) -> bool:
    name = name.strip("[]").rstrip(".").lower()
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_name(host: str) -> str:
    """The name of a ``Host`` header (``[::1]:8000`` -> ``::1``, ``a:80`` -> ``a``)."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` is this server's own (the page ``/`` serves): its host and port are
    the request's ``Host``."""
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    default = {"http": "80", "https": "443"}[parts.scheme]
    def norm(netloc: str) -> str:
        netloc = netloc.lower()
        return netloc if netloc.rsplit(":", 1)[-1].isdigit() and not netloc.endswith("]") else f"{netloc}:{default}"
    return norm(parts.netloc) == norm(host)


class _Refused(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


class Guard:
    """The middleware (``app.add_middleware(Guard, settings_of=...)``): ``settings_of()`` gives the
    serving ingress's settings (None: none yet, every request passes to the app)."""

    def __init__(self, app: Any, settings_of: Callable[[], GuardSettings | None]) -> None:
        self.app = app
        self.settings_of = settings_of
        self.ongoing: dict[str, int] = {}  # client address -> requests in flight (no entry at 0)
        self.total = 0  # requests in flight from every client

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        s = self.settings_of() if scope["type"] == "http" else None
        if s is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or ()}
        origin = headers.get("origin")
        path = scope.get("path", "")
        cors = self._cors(s, origin)
        try:
            self._check_host(s, scope, headers, path)
            if origin is not None and not same_origin(origin, headers.get("host", "")) and cors is None:
                raise _Refused(403, f"requests from the origin {origin[:200]!r} are refused: a web page may not "
                               "use this server unless its config lists the origin in cors_origins")
            if scope["method"] == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
                await self._preflight(send, cors or {}, headers)
                return
            if scope["method"] in ("POST", "PUT", "PATCH") and origin is not None:
                kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
                if kind != "application/json":
                    raise _Refused(415, "a request from a web page must send its body as application/json")
        except _Refused as e:
            await self._refuse(s, send, path, e, cors)
            return
        client = (scope.get("client") or ("?", 0))[0]
        if self.total >= s.max_requests:  # served directly, nothing else bounds them (deployments/direct.py)
            await self._refuse(s, send, path, _Refused(
                503, f"the server has {s.max_requests} requests in flight, its limit; retry", {"Retry-After": "1"}), cors)
            return
        if self.ongoing.get(client, 0) >= s.max_requests_per_client:
            await self._refuse(s, send, path, _Refused(
                429, f"too many requests in flight from {client} (max_requests_per_client "
                f"{s.max_requests_per_client})", {"Retry-After": "1"}), cors)
            return
        self.ongoing[client] = self.ongoing.get(client, 0) + 1
        self.total += 1
        try:
            if scope["method"] in ("POST", "PUT", "PATCH"):
                try:
                    receive = await self._buffered(s, receive, headers)
                except _Refused as e:
                    await self._refuse(s, send, path, e, cors, close=True)
                    return
                except _Gone:
                    return
            await self.app(scope, receive, self._with_cors(send, cors) if cors else send)
        finally:
            self.total -= 1
            n = self.ongoing[client] - 1
            if n:
                self.ongoing[client] = n
            else:
                del self.ongoing[client]

    # ---- the checks --------------------------------------------------------------------------

    @staticmethod
    def _check_host(s: GuardSettings, scope: dict, headers: dict[str, str], path: str) -> None:
        """No API key and reached on a loopback address: only loopback Host names (or listed ones)."""
        if not s.keyless or path in EXEMPT_PATHS:
            return
        server = (scope.get("server") or ("", 0))[0] or ""
        if not is_loopback_host(str(server)):
            return
        name = _host_name(headers.get("host", "")).lower()
        if is_loopback_host(name) or name in s.allowed_hosts or "*" in s.allowed_hosts:
            return
        raise _Refused(403, f"the Host {name[:200]!r} is not served: without an api_key this server answers "
                       "loopback names only (list others in allowed_hosts)")

    @staticmethod
    def _cors(s: GuardSettings, origin: str | None) -> dict[str, str] | None:
        """The CORS headers for a listed origin; None: not listed."""
        listed = s.cors_origins
        if origin is None or not listed:
            return None
        if "*" in listed:
            return {"Access-Control-Allow-Origin": "*"}
        if origin.rstrip("/").lower() in (o.rstrip("/").lower() for o in listed):
            return {"Access-Control-Allow-Origin": origin, "Access-Control-Allow-Credentials": "true", "Vary": "Origin"}
        return None

    async def _preflight(self, send: Callable, cors: dict[str, str], headers: dict[str, str]) -> None:
        allow = {**cors, "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                 "Access-Control-Allow-Headers": headers.get("access-control-request-headers", "*")[:1000],
                 "Access-Control-Max-Age": "600"}
        await send({"type": "http.response.start", "status": 204,
                    "headers": [(k.lower().encode(), v.encode("latin-1", "replace")) for k, v in allow.items()]})
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    async def _buffered(s: GuardSettings, receive: Callable, headers: dict[str, str]) -> Callable:
        """The whole body, read within its deadline, as a ``receive`` that hands it over at once
        (then the connection's own, for the disconnect)."""
        limit = s.max_body_bytes
        cl = headers.get("content-length")
        if cl is not None and cl.strip().isdigit() and int(cl) > limit:
            raise _Refused(413, f"request body larger than {limit} bytes")
        start = time.monotonic()
        parts: list[bytes] = []
        n = 0
        while True:
            left = start + s.body_timeout_s + n / s.min_body_rate - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except TimeoutError:
                raise _Refused(408, f"the request body did not arrive in time ({n} bytes after "
                               f"{time.monotonic() - start:.1f} s; body_timeout_s {s.body_timeout_s:g})") from None
            if message["type"] == "http.disconnect":
                raise _Gone
            chunk = message.get("body", b"")
            n += len(chunk)
            if n > limit:
                raise _Refused(413, f"request body larger than {limit} bytes")
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        given = False

        async def replay() -> dict:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    # ---- answers -----------------------------------------------------------------------------

    @staticmethod
    async def _refuse(s: GuardSettings, send: Callable, path: str, e: _Refused, cors: dict[str, str] | None,
                      close: bool = False) -> None:
        """The refusal in the route's error shape, counted by status."""
        s.refused[str(e.status)] = s.refused.get(str(e.status), 0) + 1
        body = json.dumps(s.error_shape(path)(e.status, e.message)).encode()
        hdrs = {"content-type": "application/json", "content-length": str(len(body)), **e.headers, **(cors or {})}
        if close:
            hdrs["connection"] = "close"
        await send({"type": "http.response.start", "status": e.status,
                    "headers": [(k.lower().encode(), v.encode("latin-1", "replace")) for k, v in hdrs.items()]})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    def _with_cors(send: Callable, cors: dict[str, str]) -> Callable:
        extra = [(k.lower().encode(), v.encode("latin-1", "replace")) for k, v in cors.items()]

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return sending


class _Gone(Exception):
    """The client went away while sending its body."""
