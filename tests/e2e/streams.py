"""Requests as the e2e tests watch them: how a stream ended, which engine replica answered,
which replicas the ingress serves from."""

from __future__ import annotations

import json
import time

import httpx


def replicas_seen(base: str, n: int, timeout_s: float = 180.0) -> set[str]:
    """The engine replicas the ingress holds streams to, once there are ``n``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reps = {s["replica"] for s in httpx.get(base + "/slots", timeout=10).json()}
        except (httpx.HTTPError, ValueError, KeyError):
            reps = set()
        if len(reps) == n:
            return reps
        assert time.monotonic() < deadline, f"only {reps} after {timeout_s} s"
        time.sleep(0.5)


def served_by(base: str, prompt: str, max_tokens: int = 4) -> str:
    """The engine replica that answered one completion."""
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-engine-replica"]


def resumes(base: str) -> float:
    """Choices the ingress has resumed after a fault (every cause)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pgroups_resumes_total")


def stream_text(base: str, body: dict, progress: list | None = None) -> tuple[str, str, int | None]:
    """One streamed completion's outcome (as ``stream_outcome``), its text and the tokens its
    closing ``usage`` counts; ``progress`` gets one item per event with text (a caller waits
    for it)."""
    parts: list[str] = []
    used = None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                return f"http {r.status_code}", "", None
            err = None
            for line in r.iter_lines():
                if line.startswith('data: {"error"'):
                    err = json.loads(line[6:])["error"]["code"]
                elif line == "data: [DONE]":
                    return (f"error {err}" if err else "completed"), "".join(parts), used
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        used = event["usage"]["completion_tokens"]
                    text = "".join(c.get("text") or "" for c in event.get("choices") or [])
                    if text:
                        parts.append(text)
                        if progress is not None:
                            progress.append(1)
            return "no end", "".join(parts), used
    except httpx.HTTPError as e:
        return f"transport {type(e).__name__}", "".join(parts), used


def stream_outcome(base: str, body: dict, headers: dict | None = None) -> str:
    """One streamed completion: "completed", "error <code>" (an SSE error event, then [DONE]),
    "http <status>", "transport <error>" or "no end" (the stream stopped without [DONE]).
    ``headers`` receives the response's headers."""
    try:
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            if headers is not None:
                headers.update(r.headers)
            if r.status_code != 200:
                return f"http {r.status_code}"
            err = None
            for line in r.iter_lines():
                if line.startswith('data: {"error"'):
                    err = json.loads(line[6:])["error"]["code"]
                elif line == "data: [DONE]":
                    return f"error {err}" if err else "completed"
            return "no end"
    except httpx.HTTPError as e:
        return f"transport {type(e).__name__}"
