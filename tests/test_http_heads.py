"""What a connection may hold before its request reaches the app, on the direct ingress
(deployments/direct.py) over real sockets on loopback, without Ray: a trickled head gets its
408, silent and idle connections are closed, a head over its bound gets a 431 without being
read into memory, and past the connection bounds (per address, in all, the descriptor limit)
another address is still answered."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from deployments import direct
from deployments.direct import LINGER_S, MAX_HEADERS, Connections, DirectServer, HttpLimits

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 60.0  # generous: what is asserted is waited for, never timed


async def _app(scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI
    if scope["type"] != "http":
        return
    if scope["path"].startswith("/slow"):
        await asyncio.sleep(float(scope["path"].rsplit("/", 1)[1]))
    body = f"{scope['client'][0]} {scope['path']}".encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Served:
    """A DirectServer with ``limits`` on a thread's event loop, for blocking sockets to talk to."""

    def __init__(self, limits: HttpLimits, app=_app) -> None:  # noqa: ANN001 - an ASGI app
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)

            async def start() -> None:
                self.server = DirectServer(app, "127.0.0.1", 0, limits)
                while not self.server.server.started:
                    await asyncio.sleep(0.01)
                ready.set()

            self.loop.run_until_complete(start())
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(WAIT_S)
        self.port = self.server.sock.getsockname()[1]

    @property
    def table(self) -> Connections:
        return self.server.connections

    def connect(self, source: str = "127.0.0.1") -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_S, source_address=(source, 0))
        return s

    def wait_for(self, what, timeout_s: float = WAIT_S) -> None:  # noqa: ANN001 - a predicate
        deadline = time.monotonic() + timeout_s
        while not what():
            assert time.monotonic() < deadline, "the state did not come"
            time.sleep(0.02)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(5.0), self.loop).result(WAIT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)


@contextlib.contextmanager
def served(**limits: float) -> Iterator[Served]:
    s = Served(HttpLimits(**limits))
    try:
        yield s
    finally:
        s.close()


def answer_of(s: socket.socket) -> tuple[int | None, bytes, bool]:
    """(status, everything read, whether the server closed the connection)."""
    s.settimeout(WAIT_S)
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except (TimeoutError, OSError):
            return _status(data), data, False
        if not chunk:
            return _status(data), data, True
        data += chunk


def trickle(s: socket.socket, head: bytes, gap_s: float, wait_s: float) -> tuple[int, bytes]:
    """Sends ``head`` a byte every ``gap_s`` until the server answers (or ``wait_s`` passes, or
    the connection breaks): (bytes sent, what the first answer's read gave)."""
    s.settimeout(gap_s)
    sent, data = 0, b""
    deadline = time.monotonic() + wait_s
    while not data and time.monotonic() < deadline:
        try:
            s.send(head[sent:sent + 1])
            sent += 1
            data = s.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
    return sent, data


def _status(data: bytes) -> int | None:
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None


def get(port_or_sock: Served | socket.socket, path: str = "/x", source: str = "127.0.0.1") -> bytes:
    """A plain GET on a new connection (or ``port_or_sock``), its whole answer."""
    s = port_or_sock.connect(source) if isinstance(port_or_sock, Served) else port_or_sock
    with s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        status, data, _ = answer_of(s)
    assert status == 200, data
    return data.rsplit(b"\r\n\r\n", 1)[1]


def test_a_trickled_head_gets_a_408_and_its_connection_is_closed():
    head = b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100_000
    with served(head_timeout_s=1.0) as srv:
        s = srv.connect()
        sent, data = trickle(s, head, 0.05, WAIT_S)
        status, rest, closed = answer_of(s)
        s.close()
        assert _status(data + rest) == 408 and closed, data + rest
        assert b"head_timeout_s" in data + rest and sent < len(head)
        srv.wait_for(lambda: srv.table.held == 0)
        assert srv.table.refused == {"408": 1}
        assert get(srv) == b"127.0.0.1 /x"  # the server serves on


def test_silent_and_idle_connections_are_closed():
    with served(head_timeout_s=2.0, keep_alive_timeout_s=0.5) as srv:
        silent = [srv.connect() for _ in range(200)]
        for s in silent:  # closed without an answer: they never asked anything
            assert answer_of(s) == (None, b"", True)
            s.close()
        srv.wait_for(lambda: srv.table.held == 0)
        # a keep-alive connection, idle after its answer
        s = srv.connect()
        s.sendall(b"GET /a HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, data, closed = answer_of(s)
        s.close()
        assert status == 200 and data.endswith(b"127.0.0.1 /a") and closed
        assert srv.table.refused == {}


def test_an_answer_that_takes_longer_than_the_head_deadline_is_not_cut():
    """The head deadline runs while a head is awaited, never while a request is answered; a
    request pipelined behind a slow one waits for it."""
    with served(head_timeout_s=0.5, keep_alive_timeout_s=0.5) as srv:
        s = srv.connect()
        s.sendall(b"GET /slow/2 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /after HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, data, closed = answer_of(s)
        s.close()
        assert status == 200 and b"127.0.0.1 /slow/2" in data and data.endswith(b"127.0.0.1 /after"), data
        assert closed and srv.table.refused == {}


def test_an_upgrade_is_answered_as_a_request_and_then_closed():
    """No protocol is upgraded to (curl --http2 asks for h2c, a page for a websocket): a
    connection that asks is answered and closed, never handed past the bounds."""
    with served(head_timeout_s=60, keep_alive_timeout_s=60) as srv:
        s = srv.connect()
        s.sendall(b"GET /up HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                  b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n")
        status, data, closed = answer_of(s)
        s.close()
        assert status == 200 and data.endswith(b"127.0.0.1 /up") and closed, data


@pytest.mark.parametrize("n", [250, 400])
def test_pipelined_requests_are_all_answered_in_order(n):
    """However many requests one write holds (250 are 18 KB, 400 are 29 KB: past the 16 KiB a
    head may take),
    each head is counted alone and every request gets its answer, in order; POSTs with bodies
    among them too."""
    reqs = []
    for i in range(n):
        if i % 5 == 4:
            body = b"x" * 3000
            reqs.append(f"POST /p{i} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        else:
            reqs.append(f"GET /g{i} HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n".encode())
    reqs.append(b"GET /last HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    with served(max_head_bytes=16 * 1024) as srv:
        s = srv.connect()
        s.sendall(b"".join(reqs))
        _, data, closed = answer_of(s)
        s.close()
        bodies = [part.split(b"\r\n\r\n", 1)[1] for part in data.split(b"HTTP/1.1 200 OK")[1:]]
        want = [f"127.0.0.1 /{'p' if i % 5 == 4 else 'g'}{i}".encode() for i in range(n)] + [b"127.0.0.1 /last"]
        assert closed and srv.table.refused == {}
        assert [b[:len(w)] for b, w in zip(bodies, want, strict=False)] == want[:len(bodies)] and len(bodies) == n + 1


@pytest.mark.parametrize("head", [
    b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (1 << 20),  # one endless header
    b"GET /" + b"a" * (1 << 20),  # an endless request line
    b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n",  # whole, but over the bound
    b"GET /x HTTP/1.1\r\n" + b"a: b\r\n" * (MAX_HEADERS + 1) + b"\r\n",  # too many header lines
    b"\r\n" * 100_000,  # blank lines before any request line
], ids=["header", "request-line", "whole", "count", "blank-lines"])
def test_a_head_over_its_bound_gets_a_431(head):
    with served(max_head_bytes=4096) as srv:
        s = srv.connect()
        with contextlib.suppress(OSError):  # the server stops reading a moment after its answer
            s.sendall(head)
        status, data, closed = answer_of(s)
        s.close()
        assert status == 431 and closed, data
        assert srv.table.refused == {"431": 1}
        # a head within the bound is served, also when it fills one read with the start of its body
        s = srv.connect()
        s.sendall(b"GET /ok HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Fill: " + b"a" * 3900 + b"\r\nConnection: close\r\n\r\n")
        assert answer_of(s)[0] == 200
        s.close()
        s = srv.connect()
        s.sendall(b"POST /p HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 200000\r\nConnection: close\r\n\r\n"
                  + b"b" * 200_000)
        assert answer_of(s)[0] == 200
        s.close()


def test_connections_are_bounded_per_address_and_in_all_and_others_are_answered():
    with served(max_connections=8, max_connections_per_client=4, keep_alive_timeout_s=60, head_timeout_s=60) as srv:
        held = [srv.connect("127.0.0.2") for _ in range(4)]
        srv.wait_for(lambda: srv.table.held == 4)
        with srv.connect("127.0.0.2") as over:
            status, data, closed = answer_of(over)
        assert status == 429 and b"retry-after: 1" in data and closed, data
        assert get(srv) == b"127.0.0.1 /x"  # another address beside them
        held += [srv.connect("127.0.0.3") for _ in range(4)]
        srv.wait_for(lambda: srv.table.held == 8)
        with srv.connect("127.0.0.4") as over:
            status, data, closed = answer_of(over)
        assert status == 503 and closed, data
        for s in held:
            s.close()
        srv.wait_for(lambda: srv.table.held == 0 and srv.table.lingering == 0 and not srv.table.per_client)
        assert get(srv, source="127.0.0.4") == b"127.0.0.4 /x"
        assert srv.table.refused == {"429": 1, "503": 1}


def test_the_descriptor_limit_lowers_the_connection_bounds(monkeypatch):
    monkeypatch.setattr(direct.resource, "getrlimit", lambda _what: (1024, 4096))
    monkeypatch.setattr(direct, "open_descriptors", lambda: 300)
    t = Connections(HttpLimits(max_connections=4096, max_connections_per_client=512))
    assert 300 + t.max_held + t.max_lingering <= 1024 - direct.FD_RESERVE
    assert 0 < t.max_per_client <= t.max_held // 2 < t.max_held
    roomy = Connections(HttpLimits(max_connections=100, max_connections_per_client=512))
    assert roomy.max_held == 100 and roomy.max_per_client == 100  # configured bounds that fit stay


SERVER = """
import asyncio, resource, sys
from deployments.direct import DirectServer, HttpLimits

async def app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})

async def main():
    nofile = int(sys.argv[1])
    if nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    s = DirectServer(app, "127.0.0.1", 0, HttpLimits(**eval(sys.argv[2])))
    print(s.sock.getsockname()[1], s.connections.max_held, s.connections.max_per_client, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@contextlib.contextmanager
def server_process(nofile: int = 0, **limits: float) -> Iterator[tuple[subprocess.Popen, int, int, int]]:
    """A DirectServer in a process of its own (its memory and descriptors are its own): the
    process, its port, its held and per-client bounds."""
    p = subprocess.Popen([sys.executable, "-c", SERVER, str(nofile), repr(limits)], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    try:
        port, held, per_client = (int(x) for x in p.stdout.readline().split())
        yield p, port, held, per_client
    finally:
        p.kill()
        p.wait()


def _plain(port: int, source: str = "127.0.0.1") -> int | None:
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S, source_address=(source, 0)) as s:
        s.sendall(b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        return answer_of(s)[0]


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def unfinished_heads_growth(n: int = 64, size: int = 8 << 20, **limits: float) -> tuple[int, dict]:
    """How much the server process's resident memory peaks above where it was while ``n``
    clients each send a head of ``size`` bytes that never ends (bytes), and their answers."""
    with server_process(**limits) as (p, port, _, _):
        for _ in range(20):
            assert _plain(port) == 200  # warm
        before = _kib(p.pid, "VmRSS")
        with contextlib.suppress(OSError):
            Path(f"/proc/{p.pid}/clear_refs").write_text("5")  # the peak starts from here
        payload = b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * size

        def send(_i: int) -> int | None:
            with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
                with contextlib.suppress(OSError):
                    s.sendall(payload)
                return answer_of(s)[0]

        with ThreadPoolExecutor(n) as pool:
            answers = list(pool.map(send, range(n)))
        peak = _kib(p.pid, "VmHWM")
        assert _plain(port) == 200
        counts: dict = {}
        for a in answers:
            counts[a] = counts.get(a, 0) + 1
        return (peak - before) * 1024, counts


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_unfinished_8_mb_heads_leave_the_memory_flat():
    growth, answers = unfinished_heads_growth()
    assert answers == {431: 64}, answers
    assert growth < 50 << 20, f"the server grew by {growth / 2**20:.0f} MB"


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads /proc")
def test_past_the_descriptor_limit_another_address_is_answered():
    """A server whose descriptor limit (1,024) is below what one address opens: the bounds are
    lowered to fit, the flood's connections past them are refused at once, and a plain request
    from another address gets its answer (the accept loop never runs out of descriptors)."""
    flood = 1500
    with server_process(nofile=1024, keep_alive_timeout_s=120, head_timeout_s=120) as (_, port, held, per_client):
        assert held < 1024 - direct.FD_RESERVE and per_client <= held // 2
        socks = []
        try:
            for _ in range(flood):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=WAIT_S,
                                                      source_address=("127.0.0.2", 0)))
            assert _plain(port) == 200
            refused = sum(answer_of(s)[0] == 429 for s in socks[per_client:per_client + 50])
            assert refused == 50
        finally:
            for s in socks:
                s.close()
        # the refused ones' places come back within their linger
        deadline = time.monotonic() + WAIT_S + LINGER_S
        while _plain(port, "127.0.0.2") != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)


if __name__ == "__main__":  # the figure: python -m tests.test_http_heads [max_head_bytes]
    bound = int(sys.argv[1]) if len(sys.argv) > 1 else HttpLimits().max_head_bytes
    grew, got = unfinished_heads_growth(max_head_bytes=bound)
    print(f"64 unfinished 8 MB heads, max_head_bytes {bound}: answers {got}, "
          f"the server's resident memory peaked {grew / 2**20:.1f} MB above where it was")
