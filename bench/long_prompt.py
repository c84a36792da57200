"""A long prompt beside decoding streams: what its prefill does to the other streams' gaps.

Gemma 3 270M split over a ggml RPC stage on loopback (9 of its 18 layers on the peer), 8
streams decoding (greedy, end of generation ignored); after ``--steady`` seconds one prompt of
``--prompt`` tokens (4,096 by default) arrives. For every stream, the gaps between its
tokens: steady (the seconds before the prompt arrives) and during the prefill (from its
arrival to its first token). Arms: the engine with 1 and 2 groups, chunked prefill on (the
default, ``prefill_stall`` 0.5 and ``prefill_chunk_min`` 8; and with a floor of 4) and off
(the batch filled to ``n_batch``, as llama-server does), and llama-server with rpc-server on
the same split (``LLAMA_SERVER_BIN``; skipped without it). Prints one JSON line per arm and a
table; writes bench/results/long_prompt.*.

    python -m bench.long_prompt [--prompt 4096] [--arms "a;b"]     (make bench-long)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator

from bench.run import ROOT
from deployments.stage import server as rpc_server
from engine import Engine, EngineConfig, SamplingParams
from engine.models import GEMMA_MODEL

PORT, LS_PORT, LS_RPC = 50193, 50194, 50195
N_STREAMS = 8
N_PEER, N_LAYER = 9, 18
SLOTS = 10  # the streams and the long prompt, 5 a group with 2 groups
WORDS = range(1000, 30000)  # ordinary pieces of Gemma's vocabulary


def prompts(n_prompt: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(3)
    streams = [[2] + [rng.choice(WORDS) for _ in range(24)] for _ in range(N_STREAMS)]
    return streams, [2] + [rng.choice(WORDS) for _ in range(n_prompt - 1)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def figures(arrivals: list[list[float]], t_submit: float, t_first: float, steady_s: float) -> dict:
    """Gaps between consecutive outputs of each stream, by where the later one fell."""
    steady, during = [], []
    for ts in arrivals:
        for a, b in zip(ts, ts[1:], strict=False):
            if t_submit - steady_s <= a and b <= t_submit:
                steady.append(b - a)
            elif b > t_submit and a < t_first:
                during.append(b - a)
    ms = 1000.0
    return {
        "prefill_s": round(t_first - t_submit, 2),
        "steady_median_ms": round(statistics.median(steady) * ms, 1) if steady else None,
        "steady_p99_ms": round(pct(steady, 0.99) * ms, 1),
        "during_median_ms": round(statistics.median(during) * ms, 1) if during else None,
        "during_p99_ms": round(pct(during, 0.99) * ms, 1),
        "during_max_ms": round(max(during, default=0.0) * ms, 1),
        "n_gaps": [len(steady), len(during)],
    }


def timeline(open_stream: Callable[[list[int], int], Iterator[int]], streams: list[list[int]],
             long_prompt: list[int], steady_s: float) -> dict:
    """Run the streams, then the long prompt; ``open_stream(prompt, max_tokens)`` yields once
    per output with its token count, until it is closed."""
    arrivals: list[list[float]] = [[] for _ in streams]
    stop = threading.Event()

    def stream(i: int) -> None:
        it = open_stream(streams[i], 3000)
        try:
            for n in it:
                if n:
                    arrivals[i].append(time.perf_counter())
                if stop.is_set():
                    break
        finally:
            close = getattr(it, "close", None)
            if close:
                close()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(streams))]
    for t in threads:
        t.start()
    while not all(len(a) >= 3 for a in arrivals):  # all decoding
        time.sleep(0.05)
    time.sleep(steady_s)
    t_submit = time.perf_counter()
    first = None
    for n in open_stream(long_prompt, 1):
        if n:
            first = time.perf_counter()
            break
    stop.set()
    for t in threads:
        t.join(60)
    return figures(arrivals, t_submit, first or time.perf_counter(), steady_s)


def engine_arm(groups: int, stall: float | None, chunk_min: int = 8) -> Callable[[], tuple[Callable, Callable]]:
    def start() -> tuple[Callable, Callable]:
        e = Engine(EngineConfig(model=str(GEMMA_MODEL), rpc_endpoints=[f"127.0.0.1:{PORT}"], peer_layers=N_PEER,
                                n_parallel=SLOTS, pipeline_groups=groups, n_ctx=SLOTS * 4352, n_threads=1,
                                cache_prompt=False, prefill_stall=stall, prefill_chunk_min=chunk_min))

        def open_stream(prompt: list[int], n: int) -> Iterator[int]:
            for o in e.stream(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
                yield o.n_tokens

        return open_stream, e.close
    return start


def llama_server_arm() -> tuple[Callable, Callable]:
    import httpx

    from bench.llama_server import LlamaServer

    ls = LlamaServer(GEMMA_MODEL, n_layer=N_LAYER, n_peer=N_PEER, output_local=True, slots=SLOTS,
                     n_ctx=SLOTS * 4352, port=LS_PORT, rpc_port=LS_RPC, flash_attn="on")

    def open_stream(prompt: list[int], n: int) -> Iterator[int]:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "stream": True,
                "cache_prompt": False}
        with httpx.stream("POST", ls.base + "/completion", json=body, timeout=900) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    d = json.loads(line[6:])
                    yield 1 if d.get("content") or d.get("tokens") else 0
                    if d.get("stop"):
                        return

    return open_stream, ls.close


ARMS = {
    "1 group, chunked prefill": engine_arm(1, 0.5),
    "1 group, whole batches": engine_arm(1, None),
    "2 groups, chunked prefill": engine_arm(2, 0.5),
    "2 groups, whole batches": engine_arm(2, None),
    # a lower floor under the learnt chunk (on a CPU the learnt chunk is below it)
    "1 group, chunked prefill, chunk_min 4": engine_arm(1, 0.5, 4),
    "2 groups, chunked prefill, chunk_min 4": engine_arm(2, 0.5, 4),
    "llama-server": llama_server_arm,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=4096, help="tokens of the long prompt")
    ap.add_argument("--steady", type=float, default=8.0, help="seconds of steady decoding measured first")
    ap.add_argument("--arms", default=";".join(ARMS), help="arm names, separated by semicolons")
    a = ap.parse_args(argv)
    streams, long_prompt = prompts(a.prompt)
    server = rpc_server.launch("127.0.0.1", PORT, threads=1)
    rows = []
    try:
        for name in a.arms.split(";"):
            try:
                open_stream, close = ARMS[name]()
            except FileNotFoundError as e:  # llama-server not built
                print(f"{name}: skipped ({e})", flush=True)
                continue
            try:
                list(open_stream(long_prompt[:64], 2))  # warm-up
                row = {"arm": name, "prompt": a.prompt, **timeline(open_stream, streams, long_prompt, a.steady)}
            finally:
                close()
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.kill()
        server.wait()
    lines = ["| arm | prefill | steady gap median / p99 | gap during the prefill median / p99 / longest |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['prefill_s']} s | {r['steady_median_ms']} / {r['steady_p99_ms']} ms | "
                     f"{r['during_median_ms']} / {r['during_p99_ms']} / {r['during_max_ms']} ms |")
    table = "\n".join(lines)
    print(table)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_prompt.md").write_text(table + "\n")
    (out / "long_prompt.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
