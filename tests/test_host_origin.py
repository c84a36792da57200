"""One reading of Host, Origin and the request target (deployments/guard.py), without Ray:
each in the one form a browser writes, anything else a 400 before any other check; an
absolute-form target judged by its own host. First on ASGI scopes as uvicorn's two HTTP
protocols present them, then over raw sockets to the direct ingress's server, since no
client library sends two Host headers or an absolute-form target."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from deployments.direct import HttpLimits
from deployments.guard import Guard, GuardSettings, parse_authority, parse_origin, same_origin
from tests.test_http_heads import Served as RawServed

WAIT_S = 60.0  # generous: answers are waited for, never timed


async def _app(scope: dict, receive: Any, send: Any) -> None:
    """Stands for the ingress: answers the path and query it was routed by."""
    body = json.dumps({"path": scope["path"], "query": scope.get("query_string", b"").decode()}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _scope(headers: list[tuple[str, str]], path: str = "/v1/models", raw_path: bytes | None = None,
           method: str = "GET", http_version: str = "1.1") -> dict:
    return {"type": "http", "method": method, "path": path, "raw_path": raw_path if raw_path is not None else
            path.encode(), "query_string": b"", "root_path": "", "http_version": http_version,
            "headers": [(k.encode(), v.encode("latin-1")) for k, v in headers],
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 40000)}


def _call(scope: dict, **settings: Any) -> tuple[int, dict[str, str], dict]:
    s = GuardSettings(**settings)
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(m: dict) -> None:
        sent.append(m)

    asyncio.run(Guard(_app, lambda: s)(scope, receive, send))
    head = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], head, json.loads(sent[1]["body"])


HOST = [("host", "127.0.0.1:8000")]


@pytest.mark.parametrize("text, parsed", [
    ("127.0.0.1:8000", ("127.0.0.1", 8000)), ("LocalHost", ("localhost", None)), ("[::1]:80", ("::1", 80)),
    ("app.localhost.", ("app.localhost.", None)), ("my_host-1.example:65535", ("my_host-1.example", 65535)),
])
def test_a_host_as_a_browser_writes_it_parses(text, parsed):
    assert parse_authority(text) == parsed


@pytest.mark.parametrize("text", [
    "", "localhost:8000@evil.example", "user@localhost", "localhost:", "localhost:0", "localhost:65536",
    "localhost:80:80", "localhost:８０", "a b", "a,b", "a..b", ".a", "a/b", "a%2eb", "[::1", "[::1]x", "[fe80::1%25eth0]",
    "[evil.example]", "localhost\\@evil", "x" * 300,
])
def test_any_other_host_does_not(text):
    assert parse_authority(text) is None


def test_origins_are_serialized_origins_only():
    assert parse_origin("http://localhost:5173") == ("http", "localhost", 5173)
    assert parse_origin("chrome-extension://abcdef") == ("chrome-extension", "abcdef", None)
    for bad in ("http://localhost:5173/", "http://u@localhost", "localhost:5173", "http://", "null", "http://a b",
                "http://localhost/path", "1http://a"):
        assert parse_origin(bad) is None, bad
    assert same_origin("http://[::1]:8000", "[::1]:8000") and not same_origin("http://x@h:8000", "h:8000")


@pytest.mark.parametrize("headers, what", [
    ([("host", "localhost:8000@evil.example")], "Host"),
    ([("host", "127.0.0.1:8000"), ("host", "evil.example")], "Host headers"),
    ([("host", "")], "Host"),
    ([], "no Host"),
    ([("host", "127.0.0.1:99999")], "Host"),
    ([*HOST, ("origin", "https://evil.example"), ("origin", "http://127.0.0.1:8000")], "Origin headers"),
    ([*HOST, ("origin", "")], "Origin"),
    ([*HOST, ("origin", "http://127.0.0.1:8000/")], "Origin"),
    ([*HOST, ("origin", "http://u@127.0.0.1:8000")], "Origin"),
])
def test_host_and_origin_in_any_other_form_are_a_400_and_close(headers, what):
    status, head, body = _call(_scope(headers))
    assert status == 400 and what in body["error"]["message"] and head.get("connection") == "close", body
    # also where the loopback rule does not apply: with a key, on another address, on /health
    assert _call(_scope(headers), keyless=False)[0] == 400
    assert _call({**_scope(headers, path="/health"), "server": ("10.0.0.5", 8000)})[0] == 400


def test_well_formed_requests_keep_their_answers():
    assert _call(_scope(HOST))[0] == 200
    assert _call(_scope([("host", "[::1]:8000"), ("origin", "http://[::1]:8000")]))[0] == 200
    assert _call(_scope([*HOST, ("origin", "null")]))[0] == 403  # an opaque origin: a foreign page, as before
    assert _call(_scope([*HOST, ("origin", "null")]), cors_origins=("null",))[0] == 200
    assert _call(_scope([("host", "evil.example")]))[0] == 403  # DNS rebinding, as before
    assert _call(_scope([], http_version="1.0"), keyless=False)[0] == 200  # HTTP/1.0 needs no Host
    assert _call(_scope([("host", "lb.example")], path="/health"))[0] == 200


# how the two uvicorn protocols present `GET http://<authority>/slots?x=1`: h11 hands the whole
# target as raw_path and path; httptools keeps the path, and the direct ingress's protocol puts
# the whole target back in raw_path (KeepsRequestTarget)
def _h11(authority: str, path: str = "/slots") -> dict:
    target = f"http://{authority}{path}"
    return {**_scope(HOST, path=target, raw_path=target.encode()), "query_string": b"x=1"}


def _httptools(authority: str, path: str = "/slots") -> dict:
    return {**_scope(HOST, path=path, raw_path=f"http://{authority}{path}".encode()), "query_string": b"x=1"}


@pytest.mark.parametrize("present", [_h11, _httptools])
def test_an_absolute_form_target_is_judged_by_its_own_host(present):
    status, _, body = _call(present("evil.example"))  # the Host says 127.0.0.1: the target wins
    assert status == 403 and "evil.example" in body["error"]["message"]
    status, _, body = _call({**present("127.0.0.1:8000"), "headers": [(b"host", b"evil.example")]})
    assert status == 200 and body == {"path": "/slots", "query": "x=1"}  # routed by its path
    assert _call(present("evil.example"), allowed_hosts=("evil.example",))[0] == 200
    status, _, body = _call(present("127.0.0.1:8000", ""))
    assert status == 200 and body["path"] == "/"
    for bad in ("u@127.0.0.1:8000", "127.0.0.1:8000@evil.example", "", "127.0.0.1:0"):
        status, _, body = _call(present(bad))
        assert status == 400 and "target" in body["error"]["message"], bad


def test_other_target_forms_are_a_400():
    for target in ("*", "ftp://127.0.0.1/x", "evil.example:443", "http:/x", "http://127.0.0.1:8000#f"):
        status, _, body = _call(_scope(HOST, path=target, raw_path=target.encode(), method="OPTIONS"))
        assert status == 400 and "target" in body["error"]["message"], target
    # a path whose first segment is empty is a path (origin-form), not an authority
    assert _call(_scope(HOST, path="//evil.example/x"))[0] == 200


def test_an_absolute_form_origin_check_uses_the_targets_host():
    own = {**_httptools("localhost:8000"), "headers": [(b"host", b"127.0.0.1:8000"),
                                                        (b"origin", b"http://localhost:8000")]}
    assert _call(own)[0] == 200  # the page's own origin is the target's


# ---- over raw sockets, to the direct ingress's own server ----------------------------------------


class Served(RawServed):
    """The guard and ``_app`` under the direct ingress's server, on a thread's event loop."""

    def __init__(self) -> None:
        self.settings = GuardSettings()
        super().__init__(HttpLimits(), Guard(_app, lambda: self.settings))

    def send(self, head: str) -> tuple[int | None, bytes]:
        """The status and body of the answer to one raw request head (then the server's close or
        the body's end)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_S) as s:
            s.sendall(head.encode("latin-1"))
            data = b""
            while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None
        return status, data.split(b"\r\n\r\n", 1)[-1]


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


@pytest.fixture(scope="module")
def served() -> Any:
    s = Served()
    yield s
    s.close()


def test_raw_hosts_and_origins_no_client_sends_are_refused(served):
    p = served.port
    assert served.send(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{p}\r\n\r\n")[0] == 200
    for head in (
        f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{p}\r\nHost: evil.example\r\n\r\n",
        f"GET /v1/models HTTP/1.1\r\nHost: evil.example\r\nHost: 127.0.0.1:{p}\r\n\r\n",
        f"GET /v1/models HTTP/1.1\r\nHost: localhost:{p}@evil.example\r\n\r\n",
        "GET /v1/models HTTP/1.1\r\nHost:\r\n\r\n",
        "GET /v1/models HTTP/1.1\r\n\r\n",
        f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{p}\r\nOrigin: http://127.0.0.1:{p}\r\n"
        "Origin: https://evil.example\r\n\r\n",
        f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{p}\r\nOrigin: http://127.0.0.1:{p}/\r\n\r\n",
    ):
        status, body = served.send(head)
        assert status == 400, (head, body)


def test_a_raw_absolute_form_target_is_judged_by_its_host(served):
    p = served.port
    status, body = served.send(f"POST http://evil.example/slots/0?action=erase HTTP/1.1\r\nHost: 127.0.0.1:{p}\r\n"
                               "Content-Length: 0\r\n\r\n")
    assert status == 403 and b"evil.example" in body, body
    status, body = served.send(f"GET http://127.0.0.1:{p}/slots?action=x HTTP/1.1\r\nHost: evil.example\r\n\r\n")
    assert status == 200 and json.loads(body) == {"path": "/slots", "query": "action=x"}
    status, body = served.send(f"GET http://localhost:{p}@evil.example/slots HTTP/1.1\r\nHost: 127.0.0.1:{p}\r\n\r\n")
    assert status == 400, body
    status, _ = served.send(f"OPTIONS * HTTP/1.1\r\nHost: 127.0.0.1:{p}\r\n\r\n")
    assert status == 400
    assert served.settings.refused.get("400", 0) >= 2 and served.settings.refused.get("403", 0) >= 1
