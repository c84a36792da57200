"""The HTTP layer's own limits and browser safety over real sockets, as the app is served:
thousands of half-sent bodies from one address leave a plain request from another served and
are closed by their deadline; foreign Hosts and Origins are refused; and over every route,
generated bodies never get a 500."""

from __future__ import annotations

import json
import re
import socket
import time
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployments import api
from tests.e2e.test_edges_http import tables
from tests.e2e.test_http_api import APP
from tests.test_boundary import mutated

STALLED = 2000
ATTACKER = "127.0.0.2"  # another address of the loopback network: another client


def _half_sent(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30, source_address=(ATTACKER, 0))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    return s


def _status(s: socket.socket, wait_s: float) -> int | None:
    """The status of the answer on ``s`` (None: no answer, or closed without one)."""
    s.settimeout(wait_s)
    try:
        head = s.recv(64)
    except (TimeoutError, OSError):
        return None
    return int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.1 ") else None


def test_half_sent_bodies_from_one_address_leave_the_others_served(deploy):
    base = deploy(APP)  # body_timeout_s 10, max_requests_per_client 256
    socks = []
    try:
        for _ in range(STALLED):
            socks.append(_half_sent(base))
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"prompt": "beside them", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        served_in = time.monotonic() - t0
        deadline = time.monotonic() + 60
        answers: dict[int | None, int] = {}
        for s in socks:
            status = _status(s, max(0.1, deadline - time.monotonic()))
            answers[status] = answers.get(status, 0) + 1
        # each held place ends in a 408 by its deadline; the rest were refused (429) at once
        assert answers.get(408, 0) >= 1 and answers.get(408, 0) + answers.get(429, 0) == STALLED, answers
        assert served_in < 30, served_in
    finally:
        for s in socks:
            s.close()
    metrics = httpx.get(base + "/metrics", timeout=30).text
    assert 'pgroups_http_refused_total{status="408"}' in metrics
    ing, _ = tables()
    assert ing["pending"] == 0


def test_dns_rebinding_and_foreign_pages_are_refused(deploy):
    base = deploy(APP)
    body = {"prompt": "x", "max_tokens": 1}
    r = httpx.post(base + "/v1/completions", json=body, headers={"host": "rebind.example:8765"}, timeout=30)
    assert r.status_code == 403 and "Host" in r.json()["error"]["message"]
    assert httpx.get(base + "/slots", headers={"host": "rebind.example"}, timeout=30).status_code == 403
    assert httpx.get(base + "/metrics", headers={"host": "rebind.example"}, timeout=30).status_code == 403
    # a page elsewhere posts text/plain (no preflight): refused, as is its Messages request in Anthropic's shape
    r = httpx.post(base + "/v1/completions", content=json.dumps(body), timeout=30,
                   headers={"origin": "https://evil.example", "content-type": "text/plain"})
    assert r.status_code == 403
    r = httpx.post(base + "/v1/messages", content=b"{}", timeout=30,
                   headers={"origin": "https://evil.example", "content-type": "application/json"})
    assert r.status_code == 403 and r.json()["type"] == "error"  # Anthropic's error shape
    assert httpx.post(base + "/slots/0?action=erase", headers={"origin": "https://evil.example"},
                      timeout=30).status_code == 403
    # the server's own page, and clients without an Origin, are served
    r = httpx.post(base + "/v1/completions", json=body, headers={"origin": base}, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(base + "/health", headers={"host": "lb.example"}, timeout=30).status_code == 200


def _length(data: bytes) -> int:
    """How many bytes the whole response takes, once its head is in: head and body by its
    ``content-length`` (the body may come in a later segment than the head)."""
    head, _, _ = data.partition(b"\r\n\r\n")
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    return len(head) + 4 + (int(m.group(1)) if m else 0)


def _raw(base: str, head: str) -> tuple[int | None, bytes]:
    """The status and what came of one raw request head, sent as no client library sends it."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode("latin-1"))
        data = b""
        while b"\r\n\r\n" not in data or len(data) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return (int(data.split(b" ")[1]) if data.startswith(b"HTTP/1.1 ") else None), data


def test_host_origin_and_targets_no_browser_sends_are_refused(deploy):
    """Two Hosts, a Host with userinfo, an empty one, two Origins: a 400 before any route; an
    absolute-form target is judged by its own host (served directly: behind Serve's proxy, the
    proxy's parser drops that host before the ingress sees it)."""
    from cluster.local_cluster import ingress_mode

    base = deploy(APP)
    own = base.removeprefix("http://")
    for head in (f"GET /v1/models HTTP/1.1\r\nHost: {own}\r\nHost: rebind.example\r\n\r\n",
                 f"POST /slots/0?action=erase HTTP/1.1\r\nHost: localhost:{own.split(':')[1]}@rebind.example\r\n"
                 "Content-Length: 0\r\n\r\n",
                 "GET /v1/models HTTP/1.1\r\nHost:\r\n\r\n",
                 f"GET /v1/models HTTP/1.1\r\nHost: {own}\r\nOrigin: {base}\r\nOrigin: https://evil.example\r\n\r\n"):
        status, data = _raw(base, head)
        assert status == 400, (head, data[:300])
    assert _raw(base, f"GET /v1/models HTTP/1.1\r\nHost: {own}\r\n\r\n")[0] == 200
    if ingress_mode() == "direct":
        status, data = _raw(base, f"POST http://rebind.example/slots/0?action=erase HTTP/1.1\r\nHost: {own}\r\n"
                            "Content-Length: 0\r\n\r\n")
        assert status == 403 and b"rebind.example" in data, data[:300]
        assert _raw(base, f"GET {base}/v1/models HTTP/1.1\r\nHost: rebind.example\r\n\r\n")[0] == 200
    metrics = httpx.get(base + "/metrics", timeout=30).text
    assert 'pgroups_http_refused_total{status="400"}' in metrics


def test_a_listed_origin_gets_cors_and_its_preflight(deploy):
    base = deploy(APP)
    pre = httpx.options(base + "/v1/chat/completions", timeout=30, headers={
        "origin": "http://localhost:5173", "access-control-request-method": "POST",
        "access-control-request-headers": "content-type, authorization"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "http://localhost:5173"
    assert "POST" in pre.headers["access-control-allow-methods"]
    r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30,
                   headers={"origin": "http://localhost:5173"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:5173"
    assert httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30,
                      headers={"origin": "http://localhost:5174"}).status_code == 403


LENGTHS = ("max_tokens", "n_predict", "max_output_tokens", "max_completion_tokens")


def _short(body: Any) -> Any:
    """A generated body that generates little: every length field a small number."""
    if isinstance(body, dict):
        return {k: (2 if k in LENGTHS else _short(v)) for k, v in body.items()}
    return body


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(case=mutated(), stream=st.booleans())
def test_no_generated_body_gets_a_500_on_any_route(deploy, case, stream):
    base = deploy(APP)
    model, body = case
    body = _short(body)
    if stream and isinstance(body, dict):
        body = {**body, "stream": True}
    for ep in api.ENDPOINTS:
        if ep.request is not model:
            continue
        for path in ep.paths:
            r = httpx.post(base + path, content=json.dumps(body).encode(), timeout=60,
                           headers={"content-type": "application/json"})
            assert r.status_code < 500 or r.status_code == 501, (path, body, r.status_code, r.text[:300])
            assert "Infinity" not in r.text and "NaN" not in r.text
