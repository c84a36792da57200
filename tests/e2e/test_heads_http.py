"""Request heads against the app as served, with its defaults (head_timeout_s 10,
keep_alive_timeout_s 5, max_head_bytes 16 KiB): a trickled head and silent connections are
cut, and 64 unfinished 8 MB heads are refused while the ingress stays flat in memory
(tests/test_http_heads.py holds each bound on its own, without Ray)."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.e2e.test_edges_http import tables
from tests.e2e.test_http_api import APP
from tests.test_http_heads import answer_of, trickle

WAIT_S = 120.0


def _connect(base: str, source: str = "127.0.0.1") -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=WAIT_S, source_address=(source, 0))


def test_a_trickled_head_and_silent_connections_are_cut(deploy):
    base = deploy(APP)
    silent = [_connect(base, "127.0.0.2") for _ in range(200)]
    trickled = _connect(base, "127.0.0.3")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000
    sent, data = trickle(trickled, head, 0.2, WAIT_S)
    status, rest, closed = answer_of(trickled)
    trickled.close()
    assert (data + rest).startswith(b"HTTP/1.1 408 ") and closed and sent < len(head), data + rest
    r = httpx.post(base + "/v1/completions", json={"prompt": "beside them", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    for s in silent:
        assert answer_of(s) == (None, b"", True)  # closed, never answered: they asked nothing
        s.close()


def test_unfinished_8_mb_heads_are_refused_and_the_ingress_stays_flat(deploy):
    base = deploy(APP)
    before = tables()[0]["rss_bytes"]
    peak = [before]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tables()[0]["rss_bytes"])
            time.sleep(0.05)

    payload = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (8 << 20)

    def send(_i: int) -> int | None:
        with _connect(base) as s:
            with contextlib.suppress(OSError):
                s.sendall(payload)
            return answer_of(s)[0]

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(send, range(64)))
    finally:
        done.set()
        watcher.join(WAIT_S)
    peak[0] = max(peak[0], tables()[0]["rss_bytes"])
    assert answers == [431] * 64, answers
    assert peak[0] - before < 50 << 20, f"the ingress grew by {(peak[0] - before) / 2**20:.0f} MB"
    assert httpx.get(base + "/v1/models", timeout=30).status_code == 200
    metrics = httpx.get(base + "/metrics", timeout=30).text
    refused = re.search(r'pgroups_http_refused_total\{status="431"\} (\d+)', metrics)
    assert refused and int(refused.group(1)) >= 64, metrics
