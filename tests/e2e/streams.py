"""Streamed requests as the e2e tests watch them: how each one ended."""

from __future__ import annotations

import json

import httpx


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
