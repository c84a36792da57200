"""Fair under mixed load, against llama-server in one run: a long prompt beside decoding streams, a
short request behind long prompts, an unpinned request beside pinned ones.

The demo as ``make serve`` serves it (deployments/configs/local.yaml: SmolLM2-135M-Instruct split
over the RPC stage on the local two-node Ray cluster, two pipeline groups, one thread a stage,
direct ingress, the chunked-prefill defaults) but with 10 slots of 4,096 tokens, so that 8 streams
and the long prompt fit; and llama-server with rpc-server on the same split (15 of the 30 layers
on the peer, the rest and the output layer local; ``LLAMA_SERVER_BIN``; skipped without it). Both
are driven over HTTP by one client, llama-server's ``/completion`` (token prompts, greedy, end of
generation ignored, prompt caching off). Arms: the engine with its defaults, with other values of
the knobs (the long cell only), with whole batches (``prefill_gap_factor: null``, as llama-server),
and llama-server. Every arm runs on a fresh server; its cells in this order:

- ``long``: 8 streams decode; after ``--steady`` seconds one prompt of ``--prompt`` tokens (3,000)
  arrives. Its time to the first token under load over the same length's alone (measured after
  the streams stop, with other tokens); the streams' gaps between tokens, steady (the seconds
  before) and during its prefill: median, p99, longest.
- ``short``: seven prompts of 464 tokens at once, then (0.2 s later) a 16-token request: its first
  token against one alone, and against one 464-token prompt alone.
- ``pinned``: a request generating on slot 0, then ``max_queued_per_slot`` + 4 requests pinned to
  slot 0 (``id_slot``, llama-server's field), then an unpinned request: how many pinned were
  refused (429), and the unpinned one's answer and first token against one alone.

The arms ``chunk N (fixed)`` give the long prompt N tokens a step whatever the cost model says
(``prefill_gap_factor`` 1, ``prefill_min_rate`` 0, ``prefill_chunk_min`` N): with the defaults
they draw the trade between the prompt's first token and the streams' gaps. The cell ``cost``
(first, in this process, no Ray) says why the trade is what it is: what a prompt token costs a
step by chunk size, beside two decoding streams on one group of the same split
(``--cost-knobs``: other engine settings for it, e.g. ``'{"flash_attn": false}'``).

Prints one JSON line per arm and the tables; writes bench/results/long_prompt.* (the cost cell
alone: bench/results/chunk_cost.*). The engine's arms
start Ray (``ray stop`` first and after: every Ray process of this user on the machine).

    python -m bench.long_prompt [--prompt 3000] [--arms "a;b"] [--cells cost,long,short,pinned]
    (make bench-long)
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
from concurrent.futures import ThreadPoolExecutor

import httpx

from bench.stack import ROOT, demo_args
from engine.models import CHAT_MODEL

LS_PORT, LS_RPC, RPC_PORT, COST_RPC = 50194, 50195, 50196, 50197
N_STREAMS = 8
N_PEER, N_LAYER = 15, 30
SLOTS, N_CTX_SLOT = 10, 4096  # the streams and the long prompt, 5 a group
N_LONG, LONG_TOKENS, SHORT_TOKENS = 7, 464, 16  # the short cell
PER_SLOT = 16  # the engine's max_queued_per_slot (its default)
WORDS = range(1000, 30000)  # ordinary pieces of the vocabulary
COST_SIZES = (8, 16, 32, 64, 128, 512)  # the cost cell's chunk sizes
COST_PROMPT = 1536  # ... and its prompt's tokens

# open_stream(prompt, max_tokens, id_slot) yields each output's token count until it ends or is
# closed; it raises Refused when the server turns the request away (HTTP 429)
Opener = Callable[[list[int], int, int], Iterator[int]]


class Refused(Exception):
    pass


class Prompts:
    """Random token prompts: none shares a prefix with another."""

    def __init__(self, seed: int = 3) -> None:
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        return [self.rng.choice(WORDS) for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def first_token(open_stream: Opener, prompt: list[int], id_slot: int = -1) -> float:
    """Seconds to the first token of a one-token request."""
    t0 = time.perf_counter()
    for n in open_stream(prompt, 1, id_slot):
        if n:
            return time.perf_counter() - t0
    raise RuntimeError("the request ended without a token")


def follow(it: Iterator[int], on_token: Callable[[], object], stop: threading.Event) -> None:
    """Read a stream until it ends or ``stop`` is set, calling ``on_token`` at each output with
    tokens; the stream is closed either way."""
    try:
        for n in it:
            if n:
                on_token()
            if stop.is_set():
                break
    finally:
        close = getattr(it, "close", None)
        if close:
            close()


def gaps(arrivals: list[list[float]], t_submit: float, t_first: float, steady_s: float) -> dict:
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
        "steady_median_ms": round(statistics.median(steady) * ms, 1) if steady else None,
        "steady_p99_ms": round(pct(steady, 0.99) * ms, 1),
        "during_median_ms": round(statistics.median(during) * ms, 1) if during else None,
        "during_p99_ms": round(pct(during, 0.99) * ms, 1),
        "during_max_ms": round(max(during, default=0.0) * ms, 1),
        "n_gaps": [len(steady), len(during)],
    }


def long_cell(open_stream: Opener, prompt: Prompts, n_prompt: int, steady_s: float) -> dict:
    """8 streams, then the long prompt; then the same length alone."""
    streams = [prompt(24) for _ in range(N_STREAMS)]
    arrivals: list[list[float]] = [[] for _ in streams]
    stop = threading.Event()

    def stream(i: int) -> None:
        follow(open_stream(streams[i], 3000, -1), lambda: arrivals[i].append(time.perf_counter()), stop)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(streams))]
    for t in threads:
        t.start()
    while not all(len(a) >= 3 for a in arrivals):  # all decoding
        time.sleep(0.05)
    time.sleep(steady_s)
    t_submit = time.perf_counter()
    loaded = first_token(open_stream, prompt(n_prompt))
    stop.set()
    for t in threads:
        t.join(60)
    time.sleep(1.0)
    alone = first_token(open_stream, prompt(n_prompt))
    return {"prefill_loaded_s": round(loaded, 2), "prefill_alone_s": round(alone, 2),
            "prefill_ratio": round(loaded / alone, 2),
            **gaps(arrivals, t_submit, t_submit + loaded, steady_s)}


def short_cell(open_stream: Opener, prompt: Prompts) -> dict:
    """A short request behind seven 464-token prompts, against each alone."""
    short_alone = first_token(open_stream, prompt(SHORT_TOKENS))
    long_alone = first_token(open_stream, prompt(LONG_TOKENS))
    longs = [prompt(LONG_TOKENS) for _ in range(N_LONG)]
    with ThreadPoolExecutor(N_LONG) as pool:
        futs = [pool.submit(first_token, open_stream, p) for p in longs]
        time.sleep(0.2)
        behind = first_token(open_stream, prompt(SHORT_TOKENS))
        long_loaded = max(f.result() for f in futs)
    return {"short_alone_s": round(short_alone, 3), "long_alone_s": round(long_alone, 2),
            "short_behind_s": round(behind, 3), "short_behind_over_long_alone": round(behind / long_alone, 2),
            "last_long_s": round(long_loaded, 2)}


def pinned_cell(open_stream: Opener, prompt: Prompts) -> dict:
    """An unpinned request beside requests pinned to a busy slot."""
    alone = first_token(open_stream, prompt(SHORT_TOKENS))
    started = threading.Event()
    stop = threading.Event()

    def blocker() -> None:
        follow(open_stream(prompt(SHORT_TOKENS), 3000, 0), started.set, stop)

    def pinned() -> str:
        try:
            first_token(open_stream, prompt(SHORT_TOKENS), 0)
            return "ok"
        except Refused:
            return "429"

    b = threading.Thread(target=blocker, daemon=True)
    b.start()
    started.wait(60)
    with ThreadPoolExecutor(PER_SLOT + 4) as pool:
        futs = [pool.submit(pinned) for _ in range(PER_SLOT + 4)]
        time.sleep(0.5)
        try:
            beside = first_token(open_stream, prompt(SHORT_TOKENS))
            status = "ok"
        except Refused:
            beside, status = float("nan"), "429"
        stop.set()  # the blocker ends: the pinned ones get slot 0 in turn
        answers = [f.result() for f in futs]
    b.join(60)
    return {"unpinned_alone_s": round(alone, 3), "unpinned_beside_s": round(beside, 3), "unpinned": status,
            "pinned_refused": answers.count("429"), "pinned_sent": len(answers)}


def _recording(learn: Callable[..., None], steps: list[tuple[int, float]]) -> Callable[..., None]:
    """The budget's ``observe``, also recording (prompt tokens, seconds) of each step with rows."""

    def observe(n_rows: int, n_prompt: int, seconds: float, group: int = 0) -> None:
        if n_rows:
            steps.append((n_prompt, seconds))
        learn(n_rows, n_prompt, seconds, group)

    return observe


def cost_cell(prompt: Prompts, knobs: dict) -> list[dict]:
    """What a prompt token costs a step, by chunk size (``COST_SIZES``): one group of the split,
    in this process, with its own RPC server (bench/run.py's)."""
    from bench.run import RpcServer

    server = RpcServer(COST_RPC)
    rows = []
    try:
        for k in COST_SIZES:
            rows.append(chunk_cost(server.endpoint, prompt, knobs, k))
            print(json.dumps({"cost": rows[-1]}), flush=True)
    finally:
        server.close()
    return rows


def chunk_cost(endpoint: str, prompt: Prompts, knobs: dict, k: int) -> dict:
    """Two streams decoding, then a prompt of ``COST_PROMPT`` tokens given ``k`` tokens a step:
    the median step with a chunk against the median step without."""
    from engine import Engine, EngineConfig
    from engine.params import SamplingParams

    e = Engine(EngineConfig(**{
        "model": str(CHAT_MODEL), "n_parallel": 3, "n_ctx": 3 * N_CTX_SLOT, "pipeline_groups": 1, "n_threads": 1,
        "rpc_endpoints": [endpoint], "peer_layers": N_PEER,
        **knobs, "prefill_gap_factor": 1.0, "prefill_min_rate": 0.0, "prefill_chunk_min": k}))
    try:
        steps: list[tuple[int, float]] = []
        e.prefill.observe = _recording(e.prefill.observe, steps)  # type: ignore[method-assign]
        stop = threading.Event()
        streams = [threading.Thread(target=follow, daemon=True, args=(
            e.stream(prompt(8), SamplingParams(max_tokens=N_CTX_SLOT - 16, temperature=0, ignore_eos=True)),
            lambda: None, stop)) for _ in range(2)]
        for t in streams:
            t.start()
        deadline = time.monotonic() + 120
        while len(steps) < 8:  # both streams decoding
            if time.monotonic() > deadline:
                raise RuntimeError("the cost cell's streams did not start")
            time.sleep(0.05)
        t0 = time.perf_counter()
        for _ in e.stream(prompt(COST_PROMPT), SamplingParams(max_tokens=1, temperature=0)):
            pass
        took = time.perf_counter() - t0
        stop.set()
        for t in streams:
            t.join(60)
    finally:
        e.close()
    chunk = statistics.median(s for n, s in steps if n)
    plain = statistics.median(s for n, s in steps if not n)
    return {"chunk": k, "chunk_step_ms": round(chunk * 1e3, 1), "decode_step_ms": round(plain * 1e3, 1),
            "ms_per_token": round((chunk - plain) / k * 1e3, 2), "prompt_s": round(took, 2)}


def http_opener(base: str) -> Opener:
    """llama-server's ``/completion``, streamed: one yield per event with its token count."""
    client = httpx.Client(base_url=base, timeout=900, limits=httpx.Limits(max_connections=64))

    def open_stream(prompt: list[int], n: int, id_slot: int) -> Iterator[int]:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "stream": True,
                "cache_prompt": False, "id_slot": id_slot, "return_tokens": True}
        with client.stream("POST", "/completion", json=body) as r:
            if r.status_code == 429:
                raise Refused(f"HTTP {r.status_code}")
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    d = json.loads(line[6:])
                    if "error" in d:
                        raise RuntimeError(d["error"])
                    yield len(d.get("tokens") or ()) or (1 if d.get("content") else 0)
                    if d.get("stop"):
                        return

    return open_stream


class Stack:
    """The local two-node cluster with Serve, started once for the engine's arms."""

    def __init__(self) -> None:
        from bench.stack import HttpStack

        self.http = HttpStack()

    def arm(self, **knobs: object) -> tuple[Opener, Callable[[], None]]:
        self.http.deploy(demo_args(RPC_PORT, **{"n_parallel": SLOTS, "n_ctx": SLOTS * N_CTX_SLOT,
                                                "peer_layers": N_PEER, "max_queued_per_slot": PER_SLOT, **knobs}))
        return http_opener(self.http.base), lambda: None

    def close(self) -> None:
        self.http.close()


def llama_server_arm() -> tuple[Opener, Callable[[], None]]:
    from bench.llama_server import LlamaServer

    ls = LlamaServer(CHAT_MODEL, n_layer=N_LAYER, n_peer=N_PEER, output_local=True, slots=SLOTS,
                     n_ctx=SLOTS * N_CTX_SLOT, port=LS_PORT, rpc_port=LS_RPC)
    return http_opener(ls.base), ls.close


# arm -> (how it starts, the cells it runs)
ALL, LONG = ("long", "short", "pinned"), ("long",)
FIXED = {"prefill_gap_factor": 1.0, "prefill_min_rate": 0.0}  # the chunk is prefill_chunk_min
ENGINE_ARMS: dict[str, tuple[dict, tuple[str, ...]]] = {  # arm -> (knobs, cells)
    "defaults (gap 3, rate 0.7)": ({}, ALL),
    "rate 0 (the gap bound alone)": ({"prefill_min_rate": 0.0}, LONG),
    "rate 0.5": ({"prefill_min_rate": 0.5}, LONG),
    "rate 0.85": ({"prefill_min_rate": 0.85}, LONG),
    "whole batches (gap null)": ({"prefill_gap_factor": None}, LONG),
    "chunk 16 (fixed)": ({**FIXED, "prefill_chunk_min": 16}, LONG),
    "chunk 32 (fixed)": ({**FIXED, "prefill_chunk_min": 32}, LONG),
    "chunk 64 (fixed)": ({**FIXED, "prefill_chunk_min": 64}, LONG),
    "chunk 128 (fixed)": ({**FIXED, "prefill_chunk_min": 128}, LONG),
}
LLAMA_SERVER = "llama-server"
ARMS = [*ENGINE_ARMS, LLAMA_SERVER]
DEFAULT_ARMS = ["defaults (gap 3, rate 0.7)", "chunk 16 (fixed)", "chunk 64 (fixed)", "whole batches (gap null)", LLAMA_SERVER]


def tables(rows: list[dict], cost: list[dict] | None = None) -> str:
    """The markdown tables of the cells that ran."""
    sections = []
    if cost:
        sections.append(["| prompt chunk a step (2 streams beside) | step with it | step without | a prompt token adds "
                         f"| {COST_PROMPT}-token prompt |", "|---|---|---|---|---|"]
                        + [f"| {c['chunk']} | {c['chunk_step_ms']} ms | {c['decode_step_ms']} ms | "
                           f"{c['ms_per_token']} ms | {c['prompt_s']} s |" for c in cost])
    longs = [f"| {r['arm']} | {r['prefill_loaded_s']} / {r['prefill_alone_s']} s (**{r['prefill_ratio']}x**) | "
             f"{r['steady_median_ms']} / {r['steady_p99_ms']} ms | {r['during_median_ms']} / {r['during_p99_ms']} / "
             f"{r['during_max_ms']} ms | **{r['during_max_ms'] / max(r['steady_p99_ms'], 1e-9):.2f}x** |"
             for r in rows if "prefill_ratio" in r]
    if longs:
        sections.append(["| arm | long prompt loaded / alone | streams steady median / p99 | during its prefill "
                         "median / p99 / longest | longest / steady p99 |", "|---|---|---|---|---|", *longs])
    shorts = [f"| {r['arm']} | {r['short_behind_s']} / {r['short_alone_s']} s | {r['long_alone_s']} s | "
              f"**{r['short_behind_over_long_alone']}x** | {r['last_long_s']} s |" for r in rows if "short_behind_s" in r]
    if shorts:
        sections.append([f"| arm | short request behind {N_LONG} x {LONG_TOKENS} tokens / alone | one {LONG_TOKENS}-"
                         "token prompt alone | short behind / that | the last long one's first token |",
                         "|---|---|---|---|---|", *shorts])
    pinned = [f"| {r['arm']} | {r['unpinned']}, {r['unpinned_beside_s']} / {r['unpinned_alone_s']} s | "
              f"{r['pinned_refused']} of {r['pinned_sent']} |" for r in rows if "unpinned" in r]
    if pinned:
        sections.append([f"| arm | unpinned beside {PER_SLOT + 4} pinned to a busy slot / alone | pinned refused "
                         "(429) |", "|---|---|---|", *pinned])
    return "\n\n".join("\n".join(t) for t in sections)


def run_arm(name: str, open_stream: Opener, cells: set[str], arm_cells: tuple[str, ...], a: argparse.Namespace) -> dict:
    prompt = Prompts()  # the same prompts for every arm
    row: dict = {"arm": name, "prompt": a.prompt}
    first_token(open_stream, prompt(64))  # warm-up
    if "long" in cells and "long" in arm_cells:
        row |= long_cell(open_stream, prompt, a.prompt, a.steady)
    if "short" in cells and "short" in arm_cells:
        row |= short_cell(open_stream, prompt)
    if "pinned" in cells and "pinned" in arm_cells:
        row |= pinned_cell(open_stream, prompt)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=3000, help="tokens of the long prompt")
    ap.add_argument("--steady", type=float, default=10.0, help="seconds of steady decoding measured first")
    ap.add_argument("--arms", default=";".join(DEFAULT_ARMS), help=f"arm names, separated by semicolons, of {ARMS}")
    ap.add_argument("--cells", default=",".join(("cost", *ALL)), help="cells to run, of cost,long,short,pinned")
    ap.add_argument("--cost-knobs", default="{}", help="engine settings (JSON) for the cost cell")
    a = ap.parse_args(argv)
    cells, names = set(a.cells.split(",")), a.arms.split(";")
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; known: {ARMS}")
    rows = []
    cost = cost_cell(Prompts(), json.loads(a.cost_knobs)) if "cost" in cells else None
    engine_names = [n for n in names if n in ENGINE_ARMS and cells & set(ENGINE_ARMS[n][1])]
    if engine_names:
        stack = Stack()
        try:
            for name in engine_names:
                knobs, arm_cells = ENGINE_ARMS[name]
                open_stream, _ = stack.arm(**knobs)
                rows.append(run_arm(name, open_stream, cells, arm_cells, a))
        finally:
            stack.close()
    if LLAMA_SERVER in names and cells & set(ALL):
        try:
            open_stream, close = llama_server_arm()
        except FileNotFoundError as e:  # llama-server not built
            print(f"{LLAMA_SERVER}: skipped ({e})", flush=True)
        else:
            try:
                rows.append(run_arm(LLAMA_SERVER, open_stream, cells, ALL, a))
            finally:
                close()
    table = tables(rows, cost)
    print(table)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = "long_prompt" if rows else "chunk_cost"  # the cost cell alone (e.g. other --cost-knobs) apart
    (out / f"{name}.md").write_text(table + "\n")
    (out / f"{name}.json").write_text(json.dumps({"cost_knobs": json.loads(a.cost_knobs), "cost": cost,
                                                  "arms": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
