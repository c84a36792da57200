"""Edges over HTTP: bounded bodies, clients that vanish at any point, an engine replica
that restarts under the ingress, and a stage whose settings change."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

import httpx
import ray
from ray import serve

from tests.e2e.streams import stream_outcome
from tests.e2e.test_http_api import APP

log = logging.getLogger(__name__)


def handles() -> tuple:
    return serve.get_deployment_handle("ingress", "pgroups"), serve.get_deployment_handle("engine", "pgroups")


def tables() -> tuple[dict, dict]:
    ing, eng = handles()
    return ing.tables.remote().result(timeout_s=30), eng.tables.remote().result(timeout_s=30)


def wait_empty(timeout_s: float = 30.0) -> tuple[dict, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        ing, eng = tables()
        empty = ing["pending"] == 0 and all(
            eng[k] == 0 for k in ("owners", "connection_requests", "running", "waiting", "active_slots")
        )
        if empty or time.monotonic() > deadline:
            return ing, eng
        time.sleep(0.2)


def test_chunked_bodies_are_bounded_before_they_are_read(deploy):
    base = deploy(APP)

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * (1024 * 1024)  # 10 MiB, past the 8 MiB limit, with no Content-Length
        yield b'"}'

    for path in ("/v1/completions", "/slots/0?action=erase"):
        r = httpx.post(base + path, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413, (path, r.status_code, r.text[:200])
    r = httpx.post(base + "/slots/0?action=erase", content=b"a" * (9 * 1024 * 1024), timeout=60)
    assert r.status_code == 413


async def one_client(host: str, port: int, i: int, rng: random.Random) -> str:
    """One request that the client abandons at a random point (or reads to the end)."""
    stream = rng.random() < 0.7
    body = json.dumps({"prompt": f"client {i} " * rng.randint(1, 20), "max_tokens": rng.randint(1, 16),
                       "ignore_eos": True, "stream": stream}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    point = rng.choice(["mid-body", "after-body", "after-headers", "after-chunk", "end", "end"])
    reader, writer = await asyncio.open_connection(host, port)
    try:
        if point == "mid-body":
            writer.write(head + body[: len(body) // 2])
            await writer.drain()
            return point
        writer.write(head + body)
        await writer.drain()
        if point == "after-body":
            await asyncio.sleep(rng.random() * 0.05)
            return point
        status = await asyncio.wait_for(reader.readline(), 60)
        if point == "after-headers":
            return point
        if point == "after-chunk" and stream:
            await asyncio.wait_for(reader.readuntil(b"data: "), 60)
            return point
        rest = await asyncio.wait_for(reader.read(), 60)
        ok = b" 200 " in status and (not stream or b"[DONE]" in rest)
        return "end" if ok else f"bad end {status!r}"
    finally:
        writer.close()


def test_a_thousand_clients_vanishing_anywhere_leave_every_table_empty_and_rss_flat(deploy):
    base = deploy(APP)
    host, port = base.removeprefix("http://").split(":")
    rng = random.Random(1234)

    async def wave(first: int, n: int) -> list[str]:
        sem = asyncio.Semaphore(16)

        async def run(i: int) -> str:
            async with sem:
                return await one_client(host, int(port), i, rng)

        return await asyncio.gather(*(run(i) for i in range(first, first + n)))

    outcomes = asyncio.run(wave(0, 200))  # warm-up: allocator pools, caches
    ing0, eng0 = wait_empty()
    outcomes += asyncio.run(wave(200, 800))
    ing1, eng1 = wait_empty()
    bad = [o for o in outcomes if o.startswith("bad")]
    assert not bad, bad[:5]
    assert outcomes.count("end") > 100
    assert ing1["pending"] == 0, ing1
    for k in ("owners", "connection_requests", "running", "waiting", "active_slots"):
        assert eng1[k] == 0, (k, eng1)
    assert eng1["connections"] == 1, eng1  # the one ingress stream, nothing recreated
    growth = eng1["rss_bytes"] - eng0["rss_bytes"]
    log.warning("1000 vanishing clients: %s; engine RSS %+.1f MiB", {o: outcomes.count(o) for o in set(outcomes)},
                growth / 2**20)
    assert growth < 32 * 2**20, f"engine RSS grew by {growth / 2**20:.1f} MiB over 800 requests"
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_a_client_that_leaves_before_its_whole_answer_cancels_it(deploy):
    """Not streamed, a request whose client goes away is cancelled in the engine (served
    directly, no proxy cancels the call for it), not generated to its length."""
    import socket

    base = deploy(APP)
    body = b'{"prompt": "gone", "max_tokens": 480, "ignore_eos": true}'
    host, port = base.removeprefix("http://").split(":")
    socks = []
    for _ in range(3):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        socks.append(s)
    wait_busy(base, 3)
    before = _cancelled(base)
    for s in socks:
        s.close()
    ing, eng = wait_empty()
    assert eng["running"] == 0 and ing["pending"] == 0, (ing, eng)
    assert _cancelled(base) - before == 3  # cancelled, not finished by their length


def _cancelled(base: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pgroups_requests_total" and s.labels.get("finished_reason") == "cancelled")


def wait_busy(base: str, n: int, timeout_s: float = 60.0) -> None:
    """Until ``n`` slots are processing."""
    deadline = time.monotonic() + timeout_s
    while sum(s["is_processing"] for s in httpx.get(base + "/slots", timeout=10).json()) < n:
        assert time.monotonic() < deadline, f"{n} slots never became busy"
        time.sleep(0.05)


def test_an_engine_replica_restart_resumes_its_streams_and_the_next_ones_complete(deploy):
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e.streams import resumes, stream_text
    from tests.e2e.test_peer_failure import cached_before_the_fault, check_no_stale_kv

    base = deploy(APP)
    conversation = cached_before_the_fault(base)  # a conversation cached in the replica to be killed
    long = {"prompt": "long", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    want = stream_text(base, long)
    assert want[0] == "completed", want
    before = resumes(base)
    progress: list[list] = [[] for _ in range(4)]
    with ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(stream_text, base, long, progress[i]) for i in range(4)]
        deadline = time.monotonic() + 60
        while min(len(p) for p in progress) < 4:
            assert time.monotonic() < deadline and not any(f.done() for f in futs)
            time.sleep(0.05)
        [engine] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith("SERVE_REPLICA::pgroups#engine#")]
        ray.kill(ray.get_actor(engine["name"], namespace=engine["namespace"]), no_restart=True)
        cut = [f.result(timeout=240) for f in futs]
    # each stream goes on on the new replica with all its tokens and (batch non-invariance
    # aside: see test_peer_failure.check_resumed) the unfaulted one's text
    assert [c[0] for c in cut] == ["completed"] * 4, cut
    assert [c[2] for c in cut] == [200] * 4, cut
    assert sum(c[1] == want[1] for c in cut) >= 2, (want, cut)
    assert resumes(base) >= before + 4
    deadline = time.monotonic() + 180
    while httpx.get(base + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(0.5)
    # the ingress reconnected to the new replica: every new request completes, none fails
    # on a stream that belonged to the old one
    short = {"prompt": "after", "max_tokens": 8, "ignore_eos": True}
    for _ in range(3):
        with ThreadPoolExecutor(8) as ex:
            after = list(ex.map(lambda _: stream_outcome(base, short), range(8)))
        if all(a == "completed" for a in after):
            break
        # a 503 with Retry-After while the ingress reconnects is allowed; a failed stream is not
        assert all(a in ("completed", "http 503") for a in after), after
        time.sleep(1)
    assert all(a == "completed" for a in after), after
    # its next turn on the new replica answers as its uncached twin and as before the death
    check_no_stale_kv(base, conversation)
    ing, eng = wait_empty()
    assert ing["pending"] == 0 and eng["owners"] == 0 and eng["connections"] == 1, (ing, eng)


def test_a_stage_whose_settings_changed_is_restarted_not_reused(deploy):
    from deployments.stage.actor import get_stage

    deploy(APP)
    before = ray.get(get_stage().health.remote())
    assert before["endpoint"].endswith(":50152")
    base = deploy({**APP, "rpc": {"port": 50153, "threads": 1}})
    after = ray.get(get_stage().health.remote())
    assert after["endpoint"].endswith(":50153") and after["pid"] != before["pid"]
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_the_first_client_vanishing_does_not_take_the_output_stream_with_it(deploy):
    """The first request of a fresh ingress opens the shared output stream. Serve cancels the
    calls made in a request's context when its client goes away: the stream, and the other
    requests on it, must not go with it."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    base = deploy({**APP, "rpc": {"port": 50154, "threads": 1}})  # a fresh ingress replica
    host, port = base.removeprefix("http://").split(":")
    first = socket.create_connection((host, int(port)), timeout=60)
    body = json.dumps({"prompt": "first", "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode()
    first.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    assert b" 200 " in first.recv(4096).split(b"\r\n", 1)[0]
    others = {"prompt": "on the same stream", "max_tokens": 300, "ignore_eos": True}
    with ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(stream_outcome, base, others) for _ in range(3)]
        wait_busy(base, 4)
        first.close()  # the request that opened the output stream goes away
        outcomes = [f.result(timeout=150) for f in futs]
    assert outcomes == ["completed"] * 3, outcomes
    ing, eng = wait_empty()
    assert ing["pending"] == 0 and eng["owners"] == 0 and eng["connections"] == 1, (ing, eng)
