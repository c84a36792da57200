"""llama-server as the oracle of greedy text: the same prompts, one at a time, prompt caching
off, on llama-server (several slot counts) and on this engine (several settings), and how many
answers equal llama-server's; finds the setting where the two differ.

    LLAMA_SERVER_BIN=<make llama-server's folder> .venv/bin/python -m bench.oracle

Both sides run the one model on the local CPU (no split: the split gives the tokens of the
unsplit model, tests/real/test_real_model.py), flash attention on, the same threads."""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import httpx

from bench.llama_server import _wait, bin_dir
from engine import Engine, EngineConfig, SamplingParams
from engine.models import GEMMA_MODEL, ensure_gemma_model

PROMPTS = [
    "The capital of France is", "Here is a short poem about the sea:", "def fibonacci(n):",
    "Water boils at a temperature of", "The three primary colors are", "Once upon a time, in a small village,",
    "The most important invention of the 20th century", "import numpy as np\n\n",
]


def llama_server(slots: int, n_ctx: int, threads: int, n_gen: int, port: int, extra: list[str]) -> list[str]:
    cmd = [str(bin_dir() / "llama-server"), "-m", str(GEMMA_MODEL), "-np", str(slots), "-c", str(n_ctx),
           "-t", str(threads), "-fa", "on", "--cache-ram", "0", "--host", "127.0.0.1", "--port", str(port),
           "--no-webui", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(base + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait(healthy, proc, "llama-server")
        out = []
        for p in PROMPTS:
            r = httpx.post(base + "/completion", json={"prompt": p, "n_predict": n_gen, "temperature": 0, "top_k": 1,
                                                        "cache_prompt": False, "ignore_eos": True}, timeout=600)
            out.append(r.json()["content"])
        return out
    finally:
        proc.terminate()
        proc.wait(30)


def engine(slots: int, n_ctx: int, threads: int, n_gen: int, **cfg: object) -> list[str]:
    cfg = {"n_parallel": slots, "n_ctx": n_ctx, "n_threads": threads, **cfg}
    if cfg["n_parallel"] != slots:  # fewer slots: the same context per slot
        cfg["n_ctx"] = n_ctx // slots * cfg["n_parallel"]
    e = Engine(EngineConfig(model=str(GEMMA_MODEL), cache_prompt=False, **{"flash_attn": True, **cfg}))
    try:
        params = SamplingParams(temperature=0, max_tokens=n_gen, ignore_eos=True)
        return [e.generate(p, params).text for p in PROMPTS]
    finally:
        e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--n-gen", type=int, default=48)
    ap.add_argument("--port", type=int, default=8391)
    a = ap.parse_args()
    ensure_gemma_model()
    t0 = time.monotonic()
    ref = llama_server(a.slots, a.n_ctx, a.threads, a.n_gen, a.port, [])
    print(f"{len(PROMPTS)} prompts, {a.n_gen} greedy tokens each, one at a time; {a.slots} slots, {a.n_ctx} cells, "
          f"flash attention on, {a.threads} threads")

    def report(name: str, got: list[str]) -> None:
        same = sum(g == r for g, r in zip(got, ref, strict=True))
        print(f"{name:<64} {same}/{len(PROMPTS)} equal llama-server's ({time.monotonic() - t0:.0f} s)")

    report(f"llama-server, {a.slots * 2} slots", llama_server(a.slots * 2, a.n_ctx * 2, a.threads, a.n_gen, a.port, []))
    report("llama-server, 1 slot", llama_server(1, a.n_ctx // a.slots, a.threads, a.n_gen, a.port, []))
    for flag in ("--kv-unified", "--no-kv-unified", "--no-repack", "-t 1", "-fa off"):
        try:
            report(f"llama-server, {flag}", llama_server(a.slots, a.n_ctx, a.threads, a.n_gen, a.port, flag.split()))
        except RuntimeError as e:  # a flag this llama-server does not take
            print(f"llama-server, {flag}: {e}")
    for name, cfg in [
        ("engine: defaults (kv_unified false, n_batch 512)", {}),
        ("engine: kv_unified true", {"kv_unified": True}),
        ("engine: kv_unified true, n_batch 2048", {"kv_unified": True, "n_batch": 2048}),
        ("engine: n_batch 2048", {"n_batch": 2048}),
        ("engine: kv_unified true, swa_full true", {"kv_unified": True, "swa_full": True}),
        ("engine: repack false", {"repack": False}),
        ("engine: flash attention off", {"flash_attn": False}),
        ("engine: one slot", {"n_parallel": 1}),
        ("engine: n_ubatch 2048, n_batch 2048", {"n_batch": 2048, "n_ubatch": 2048}),
    ]:
        report(name, engine(a.slots, a.n_ctx, a.threads, a.n_gen, **cfg))


if __name__ == "__main__":
    main()
