"""Direct ingress: the ingress replica serves HTTP itself, with no Serve proxy in the path.

Behind Serve's proxy actor every response chunk of every stream is a Ray message from the
ingress replica to the proxy, which costs more CPU per token than the engine's own host work
(``make bench``). When the Serve config runs no HTTP proxy (``proxy_location: Disabled``),
each ingress replica listens on ``http_options``' address and port instead, with the same
ASGI app (guard, routes, metrics) under uvicorn. The socket is opened with ``SO_REUSEPORT``,
so a replica that starts while the one it replaces is still draining shares the port with
it (Linux lets only the same user do so), and the kernel spreads connections over the
ingress replicas of one node. Clients' own addresses reach the guard, as behind the proxy.

What a connection may hold before the app sees its request is bounded here, below uvicorn's
HTTP protocol (``BoundedHttpProtocol``), since the guard only runs once a head is whole:

- **Heads arrive in time**: a request line and headers must be whole within
  ``head_timeout_s`` of the connection opening or its previous answer ending (408, closed);
  a connection that sends nothing for ``keep_alive_timeout_s`` is closed.
- **Heads are small**: at most ``max_head_bytes`` and ``MAX_HEADERS`` header lines (431,
  closed); no more than the bound is ever handed to the parser, so an endless head costs its
  bound and no more.
- **Connections are bounded** per client address and in all, below the process's descriptor
  limit: past them a connection gets its 429 / 503 at once, so the accept loop never runs out
  of descriptors and another address is always answered.

A refused connection is answered and half-closed, then what the client still sends is read
and dropped for up to ``LINGER_S`` before the close, so that the client reads its answer
instead of a reset.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import socket
from dataclasses import dataclass, field
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.protocols.utils import get_remote_addr

from deployments.api.base import openai_error
from deployments.guard import KeepsRequestTarget, release

log = logging.getLogger(__name__)

MAX_HEADERS = 100  # header lines in one head (Apache's LimitRequestFields, cpp-httplib's count)
LINGER_S = 2.0  # a refused connection's answer gets this long to be read before the close
FD_RESERVE = 256  # descriptors the rest of the process keeps beyond those it has at start


def serve_http_config() -> tuple[str, int, bool]:
    """Serve's HTTP address and port, and whether it runs HTTP proxies (asked of the controller)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    ctrl = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    http, location = ray.get([ctrl.get_http_config.remote(), ctrl.get_proxy_location.remote()], timeout=10)
    return str(http.host), int(http.port), str(getattr(location, "value", location)) != "Disabled"


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` that replicas of this user share."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if info[0] == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(info[4])
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class HttpLimits:
    """What a connection may hold before its request reaches the app (the app's arguments)."""

    head_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 5.0
    max_head_bytes: int = 16 * 1024
    max_connections: int = 4096
    max_connections_per_client: int = 512


def open_descriptors() -> int:
    """Descriptors this process has open (Linux; elsewhere a guess)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


@dataclass
class Connections:
    """One server's connection table: the bounds in force (the configured ones, lowered to fit
    the descriptor limit) and what is open, by client address."""

    limits: HttpLimits
    refused: dict[str, int] = field(default_factory=dict)  # status -> refusals (shared with the guard's)
    max_held: int = 0
    max_per_client: int = 0
    max_lingering: int = 0
    held: int = 0  # connections whose requests are served
    per_client: dict[str, int] = field(default_factory=dict)  # address -> held (no entry at 0)
    lingering: int = 0  # refused at accept, their answer being read

    def __post_init__(self) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        want = self.limits.max_connections
        # what the held and the lingering connections may use, the rest of the process's left
        room = soft - open_descriptors() - max(FD_RESERVE, soft // 20)
        self.max_lingering = max(1, min(1024, room // 5))
        self.max_held = max(1, min(want, room - self.max_lingering))
        self.max_per_client = max(1, min(self.limits.max_connections_per_client, self.max_held))
        if self.max_held < want:
            # lowered: one address may still not take every place
            self.max_per_client = max(1, min(self.max_per_client, self.max_held // 2))
            log.warning("the descriptor limit (%d) holds %d connections, not max_connections %d (%d per client "
                        "address); raise it (ulimit -n) to hold more", soft, self.max_held, want, self.max_per_client)

    def count(self, status: int) -> None:
        self.refused[str(status)] = self.refused.get(str(status), 0) + 1


# states of a connection's current request, as its parser reads it
IDLE, HEAD, BODY = "idle", "head", "body"


class _TooManyHeaders(Exception):
    pass


def answer(status: int, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 answer that closes its connection, with an OpenAI-shaped error body."""
    body = json.dumps(openai_error(status, message)).encode()
    lines = [STATUS_LINE[status], b"content-type: application/json\r\n",
             b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
    lines += [f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items()]
    return b"".join([*lines, b"\r\n", body])


class BoundedHttpProtocol(KeepsRequestTarget, HttpToolsProtocol):
    """uvicorn's httptools protocol with the head, idle and connection bounds of this module.

    The parser's callbacks tell where a request is: ``on_message_begin`` starts a head,
    ``on_headers_complete`` ends it, ``on_message_complete`` ends the request. Bytes read while
    a head is open count against ``max_head_bytes``, and a read is cut at the bound before the
    parser sees it. A read holding several pipelined requests is fed one request at a time (a
    head up to its blank line, a body up to its ``Content-Length``), so each head counts its own
    bytes however many are buffered; only a chunked body's read, or a head ended by bare line
    feeds, counts whole to the head that follows it."""

    table: Connections  # set on the subclass each server makes (``DirectServer``)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._state = IDLE
        self._head_bytes = 0  # bytes of the open head read so far (0 also: none of the next one yet)
        self._n_headers = 0
        self._tail = b""  # the last bytes of the open head fed, to find its blank line across reads
        self._body_left: int | None = None  # of the open body, by its Content-Length (None: unknown)
        self._heads_done = 0  # heads completed on this connection
        self._head_timer: asyncio.TimerHandle | None = None
        self._client: str | None = None  # counted in the table under this address
        self._lingering = False  # refused at accept, counted in the table's lingering
        self._refused = False  # answered with a refusal: what comes is read and dropped
        self._linger: asyncio.TimerHandle | None = None

    # ---- the connection's life -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        t, lim = self.table, self.table.limits
        addr = get_remote_addr(transport)
        client = addr[0] if addr else "?"
        if t.held >= t.max_held:
            self._refuse_at_accept(transport, 503, f"the server holds {t.max_held} connections, its limit "
                                   "(max_connections); retry")
            return
        if t.per_client.get(client, 0) >= t.max_per_client:
            self._refuse_at_accept(transport, 429, f"too many connections from {client} (max_connections_per_client "
                                   f"{t.max_per_client})")
            return
        t.held += 1
        t.per_client[client] = t.per_client.get(client, 0) + 1
        self._client = client
        super().connection_made(transport)
        # uvicorn arms its keep-alive timer only after an answer: a new connection gets it too
        self.timeout_keep_alive_task = self.loop.call_later(lim.keep_alive_timeout_s, self.timeout_keep_alive_handler)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self._client is None:  # refused at accept: never handed to uvicorn
            if self._lingering:
                self._lingering = False
                self.table.lingering -= 1
            return
        t, client, self._client = self.table, self._client, None
        t.held -= 1
        release(t.per_client, client)
        super().connection_lost(exc)

    def _refuse_at_accept(self, transport: asyncio.Transport, status: int, message: str) -> None:
        t = self.table
        t.count(status)
        self.transport = transport
        self._refused = True
        transport.write(answer(status, message, {"retry-after": "1"}))
        if t.lingering >= t.max_lingering:  # past that, no descriptor is kept for the answer
            transport.close()
            return
        t.lingering += 1
        self._lingering = True
        self._half_close()

    def _half_close(self) -> None:
        """Let the answer out, read and drop what the client still sends, close within LINGER_S."""
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)

    def _refuse(self, status: int, message: str) -> None:
        """Answer the open head with ``status`` and close (only the connection, when an answer
        to an earlier request is still being written: the two would mix)."""
        self._disarm_head_timer()
        self._unset_keepalive_if_required()
        if self.transport.is_closing():
            return
        self.table.count(status)
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()
            return
        self.transport.write(answer(status, message))
        self._half_close()

    # ---- the head's bounds ---------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.table.limits.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._refused:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # an answer is being written: the head waits for it (rearmed when it ends)
        if self._state == IDLE and self._head_bytes == 0:
            self.transport.close()  # nothing sent since the last answer: an idle connection
        elif self._state == BODY:
            self.transport.close()  # answered before its body was read (a GET with a body): not reusable
        else:
            self._refuse(408, f"the request head did not arrive in time ({self._head_bytes} bytes after "
                         f"{self.table.limits.head_timeout_s:g} s; head_timeout_s)")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering: read and dropped
        self._unset_keepalive_if_required()
        limit = self.table.limits.max_head_bytes
        view = memoryview(data)
        while view and not self.transport.is_closing() and not self._refused:
            if self._state == BODY:
                n = len(view) if not self._body_left else min(self._body_left, len(view))
                if self._body_left:
                    self._body_left -= n
            else:
                room = limit - self._head_bytes
                if room <= 0:
                    self._refuse(431, f"request head larger than {limit} bytes (max_head_bytes)")
                    return
                n = self._head_end(data, len(data) - len(view), room) or room
                self._tail = (self._tail + bytes(view[max(0, n - 3):n]))[-3:]
            piece, view = view[:n], view[n:]
            was_open, done = self._state != BODY, self._heads_done
            if not self._feed(piece):
                return
            if self._state == BODY:
                continue
            if was_open and self._heads_done == done:
                self._head_bytes += len(piece)  # more of the same head
            elif self._state == HEAD:
                self._head_bytes = len(piece)  # the next head began inside this read: counted whole
            else:
                self._head_bytes = 0  # whole requests, nothing of the next one
            if self._head_bytes > limit:
                self._refuse(431, f"request head larger than {limit} bytes (max_head_bytes)")
                return

    def _head_end(self, data: bytes, pos: int, room: int) -> int:
        """Bytes of ``data`` from ``pos`` up to and including the blank line that ends the open
        head (which may begin in the bytes fed before, ``_tail``), looked for within ``room``;
        0 where it is not there. Found in place: a read of many requests is not copied."""
        if self._tail:
            i = (self._tail + data[pos:pos + 3]).find(b"\r\n\r\n")
            if i >= 0:
                return i + 4 - len(self._tail)
        i = data.find(b"\r\n\r\n", pos, pos + room)
        return 0 if i < 0 else i + 4 - pos

    def _feed(self, piece: memoryview) -> bool:
        """``piece`` to the parser, as uvicorn's ``data_received`` does; False: the connection
        was answered (an unparseable head, or too many header lines)."""
        try:
            self.parser.feed_data(piece)
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, _TooManyHeaders):
                self._refuse(431, f"more than {MAX_HEADERS} header lines in the request head")
                return False
            self.logger.warning("Invalid HTTP request received.")
            self._disarm_head_timer()
            self.send_400_response("Invalid HTTP request received.")
            return False
        except httptools.HttpParserUpgrade:
            # no protocol to upgrade to (ws="none"; curl --http2 asks for h2c): the request is
            # answered, then the connection closes
            log.debug("an upgrade was asked for and not made")
            if self.cycle is not None:
                self.cycle.keep_alive = False
            self.flow.pause_reading()
            return False
        return True

    # ---- the parser's callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._state = HEAD
        self._n_headers = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._n_headers += 1
        if self._n_headers > MAX_HEADERS:
            raise _TooManyHeaders
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._state = BODY
        self._heads_done += 1
        self._head_bytes = 0
        self._tail = b""
        sizes = [v for k, v in self.headers if k == b"content-length"]
        chunked = any(k == b"transfer-encoding" for k, _ in self.headers)
        self._body_left = int(sizes[0]) if len(sizes) == 1 and sizes[0].isdigit() and not chunked else None
        self._disarm_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._state = IDLE
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm_head_timer()  # idle again: the next head has head_timeout_s from now


class DirectServer:
    """uvicorn serving ``app`` on this event loop, on a socket of its own, within ``limits``;
    ``refused`` counts the connections refused, by status (the guard's table)."""

    def __init__(self, app: Any, host: str, port: int, limits: HttpLimits | None = None,
                 refused: dict[str, int] | None = None) -> None:
        import uvicorn

        limits = limits or HttpLimits()
        self.connections = Connections(limits, refused if refused is not None else {})
        protocol = type("Protocol", (BoundedHttpProtocol,), {"table": self.connections})
        self.sock = listen(host, port)
        # proxy_headers off: the guard counts the socket's own peer, never an X-Forwarded-For a
        # client on loopback could write; ws off: no upgrade hands a connection past the bounds
        config = uvicorn.Config(app, lifespan="off", log_level=None, log_config=None, access_log=False,
                                timeout_keep_alive=limits.keep_alive_timeout_s, loop="none", proxy_headers=False,
                                http=protocol, ws="none")
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # the replica's process owns its signals
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        log.warning("the ingress serves HTTP itself on %s:%d (no Serve proxy)", host, port)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, let running requests finish within ``timeout_s``, then close."""
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            self.server.force_exit = True
            self.task.cancel()
        finally:
            self.sock.close()
