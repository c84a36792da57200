"""The HTTP layer's own limits and browser safety, as one ASGI middleware in front of every
route: what no request gets past, whatever its route.

- **One reading of Host and Origin.** A request has one ``Host`` of the form ``host[:port]``
  and at most one ``Origin`` that is a serialized origin (``scheme://host[:port]``, or
  ``null``), as a browser writes them; an absolute-form request target
  (``POST http://host/path``) is judged by its own host, which RFC 9112 (§3.2.2) says wins over
  ``Host``. Anything else is a 400 before any other check, so no two readers of a request (this
  guard, a route, a proxy in front) can take it for different hosts.
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
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

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


# a host as a browser writes it in Host and Origin: a DNS name or an IPv4 address (labels of
# letters, digits, "-" and "_", one dot at most at the end), or an IPv6 address in brackets;
# never userinfo ("a@b"), percent-escapes, spaces or any other character RFC 3986's reg-name allows
MAX_HOST_CHARS = 255
_NAME = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*\.?")
_PORT = re.compile(r"[0-9]{1,5}")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
_ABSOLUTE_TARGET = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<authority>[^/?#]*)(?P<path>/[^?#]*)?")


def parse_authority(text: str) -> tuple[str, int | None] | None:
    """``(host, port)`` of ``host[:port]`` (RFC 9110's ``uri-host [":" port]`` as browsers write
    it: no userinfo, a port of 1 to 65535 when there is a colon), the host lowercased and an IPv6
    address without its brackets; None: not that form."""
    if not text or len(text) > MAX_HOST_CHARS + 7:
        return None
    if text.startswith("["):
        end = text.find("]")
        host, rest = text[1:end], text[end + 1:]
        if end < 0 or "%" in host:  # no zone ids: a browser never writes one
            return None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
    else:
        host, colon, port_text = text.partition(":")
        rest = colon + port_text
        if len(host) > MAX_HOST_CHARS or not _NAME.fullmatch(host):
            return None
    if not rest:
        return host.lower(), None
    if rest[0] != ":" or not _PORT.fullmatch(rest[1:]) or not 0 < int(rest[1:]) < 65536:
        return None
    return host.lower(), int(rest[1:])


def parse_origin(text: str) -> tuple[str, str, int | None] | None:
    """``(scheme, host, port)`` of a serialized origin (``scheme://host[:port]``: no path, no
    trailing slash, no userinfo), lowercased; None: not one (``null`` neither: it has no host)."""
    scheme, sep, authority = text.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        return None
    parsed = parse_authority(authority)
    return (scheme.lower(), *parsed) if parsed is not None else None


def _host_name(host: str) -> str:
    """The name of a ``Host`` header (``[::1]:8000`` -> ``::1``, ``a:80`` -> ``a``)."""
    parsed = parse_authority(host)
    return parsed[0] if parsed is not None else host.lower()


def same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` is this server's own (the page ``/`` serves): its host and port are
    the request's ``Host`` (a port left out is the origin's scheme's default)."""
    o, h = parse_origin(origin), parse_authority(host)
    if o is None or h is None or o[0] not in ("http", "https"):
        return False
    default = {"http": 80, "https": 443}[o[0]]
    return (o[1], o[2] or default) == (h[0], h[1] or default)


@dataclass(frozen=True)
class Addressed:
    """What a request names as its server, read once: the authority it is judged by (the
    absolute-form target's, else the ``Host``'s, "" when an HTTP/1.0 request has none), its
    ``Origin`` (None: none sent), and the scope the app gets (an absolute-form target's path
    made origin-form)."""

    authority: str
    origin: str | None
    scope: dict


def _header_values(scope: dict, name: bytes) -> list[str]:
    return [v.decode("latin-1") for k, v in scope.get("headers") or () if k.lower() == name]


def addressed(scope: dict) -> Addressed:
    """The request's Host, Origin and target, each in the one form a browser writes, or
    ``_Refused(400)`` saying what is wrong.

    An absolute-form target comes as uvicorn's h11 protocol hands it (``raw_path`` and ``path``
    the whole target), or from the direct ingress's httptools protocol (``raw_path`` the whole
    target, ``path`` its path: ``KeepsRequestTarget``); behind Serve's proxy the proxy's parser
    has dropped its host before the request gets here, and it is judged by its ``Host``."""
    hosts, origins = _header_values(scope, b"host"), _header_values(scope, b"origin")
    if len(hosts) > 1:
        raise _Refused(400, f"the request has {len(hosts)} Host headers; one is allowed")
    if len(origins) > 1:
        raise _Refused(400, f"the request has {len(origins)} Origin headers; one is allowed")
    if not hosts and scope.get("http_version", "1.1") not in ("1.0", "0.9"):
        raise _Refused(400, "the request has no Host header (HTTP/1.1 requires one)")
    host = hosts[0] if hosts else None
    if host is not None and parse_authority(host) is None:
        raise _Refused(400, f"the Host {host[:200]!r} is not host[:port] (a name or an address, and a port "
                       "from 1 to 65535)")
    origin = origins[0] if origins else None
    if origin is not None and origin != "null" and parse_origin(origin) is None:
        raise _Refused(400, f"the Origin {origin[:200]!r} is not a serialized origin (scheme://host[:port])")
    root = scope.get("root_path", "") or ""
    raw = scope.get("raw_path") or scope.get("path", "").encode("latin-1", "replace")
    if root and raw.startswith(root.encode("latin-1", "replace")):  # uvicorn puts root_path before any target
        raw = raw[len(root.encode("latin-1", "replace")):]
    if not raw or raw.startswith(b"/"):
        return Addressed(host or "", origin, scope)
    target = raw.decode("latin-1")
    m = _ABSOLUTE_TARGET.fullmatch(target)
    if m is None or m["scheme"].lower() not in ("http", "https") or parse_authority(m["authority"]) is None:
        raise _Refused(400, f"the request target {target[:200]!r} is neither a path nor http(s)://host[:port]/path")
    path = m["path"] or "/"
    scope = {**scope, "path": root + unquote(path), "raw_path": root.encode("latin-1", "replace") + path.encode("latin-1")}
    return Addressed(m["authority"], origin, scope)


class KeepsRequestTarget:
    """A mixin for uvicorn's httptools protocol (the direct ingress's, ``deployments.direct``):
    a request target that is not a path (``http://host/path``, ``*``) reaches the scope whole in
    ``raw_path``, as uvicorn's h11 protocol hands it, where httptools would keep its path only
    and the guard could not judge its host."""

    url: bytes
    scope: dict

    def on_headers_complete(self) -> None:
        target = self.url
        super().on_headers_complete()  # type: ignore[misc]
        if not target.startswith(b"/") and "raw_path" in self.scope:
            root = (self.scope.get("root_path") or "").encode("latin-1", "replace")
            self.scope["raw_path"] = root + target.partition(b"?")[0]


def release(counts: dict[str, int], key: str) -> None:
    """One less of ``key`` in a per-address table that keeps no entry at 0 (so a client cannot
    grow it by coming and going)."""
    n = counts[key] - 1
    if n:
        counts[key] = n
    else:
        del counts[key]


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
        path = scope.get("path", "")
        try:
            named = addressed(scope)
        except _Refused as e:  # a request no browser sends: no answer on its connection after this one
            await self._refuse(s, send, path, e, None, close=True)
            return
        scope, origin = named.scope, named.origin
        path = scope.get("path", "")
        cors = self._cors(s, origin)
        try:
            self._check_host(s, scope, named.authority, path)
            if origin is not None and not same_origin(origin, named.authority) and cors is None:
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
            release(self.ongoing, client)

    # ---- the checks --------------------------------------------------------------------------

    @staticmethod
    def _check_host(s: GuardSettings, scope: dict, authority: str, path: str) -> None:
        """No API key and reached on a loopback address: only loopback Host names (or listed ones)."""
        if not s.keyless or path in EXEMPT_PATHS:
            return
        server = (scope.get("server") or ("", 0))[0] or ""
        if not is_loopback_host(str(server)):
            return
        name = _host_name(authority)
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
        held = [b"".join(parts)]

        async def replay() -> dict:
            # handed over once and not kept: this closure lives as long as the request (a stream's
            # whole life), and the route drops the body once it has parsed it
            if held:
                return {"type": "http.request", "body": held.pop(), "more_body": False}
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
