"""A soak: mixed load with disconnects, timeouts, bad input and a peer kill every few minutes.

``python -m bench.soak --minutes 10`` against a running ``make serve`` (it joins the same
Ray cluster to kill the peer's RPC server and to read the replicas' tables). Every request
must end in a result or a clear error; a request *lost* is one that hung, or whose stream
ended without ``[DONE]``, or got a 5xx other than 503 (the outage's "retry"). Prints the
outcomes by kind, the peer kills and recoveries, and the replicas' RSS over the run;
exits non-zero when a request was lost or a table was left non-empty.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter

import httpx

KINDS = ["stream", "stream", "stream", "plain", "chat", "drop", "client-timeout", "bad"]
LOST = ("hung", "truncated", "5xx")


async def one(client: httpx.AsyncClient, base: str, kind: str, rng: random.Random) -> str:
    n = rng.randint(4, 48)
    body: dict = {"prompt": "soak " * rng.randint(1, 60), "max_tokens": n, "ignore_eos": True}
    path = "/v1/completions"
    if kind == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * n}], "max_tokens": n}
    if kind == "bad":
        body = rng.choice([{"prompt": "x", "max_tokens": -1}, {"prompt": 5}, {"messages": []}, {"prompt": "x", "top_p": 7}])
    stream = kind in ("stream", "drop", "client-timeout")
    body["stream"] = stream
    timeout = 0.3 if kind == "client-timeout" else 120.0
    try:
        if not stream:
            r = await client.post(base + path, json=body, timeout=timeout)
            return _status(kind, r.status_code)
        async with client.stream("POST", base + path, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return _status(kind, r.status_code)
            async for line in r.aiter_lines():
                if kind == "drop" and line.startswith("data: {") and rng.random() < 0.3:
                    return "dropped by client"
                if line.startswith('data: {"error"'):
                    code = json.loads(line[6:])["error"].get("code")
                    return f"error event {code}"
                if line == "data: [DONE]":
                    return "complete"
            return "truncated"
    except httpx.TimeoutException:
        return "client timeout" if kind == "client-timeout" else "hung"
    except httpx.HTTPError as e:
        return f"transport {type(e).__name__}"


def _status(kind: str, code: int) -> str:
    if code == 200:
        return "complete"
    if kind == "bad" and code == 400:
        return "400 (bad input)"
    if code in (429, 503):
        return f"refused {code}"
    return "5xx" if code >= 500 else f"http {code}"


async def load(base: str, clients: int, until: float, seed: int) -> Counter:
    rng = random.Random(seed)
    counts: Counter = Counter()
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits) as client:

        async def worker() -> None:
            while time.monotonic() < until:
                kind = rng.choice(KINDS)
                counts[f"{kind}: {await one(client, base, kind, rng)}"] += 1

        await asyncio.gather(*(worker() for _ in range(clients)))
    return counts


def chaos(address: str, app: str, kill_every_s: float, until: float, log: list) -> None:
    """Kill the peer's RPC server every ``kill_every_s``; sample the replicas' tables."""
    import ray
    from ray import serve

    from deployments.stage.actor import get_stage

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    engine = serve.get_deployment_handle("engine", app)
    ingress = serve.get_deployment_handle("ingress", app)
    next_kill = time.monotonic() + kill_every_s
    while time.monotonic() < until:
        now = time.monotonic()
        try:
            eng = engine.tables.remote().result(timeout_s=10)
            ing = ingress.tables.remote().result(timeout_s=10)
            log.append({"t": now, "engine": eng, "ingress": ing})
        except Exception as e:  # the engine is restarting
            log.append({"t": now, "error": type(e).__name__})
        if now >= next_kill and now + 30 < until:
            pid = ray.get(get_stage().kill_server.remote())
            log.append({"t": now, "killed": pid})
            next_kill = now + kill_every_s
        time.sleep(5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "127.0.0.1:6390"))
    p.add_argument("--app", default="pipeline-groups")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--kill-every-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import threading

    from cluster import local_cluster

    os.environ.update({k: v for k, v in local_cluster.auth_env().items() if k.startswith("RAY_AUTH")})
    t0 = time.monotonic()
    until = t0 + 60 * a.minutes
    samples: list = []
    th = threading.Thread(target=chaos, args=(a.address, a.app, a.kill_every_s, until, samples), daemon=True)
    th.start()
    counts = asyncio.run(load(a.url, a.clients, until, a.seed))
    th.join(60)
    time.sleep(5)
    final = _final_tables(a.address, a.app)
    lost = sum(v for k, v in counts.items() if k.split(": ", 1)[1] in LOST)
    kills = [s for s in samples if "killed" in s]
    print(f"soak: {a.minutes:g} min, {a.clients} clients, {sum(counts.values())} requests, "
          f"{len(kills)} peer kills, lost {lost}")
    for k, v in sorted(counts.items()):
        print(f"  {v:6d}  {k}")
    print(_rss_report(samples))
    print(f"tables after the run: {final}")
    leftover = final.get("pending", 0) + final.get("owners", 0) + final.get("running", 0)
    return 1 if lost or leftover else 0


def _final_tables(address: str, app: str) -> dict:
    from ray import serve

    try:
        eng = serve.get_deployment_handle("engine", app).tables.remote().result(timeout_s=30)
        ing = serve.get_deployment_handle("ingress", app).tables.remote().result(timeout_s=30)
        return {**eng, "pending": ing["pending"]}
    except Exception as e:
        return {"error": str(e)}


def _rss_report(samples: list) -> str:
    """RSS growth within each engine replica's life (a peer kill restarts it) and of the ingress."""
    by_replica: dict[str, list[int]] = {}
    ing: list[int] = []
    for s in samples:
        if "engine" in s:
            by_replica.setdefault(s["engine"]["replica"], []).append(s["engine"]["rss_bytes"])
            ing.append(s["ingress"]["rss_bytes"])
    mib = 2**20
    parts = [f"engine replica {r[:8]}: {v[0] / mib:.0f} -> {v[-1] / mib:.0f} MiB over {len(v)} samples"
             for r, v in by_replica.items()]
    if ing:
        parts.append(f"ingress: {ing[0] / mib:.0f} -> {ing[-1] / mib:.0f} MiB")
    return "RSS: " + "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
