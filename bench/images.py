"""Images beside text streams, against llama-server ``--mmproj`` on the same split, in one run.

Both serve the synthetic model with its projector (``make model-synthetic``: a llava-style
projector, 16 rows an image) split over an RPC stage on this machine (2 of its 4 layers on the
peer, the rest and the output layer local), 4 slots, one thread a stage, prompt caching off; this
project as ``make serve CONFIG=deployments/configs/local-vision.yaml`` serves it (two pipeline
groups, direct ingress), llama-server with rpc-server built from the same llama.cpp
(``LLAMA_SERVER_BIN``). Each arm, on a fresh server:

- ``equal``: every image prompt alone, greedy, through the chat API: how many answers equal
  llama-server's (the same request one at a time);
- ``alone``: an image request's time to its first token with nothing else running (median);
- ``big``: six of the largest images this server admits (8192 x 4096 PNGs of one colour, 106 KB
  each) at once, and meanwhile a short text chat every 0.1 s: the images' answers (the last one's
  seconds) and the text chats' latency beside them against alone (median);
- ``mixed``: 2 text streams decode (``/completion``, end of generation ignored); after
  ``--steady`` seconds an image request arrives every ``--every`` seconds, each a new image,
  ``--images`` of them: their first token (median, longest) and the streams' gaps between tokens
  before (steady) and while the images are in (median, p99, longest).

Prints one JSON line per arm and a table; writes bench/results/images.{json,md}. The engine's
arm starts Ray (``ray stop`` first and after: every Ray process of this user on the machine).

    LLAMA_SERVER_BIN=<make llama-server's folder> python -m bench.images [--images 12]  (make bench-images)
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from bench.stack import ROOT
from tests.images import png, png_solid
from tests.models import SYNTHETIC_MMPROJ, ensure_synthetic_model

LS_PORT, LS_RPC, RPC_PORT = 50184, 50185, 50186
SLOTS, N_CTX_SLOT, N_LAYER, N_PEER = 4, 2048, 4, 2
N_STREAMS = 2
GREEDY = {"temperature": 0, "top_k": 1}
ASK = "what is in this image?"
OUT = ROOT / "bench" / "results"


def image_body(img: bytes, max_tokens: int, stream: bool) -> dict:
    url = "data:image/png;base64," + base64.b64encode(img).decode()
    return {"model": "m", "max_tokens": max_tokens, "stream": stream, "cache_prompt": False, **GREEDY,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": ASK}]}]}


def answer(client: httpx.Client, img: bytes) -> str:
    r = client.post("/v1/chat/completions", json=image_body(img, 12, False))
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def first_token(client: httpx.Client, img: bytes) -> float:
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=image_body(img, 4, True)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def stream_text(client: httpx.Client, stop: threading.Event, arrivals: list[float]) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 100_000, "ignore_eos": True, "stream": True,
            "cache_prompt": False, **GREEDY}
    with client.stream("POST", "/completion", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.perf_counter())
                if stop.is_set():
                    return


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def gaps_ms(arrivals: list[list[float]], t0: float, t1: float) -> list[float]:
    return [1000 * (b - a) for ts in arrivals for a, b in zip(ts, ts[1:], strict=False) if t0 <= a and b <= t1]


def text_chat(client: httpx.Client) -> float:
    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]})
    r.raise_for_status()
    return time.perf_counter() - t0


def big_cell(client: httpx.Client) -> dict:
    alone = statistics.median(text_chat(client) for _ in range(5))
    bigs = [png_solid(8192, 4096, (k * 40, 60, 90)) for k in range(6)]
    with ThreadPoolExecutor(6) as ex:
        t0 = time.perf_counter()
        futs = [ex.submit(answer, client, img) for img in bigs]
        beside = []
        while not all(f.done() for f in futs):
            beside.append(text_chat(client))
            time.sleep(0.1)
        for f in futs:
            f.result()
        last = time.perf_counter() - t0
    return {"big_images_last_s": round(last, 2), "text_alone_median_s": round(alone, 4),
            "text_beside_big_median_s": round(statistics.median(beside), 4) if beside else 0.0}


def run_arm(base: str, images: list[bytes], a: argparse.Namespace) -> dict:
    client = httpx.Client(base_url=base, timeout=600, limits=httpx.Limits(max_connections=32))
    texts = [answer(client, img) for img in images[:4]]
    alone = statistics.median(first_token(client, img) for img in images[4:8])
    big = big_cell(client)
    stop = threading.Event()
    arrivals: list[list[float]] = [[] for _ in range(N_STREAMS)]
    with ThreadPoolExecutor(N_STREAMS + a.images) as ex:
        streams = [ex.submit(stream_text, client, stop, arrivals[i]) for i in range(N_STREAMS)]
        time.sleep(a.steady)
        t_in = time.perf_counter()
        firsts = []
        pending = []
        for k in range(a.images):
            pending.append(ex.submit(first_token, client, images[8 + k]))
            time.sleep(a.every)
        firsts = [f.result() for f in pending]
        t_out = time.perf_counter()
        stop.set()
        for f in streams:
            f.result()
    steady, busy = gaps_ms(arrivals, t_in - a.steady, t_in), gaps_ms(arrivals, t_in, t_out)
    return {"texts": texts, "image_ttft_alone_s": round(alone, 4),
            "image_ttft_mixed_median_s": round(statistics.median(firsts), 4), "image_ttft_mixed_max_s": round(max(firsts), 4),
            "gap_steady_median_ms": round(statistics.median(steady), 2), "gap_steady_p99_ms": round(pct(steady, 0.99), 2),
            "gap_images_median_ms": round(statistics.median(busy), 2), "gap_images_p99_ms": round(pct(busy, 0.99), 2),
            "gap_images_max_ms": round(max(busy), 2), **big}


def engine_arm(groups: int) -> Callable[[list[bytes], argparse.Namespace], dict]:
    def arm(images: list[bytes], a: argparse.Namespace) -> dict:
        from bench.stack import HttpStack

        stack = HttpStack()
        try:
            stack.deploy({"model": str(ensure_synthetic_model()), "mmproj": str(SYNTHETIC_MMPROJ),
                          "topology": "layer_split", "n_parallel": SLOTS, "n_ctx": SLOTS * N_CTX_SLOT,
                          "pipeline_groups": groups, "n_threads": 1, "peer_layers": N_PEER, "cache_prompt": False,
                          "rpc": {"port": RPC_PORT, "threads": 1}})
            return run_arm(stack.base, images, a)
        finally:
            stack.close()
    return arm


def llama_server_arm(images: list[bytes], a: argparse.Namespace) -> dict:
    from bench.llama_server import LlamaServer

    ls = LlamaServer(ensure_synthetic_model(), n_layer=N_LAYER, n_peer=N_PEER, output_local=True, slots=SLOTS,
                     n_ctx=SLOTS * N_CTX_SLOT, port=LS_PORT, rpc_port=LS_RPC, extra=["--mmproj", str(SYNTHETIC_MMPROJ)])
    try:
        return run_arm(ls.base, images, a)
    finally:
        ls.close()


LLAMA_SERVER = "llama-server --mmproj"
ARMS: dict[str, Callable[[list[bytes], argparse.Namespace], dict]] = {
    "pipeline-groups (2 groups)": engine_arm(2), "pipeline-groups (1 group)": engine_arm(1),
    LLAMA_SERVER: llama_server_arm}


def table(rows: dict[str, dict]) -> str:
    keys = [k for k in next(iter(rows.values())) if k != "texts"]
    out = ["| figure | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
    out += [f"| {k} | " + " | ".join(str(r[k]) for r in rows.values()) + " |" for k in keys]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=12, help="image requests beside the streams")
    ap.add_argument("--every", type=float, default=0.25, help="seconds between them")
    ap.add_argument("--steady", type=float, default=3.0, help="seconds of streams alone first")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    images = [png(24 + 7 * k, 40 - k, 100 + k) for k in range(8 + a.images)]
    rows = {}
    for name, arm in ARMS.items():
        rows[name] = arm(images, a)
        print(json.dumps({"arm": name, **rows[name]}), flush=True)
    ref = rows[LLAMA_SERVER]["texts"]
    for r in rows.values():
        r["equal_to_llama_server"] = f"{sum(x == y for x, y in zip(r['texts'], ref, strict=True))}/{len(ref)}"
    md = table(rows)
    print(md)
    from pathlib import Path

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "images.json").write_text(json.dumps({"arms": rows}, indent=1))
    (out / "images.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
