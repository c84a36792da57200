"""Load generators for one benchmark cell: straight on the engine, or over HTTP with SSE.

Both send the same requests (token-id prompts, fixed seeds, ``ignore_eos``) from
``clients`` concurrent workers and return per-request timings, from which the cell's
figures are computed the same way for both paths.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import Engine, SamplingParams

WORD_TOKENS = range(300, 700)  # ordinary word pieces of the synthetic vocabulary


@dataclass
class RequestTiming:
    ok: bool
    t_start: float
    t_first: float = 0.0
    t_last: float = 0.0
    n_tokens: int = 0
    cached: int = 0  # prompt tokens the server reused (usage.prompt_tokens_details.cached_tokens)
    error: str = ""


@dataclass
class LoadResult:
    wall_s: float
    timings: list[RequestTiming] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(1 for t in self.timings if not t.ok)

    def figures(self) -> dict:
        ok = [t for t in self.timings if t.ok]
        toks = sum(t.n_tokens for t in ok)
        tpots = [(t.t_last - t.t_first) / (t.n_tokens - 1) for t in ok if t.n_tokens > 1]
        ttfts = [t.t_first - t.t_start for t in ok if t.t_first]
        return {
            "tok_s": round(toks / self.wall_s, 2) if self.wall_s else 0.0,
            "tpot_ms": round(1000 * statistics.mean(tpots), 1) if tpots else None,
            "ttft_median_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "ttft_mean_s": round(statistics.mean(ttfts), 3) if ttfts else None,
            "ttft_p99_s": round(statistics.quantiles(ttfts, n=100, method="inclusive")[98], 3) if len(ttfts) > 1 else None,
            "cached_tokens": sum(t.cached for t in ok),
            "errors": self.errors,
            "requests": len(self.timings),
        }


def make_prompts(n: int, n_prompt: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    """``n`` prompts of ``n_prompt`` tokens; the first ``shared_prefix`` (after BOS) are the same
    in all of them, as a system prompt is."""
    rng = random.Random(seed)
    prefix = [rng.choice(WORD_TOKENS) for _ in range(shared_prefix)]
    return [[1] + prefix + [rng.choice(WORD_TOKENS) for _ in range(n_prompt - 1 - shared_prefix)] for _ in range(n)]


def sampling(i: int, n_gen: int) -> dict:
    """llama-server's default chain, so the sampling cost over the vocabulary is real."""
    return {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 1000 + i,
            "max_tokens": n_gen, "ignore_eos": True}


def run_engine(engine: Engine, prompts: list[list[int]] | list[str], clients: int, n_gen: int,
               extra: Callable[[int], dict] | None = None) -> LoadResult:
    """Every prompt through the engine by ``clients`` threads; ``extra(i)``: more request
    fields for prompt ``i`` (over the defaults of ``sampling``)."""
    timings: list[RequestTiming] = []
    lock = threading.Lock()
    work = list(enumerate(prompts))

    def worker() -> None:
        while True:
            with lock:
                if not work:
                    return
                i, p = work.pop(0)
            t = RequestTiming(ok=False, t_start=time.perf_counter())
            try:
                for o in engine.stream(p, SamplingParams(**{**sampling(i, n_gen), **(extra(i) if extra else {})})):
                    now = time.perf_counter()
                    if o.n_tokens:
                        t.n_tokens += o.n_tokens
                        t.t_first = t.t_first or now
                        t.t_last = now
                    if o.finish_reason is not None:
                        t.ok = o.finish_reason == "length" and t.n_tokens == n_gen
                        t.error = getattr(o, "message", "") or ("" if t.ok else f"finish {o.finish_reason}, {t.n_tokens} tokens")
            except Exception as e:  # counted as an error of the cell
                t.error = repr(e)
            with lock:
                timings.append(t)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return LoadResult(time.perf_counter() - t0, timings)


async def _http_one(client, base: str, i: int, prompt: list[int], n_gen: int) -> RequestTiming:
    body = {"prompt": prompt, "stream": True, "stream_options": {"include_usage": True}, **sampling(i, n_gen)}
    t = RequestTiming(ok=False, t_start=time.perf_counter())
    try:
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                t.error = f"http {r.status_code}"
                return t
            done = False
            events, usage_tokens = 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                if line == "data: [DONE]":
                    done = True
                    break
                d = json.loads(line[6:])
                if "error" in d:
                    t.error = d["error"]["message"]
                    return t
                if d.get("usage"):
                    usage_tokens = d["usage"]["completion_tokens"]
                    t.cached = int((d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                if d.get("choices"):
                    t.t_first = t.t_first or now
                    t.t_last = now
                    c = d["choices"][0]
                    events += bool(c.get("text") or (c.get("delta") or {}).get("content"))
            # a server without usage in the stream sends one event per token
            t.n_tokens = usage_tokens if usage_tokens is not None else events
            t.ok = done and t.n_tokens == n_gen
            if not t.ok:
                t.error = f"truncated: done={done}, {t.n_tokens} tokens"
    except Exception as e:
        t.error = repr(e)
    return t


def run_http(base: str, prompts: list[list[int]], clients: int, n_gen: int, timeout_s: float = 600) -> LoadResult:
    import httpx

    async def main() -> LoadResult:
        sem = asyncio.Semaphore(clients)
        limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

            async def one(i: int, p: list[int]) -> RequestTiming:
                async with sem:
                    return await _http_one(client, base, i, p, n_gen)

            t0 = time.perf_counter()
            timings = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            return LoadResult(time.perf_counter() - t0, list(timings))

    return asyncio.run(main())
