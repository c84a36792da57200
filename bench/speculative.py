"""Where speculative decoding pays: the real model (Gemma 3 270M) split over a ggml RPC stage
on loopback (9 layers on the peer), 32 slots in 2 pipeline groups, a repetitive task (rewrite
a given block of code with one change, greedy), at 1, 8 and 32 clients, and a free-text task
(a short story, sampled at temperature 0.8) at 1 and 32. Arms: no
speculation; n-gram drafts and the model as its own draft (which only measures the
mechanism's cost: every draft is accepted), both drafting at every load (``max_rows`` 32);
and n-gram with the default ``max_rows``, which stops drafting above that many rows.
Reports generated tokens/s and the acceptance rate per cell.

A second table drafts with MTP, on a synthetic model with an MTP layer over the same split
(``MTP_SHAPE``), against no speculation, n-gram and the model as its own draft, at 1 and 8
clients (``--only mtp`` runs it alone).

    python -m bench.speculative            (make bench-spec)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable

from bench.clients import LoadResult, run_engine
from bench.stack import ROOT
from deployments.stage import server as rpc_server
from engine import Engine, EngineConfig
from engine.config import SpeculativeConfig
from engine.models import GEMMA_MODEL
from tests.models.synthetic import ModelShape, write_mtp_model

PORT = 50191
N_GEN = 128
LOADS = {1: 3, 8: 16, 32: 32}  # clients: requests
DEFAULT_MAX_ROWS = SpeculativeConfig.model_fields["max_rows"].default
ARMS = {
    "off": None,
    "ngram, always": {"type": "ngram", "max_rows": 32},
    "self-draft, always": {"type": "draft", "model": str(GEMMA_MODEL), "max_rows": 32, "draft_threads": 1},
    f"ngram, max_rows {DEFAULT_MAX_ROWS}": {"type": "ngram"},
}


def task(i: int) -> str:
    rng = random.Random(i)
    names = rng.sample(["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "zeta", "lambda_"], 6)
    code = "\n".join(f"def {n}(x, y):\n    return x * {rng.randint(2, 9)} + y - {rng.randint(1, 99)}\n" for n in names)
    return (f"Rewrite this Python code with the function {names[2]} renamed to {names[2]}_v2. Change nothing "
            f"else and output only the code.\n\n{code}")


def story(i: int) -> str:
    rng = random.Random(i)
    who = rng.choice(["a lighthouse keeper", "a retired pilot", "a young baker", "an old cartographer", "a street musician"])
    where = rng.choice(["a mountain village", "a harbour town", "a desert city", "an island", "a river delta"])
    return f"Write a short, original story about {who} in {where}. Use vivid, varied language."


TASKS = {"rewrite": task, "story": story}

# The MTP table: a synthetic hy_v3 model with one MTP layer (no MTP GGUF is on the registries),
# 6 trunk layers (3 on the peer), 8 slots in 2 groups. Its head agrees with the model by
# construction ("agree": every draft accepted: the mechanism's gain at its best) or in part
# ("partial": the MTP layer's weights perturbed); greedy, so every arm gives the same text.
MTP_SHAPE = ModelShape(n_layer=6, n_embd=512, n_head=8, n_head_kv=4, n_ff=1536, n_vocab=8192, n_ctx_train=8192,
                       seed=5)
MTP_MODELS = {"agree": {"head": "agree"}, "partial": {"head": "agree", "noise": 0.25}}


MTP_ARMS = {  # arm: (model, speculative); the self-draft's model is the target itself
    "off": ("agree", None),
    "ngram": ("agree", {"type": "ngram", "max_rows": 8}),
    "self-draft": ("agree", {"type": "draft", "max_rows": 8, "draft_threads": 1}),
    "mtp": ("agree", {"type": "mtp", "n_max": 4, "max_rows": 8, "p_min": 0.0}),
    "mtp, partial head": ("partial", {"type": "mtp", "n_max": 4, "max_rows": 8, "p_min": 0.0}),
}
# the free-text task: little to copy from the prompt, so most drafts are rejected
STORY_ARMS = ("off", "ngram, always", f"ngram, max_rows {DEFAULT_MAX_ROWS}")


def run(e: Engine, prompts: list[str], clients: int, sampled: bool = False) -> LoadResult:
    # the free-text task is sampled (greedy text from a small model loops, and loops are easy
    # to draft): most of its drafts are rejected
    return run_engine(e, prompts, clients, N_GEN, lambda i: {"seed": 7} if sampled else {"temperature": 0.0})


def measure(arms: dict, make: Callable[[object], Engine], prompt: Callable[[Engine, str, int], str],
            loads: list[int], repeats: int, story_arms: tuple[str, ...] = ()) -> list[dict]:
    """Every arm's cells: the rewrite task at each load (and the story task at the first and
    last load for ``story_arms``), tokens/s and acceptance, the median of ``repeats``."""
    rows = []
    for arm, spec in arms.items():
        e = make(spec)
        try:
            run(e, [prompt(e, "rewrite", 10_000)], 1)  # warm-up
            cases = [("rewrite", c) for c in loads]
            if arm in story_arms:
                cases += [("story", c) for c in (loads[0], loads[-1])]
            for kind, clients in cases:
                n_req = LOADS.get(clients, clients)
                prompts = [prompt(e, kind, i) for i in range(n_req)]
                figs = []
                for _ in range(repeats):
                    p0 = e.profiles()
                    res = run(e, prompts, clients, sampled=kind == "story")
                    d = [b.minus(x) for x, b in zip(p0, e.profiles(), strict=True)]
                    drafted, accepted = sum(x.drafted for x in d), sum(x.accepted for x in d)
                    ok = sum(t.ok for t in res.timings)
                    figs.append((sum(t.n_tokens for t in res.timings) / res.wall_s,
                                 accepted / drafted if drafted else 0.0, ok))
                row = {"task": kind, "arm": arm, "clients": clients,
                       "tok_s": round(statistics.median(f[0] for f in figs), 1),
                       "acceptance": round(statistics.median(f[1] for f in figs), 2),
                       "ok": min(f[2] for f in figs), "requests": n_req}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            e.close()
    return rows


def table(arms: dict, rows: list[dict]) -> str:
    base = {(r["task"], r["clients"]): r["tok_s"] for r in rows if r["arm"] == "off"}
    cols = sorted({(r["task"], r["clients"]) for r in rows}, key=lambda k: (k[0] != "rewrite", k))
    lines = ["| arm | " + " | ".join(f"{t}, {c} clients" for t, c in cols) + " |", "|---|" + "---|" * len(cols)]
    for arm in arms:
        cells = []
        for col in cols:
            r = next((r for r in rows if r["arm"] == arm and (r["task"], r["clients"]) == col), None)
            if r is None:
                cells.append("")
            elif arm == "off":
                cells.append(f"{r['tok_s']:.1f} tok/s")
            else:
                cells.append(f"{r['tok_s']:.1f} ({r['tok_s'] / base[col]:.2f}x, {r['acceptance']:.0%} accepted)")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mtp_models() -> dict[str, str]:
    """The synthetic MTP models of the MTP table (written once into models/)."""
    out = {}
    for name, kw in MTP_MODELS.items():
        path = ROOT / "models" / f"synthetic-mtp-{name}.gguf"
        if not path.exists():
            write_mtp_model(path, MTP_SHAPE, **kw)
        out[name] = str(path)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--loads", default=",".join(map(str, LOADS)))
    ap.add_argument("--only", choices=["gemma", "mtp"], default=None, help="one of the two tables")
    a = ap.parse_args(argv)
    loads = [int(x) for x in a.loads.split(",")]
    server = rpc_server.launch("127.0.0.1", PORT, threads=1)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    all_rows = []
    try:
        if a.only in (None, "gemma"):
            def gemma(spec: dict | None) -> Engine:
                return Engine(EngineConfig(model=str(GEMMA_MODEL), rpc_endpoints=[f"127.0.0.1:{PORT}"], peer_layers=9,
                                           n_parallel=32, pipeline_groups=2, n_ctx=32 * 512, n_threads=1,
                                           chat_template="gemma", cache_prompt=False, speculative=spec))

            def chat(e: Engine, kind: str, i: int) -> str:
                return e.tokenizer.apply_chat_template([{"role": "user", "content": TASKS[kind](i)}])

            rows = measure(ARMS, gemma, chat, loads, a.repeats, STORY_ARMS)
            text = table(ARMS, rows)
            print(text)
            (out / "speculative.md").write_text(text + "\n")
            (out / "speculative.json").write_text(json.dumps(rows, indent=1) + "\n")
            all_rows += rows
        if a.only in (None, "mtp"):
            models = mtp_models()

            def synthetic(arm: tuple[str, dict | None]) -> Engine:
                model, spec = models[arm[0]], arm[1]
                if spec is not None and spec["type"] == "draft":
                    spec = {**spec, "model": model}
                return Engine(EngineConfig(model=model, rpc_endpoints=[f"127.0.0.1:{PORT}"], peer_layers=3,
                                           n_parallel=8, pipeline_groups=2, n_ctx=8 * 1024, n_threads=1,
                                           cache_prompt=False, speculative=spec))

            def raw(e: Engine, kind: str, i: int) -> str:
                return TASKS[kind](i)

            rows = measure(MTP_ARMS, synthetic, raw, [c for c in loads if c <= 8], a.repeats)
            text = table(MTP_ARMS, rows)
            print(text)
            (out / "speculative-mtp.md").write_text(text + "\n")
            (out / "speculative-mtp.json").write_text(json.dumps(rows, indent=1) + "\n")
            all_rows += rows
    finally:
        server.kill()
        server.wait()
    return 0 if all(r["ok"] == r["requests"] for r in all_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
