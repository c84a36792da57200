"""The page at / in a real browser (headless Chromium): a chat answer streams and stops, a second
chat runs while the first streams, the pipeline view shows both groups busy under load and idle
after, and markup in a model's answer stays text. Screenshots of both views go to
tests/artifacts/."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import ray

from tests.e2e.browser import chromium, screenshot
from tests.e2e.test_http_api import APP


@pytest.fixture(scope="module")
def base(deploy) -> str:
    return deploy(APP)


@pytest.fixture
def page(base):
    with chromium() as ctx:
        page = ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(base + "/")
        yield page
        assert not errors, errors


@contextmanager
def frozen_stage() -> Iterator[None]:
    """The RPC stage's server stopped (SIGSTOP) for the block: no step ends meanwhile, so a
    stream that has begun cannot end by itself, however fast the box; continued after, within
    seconds (the watchdog's ``stage_timeout_s`` is a minute)."""
    from deployments.stage.actor import get_stage

    pid = ray.get(get_stage().health.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextmanager
def endless_chat() -> Iterator[str]:
    """A loopback server whose chat stream never ends by itself (a word every 50 ms until the
    block ends or its client leaves): the URL a test sends one conversation's request to, so
    that it streams for as long as the test needs, whatever the box's speed."""
    done = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body runs until the connection closes

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunk = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "word "}}]}
            try:
                while not done.is_set():
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    done.wait(0.05)
            except OSError:  # the page stopped it
                pass

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"
    finally:
        done.set()
        server.shutdown()
        server.server_close()


def send(page, text: str, max_tokens: int) -> None:
    page.fill("#set-max_tokens", str(max_tokens))
    page.fill("[data-testid=prompt]", text)
    page.click("[data-testid=send]")


def last_answer(page):
    return page.locator("[data-testid=msg-assistant]").last


def test_the_page_is_served_with_the_guard_and_no_cdn(base):
    r = httpx.get(base + "/", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "http" not in r.text.split("<body>")[0].replace("http-equiv", "")  # no resource from elsewhere
    assert "default-src 'self'" in r.text and r.headers["x-frame-options"] == "DENY"
    assert httpx.get(base + "/ui/app.js", timeout=30).status_code == 200
    assert httpx.get(base + "/ui/../ingress.py", timeout=30).status_code == 404
    assert httpx.get(base + "/", headers={"host": "rebind.example"}, timeout=30).status_code == 403
    data = httpx.get(base + "/pipeline", timeout=30).json()
    r0 = data["replicas"][0]
    assert [g["group"] for g in r0["groups"]] == [0, 1] and {s["stage"] for s in r0["stages"]} == {"peer", "local"}
    # each group's prompt cache: one entry a slot by default
    assert all(g["prompt_cache"]["capacity"] == len(g["slots"]) for g in r0["groups"])


def test_a_chat_answer_streams_and_stops(page, base):
    """Stop cuts a running answer and frees its slot. The stage is frozen from before the send
    to after the click, so the answer cannot end by itself first on any box (the synthetic model
    fills its 512 tokens in well under a second on a fast one); that tokens stream is seen on
    the answer after it."""
    with frozen_stage():
        send(page, "tell me a long story", 100_000)
        page.wait_for_function("!document.querySelector('[data-testid=stop]').disabled", timeout=30_000)
        assert page.is_disabled("[data-testid=send]")
        deadline = time.monotonic() + 30  # the engine has taken it: a slot is processing
        while not any(s["is_processing"] for s in httpx.get(base + "/slots", timeout=10).json()):
            assert time.monotonic() < deadline, "the request never reached a slot"
            time.sleep(0.1)
        page.click("[data-testid=stop]")
        page.wait_for_function("document.querySelector('[data-testid=stop]').disabled", timeout=30_000)
        assert "stopped" in last_answer(page).locator("[data-testid=stats]").inner_text()
    deadline = time.monotonic() + 20  # the stop reached the engine: its slot is free
    while any(s["is_processing"] for s in httpx.get(base + "/slots", timeout=10).json()):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    send(page, "and a short one", 64)  # tokens stream into the next answer
    answer = last_answer(page)
    answer.locator("[data-testid=stats]").wait_for(timeout=60_000)
    assert answer.locator("[data-testid=content]").inner_text().strip(), answer.inner_text()
    screenshot(page, "page-chat.png")


def test_a_second_chat_runs_while_the_first_streams(page):
    """The page holds two conversations at once: the second is sent, streams and ends while the
    first still streams. The first's answer comes from a stream that cannot end by itself
    (``endless_chat``), so "still streams" holds on any box; the second is the server's."""
    with endless_chat() as endless:
        def first_to_endless(route) -> None:
            body = json.loads(route.request.post_data or "{}")
            if body.get("max_tokens", 0) > 1000:
                route.continue_(url=endless)
            else:
                route.continue_()

        page.route("**/v1/chat/completions", first_to_endless)
        send(page, "first, long", 100_000)
        last_answer(page).locator("[data-testid=content] p").first.wait_for(timeout=60_000)
        page.click("[data-testid=new-chat]")
        send(page, "second, short", 8)
        stats = last_answer(page).locator("[data-testid=stats]")
        stats.wait_for(timeout=60_000)
        assert "tokens/s" in stats.inner_text() and "cached" in stats.inner_text(), stats.inner_text()
        first = page.locator("[data-testid=conversation]").nth(1)
        assert "streaming" in (first.get_attribute("class") or ""), first.get_attribute("class")
        first.click()  # the first: its text is there and still growing
        page.wait_for_function("[...document.querySelectorAll('[data-testid=msg-assistant]')].pop()"
                               ".innerText.length > 20", timeout=30_000)
        assert page.is_enabled("[data-testid=stop]")
        page.click("[data-testid=stop]")
        page.wait_for_function("!document.querySelector('li.streaming')", timeout=30_000)


def test_the_pipeline_view_shows_both_groups_busy_under_load_and_idle_after(page, base):
    stop = threading.Event()

    def load() -> None:
        body = {"prompt": "load", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        page.click("[data-testid=tab-pipeline]")
        page.wait_for_function("[...document.querySelectorAll('[data-testid=group]')].length === 2 && "
                               "[...document.querySelectorAll('[data-testid=group]')].every(g => +g.dataset.busy > 0)",
                               timeout=60_000)
        page.wait_for_function("parseFloat(document.querySelector('[data-testid=tps]').innerText) > 0", timeout=60_000)
        page.locator("[data-testid=slot][data-state=generating]").first.wait_for(timeout=30_000)
        assert page.locator("[data-testid=stage-peer]").count() == 1
        assert page.locator("[data-testid=topology]").inner_text() == "layer_split"
        # each group's prompt cache beside it: what it holds on each stage's device, its counters
        cache = page.locator("[data-testid=prompt-cache]").first.inner_text()
        assert "MiB on RPC" in cache and "misses" in cache and "superseded" in cache, cache
        screenshot(page, "page-pipeline.png")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    page.wait_for_function("[...document.querySelectorAll('[data-testid=group]')].every(g => +g.dataset.busy === 0)",
                           timeout=60_000)


def test_markup_in_an_answer_stays_text(page):
    """The model's output is untrusted: a <script> or an <img onerror> in it is shown, not run."""
    hostile = '<img src=x onerror="window.__pwned=1"> <script>window.__pwned=2</script> **bold** `code`'
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": hostile}}]},
              {"choices": [{"index": 0, "delta": {"reasoning_content": "<b onclick=x>think</b>"}}]},
              {"choices": [{"index": 0, "delta": {"content": "\n\n```html\n<iframe src=/></iframe>\n```"}}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=200, body=body,
                                                                      content_type="text/event-stream"))
    send(page, "say something nasty", 8)
    answer = last_answer(page)
    answer.locator("[data-testid=stats]").wait_for(timeout=30_000)
    time.sleep(0.5)
    assert page.evaluate("window.__pwned") is None
    assert answer.locator("img, script, iframe, b").count() == 0
    text = answer.inner_text()
    assert '<img src=x onerror="window.__pwned=1">' in text and "<script>" in text and "<iframe src=/></iframe>" in text
    assert answer.locator("strong").inner_text() == "bold" and answer.locator("pre code").count() == 1
    assert answer.locator("[data-testid=reasoning]").inner_text() == "<b onclick=x>think</b>"
