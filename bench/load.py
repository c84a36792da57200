"""Many concurrent streaming clients against a running server; prints what happened to each.

``python -m bench.load --clients 256`` against ``make serve`` (http://127.0.0.1:8000). Every
request must either complete with a full stream (``finish_reason`` and ``data: [DONE]``) or
be refused at once with 429; anything else (truncated, hung, 5xx) is counted as a failure
and makes the exit status non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter


async def one(client, base: str, i: int, max_tokens: int, headers: dict) -> str:
    body = {"prompt": f"load client {i} says", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.8, "seed": i}
    try:
        async with client.stream("POST", base + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code == 429:
                return "refused 429" if r.headers.get("retry-after") else "429 without Retry-After"
            if r.status_code != 200:
                return f"http {r.status_code}"
            finish, done, n = None, False, 0
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    d = json.loads(line[6:])
                    if "error" in d:
                        return "error event"
                    n += 1
                    finish = d["choices"][0]["finish_reason"] or finish
            return "complete" if done and finish else "truncated"
    except Exception as e:  # a hang or a dropped connection
        return f"failed ({type(e).__name__})"


GOOD = ("complete", "refused 429")


async def run_clients(url: str, clients: int, max_tokens: int, api_key: str | None = None,
                      timeout: float = 600.0) -> Counter:
    """Outcome counts of ``clients`` concurrent streams (see ``GOOD`` for the acceptable ones)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = [one(client, url, i, max_tokens, headers) for i in range(clients)]
        return Counter(await asyncio.gather(*tasks))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--api-key", default=None)
    a = p.parse_args(argv)
    t0 = time.monotonic()
    counts = asyncio.run(run_clients(a.url, a.clients, a.max_tokens, a.api_key, a.timeout))
    bad = sum(v for k, v in counts.items() if k not in GOOD)
    print(f"{a.clients} streaming clients, {a.max_tokens} tokens each, {time.monotonic() - t0:.1f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
