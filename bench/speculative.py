"""Where speculative decoding pays: the real model (Gemma 3 270M) split over a ggml RPC stage
on loopback (9 layers on the peer), 32 slots in 2 pipeline groups, a repetitive task (rewrite
a given block of code with one change, greedy), at 1, 8 and 32 clients, and a free-text task
(a short story, sampled at temperature 0.8) at 1 and 32. Arms: no
speculation; n-gram drafts and the model as its own draft (which only measures the
mechanism's cost: every draft is accepted), both drafting at every load (``max_rows`` 32);
and n-gram with the default ``max_rows``, which stops drafting above that many rows.
Reports generated tokens/s and the acceptance rate per cell.

    python -m bench.speculative            (make bench-spec)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

from bench.clients import LoadResult, run_engine
from bench.run import ROOT
from deployments.stage import server as rpc_server
from engine import Engine, EngineConfig
from engine.config import SpeculativeConfig
from engine.models import GEMMA_MODEL

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
# the free-text task: little to copy from the prompt, so most drafts are rejected
STORY_ARMS = ("off", "ngram, always", f"ngram, max_rows {DEFAULT_MAX_ROWS}")


def run(e: Engine, prompts: list[str], clients: int, sampled: bool = False) -> LoadResult:
    # the free-text task is sampled (greedy text from a small model loops, and loops are easy
    # to draft): most of its drafts are rejected
    return run_engine(e, prompts, clients, N_GEN, lambda i: {"seed": 7} if sampled else {"temperature": 0.0})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--loads", default=",".join(map(str, LOADS)))
    a = ap.parse_args(argv)
    loads = [int(x) for x in a.loads.split(",")]
    server = rpc_server.launch("127.0.0.1", PORT, threads=1)
    rows = []
    try:
        for arm, spec in ARMS.items():
            e = Engine(EngineConfig(model=str(GEMMA_MODEL), rpc_endpoints=[f"127.0.0.1:{PORT}"], peer_layers=9,
                                    n_parallel=32, pipeline_groups=2, n_ctx=32 * 512, n_threads=1,
                                    chat_template="gemma", cache_prompt=False, speculative=spec))
            try:
                tmpl = e.tokenizer.apply_chat_template
                run(e, [tmpl([{"role": "user", "content": task(10_000)}])], 1)  # warm-up
                cases = [("rewrite", c) for c in loads]
                if arm in STORY_ARMS:
                    cases += [("story", c) for c in (loads[0], loads[-1])]
                for kind, clients in cases:
                    n_req = LOADS.get(clients, clients)
                    prompts = [tmpl([{"role": "user", "content": TASKS[kind](i)}]) for i in range(n_req)]
                    figs = []
                    for _ in range(a.repeats):
                        p0 = e.profiles()
                        res = run(e, prompts, clients, sampled=kind == "story")
                        d = [b.minus(x) for x, b in zip(p0, e.profiles(), strict=True)]
                        drafted, accepted = sum(x.drafted for x in d), sum(x.accepted for x in d)
                        ok = sum(t.ok for t in res.timings)
                        figs.append((sum(t.n_tokens for t in res.timings) / res.wall_s,
                                     accepted / drafted if drafted else 0.0, ok))
                    tok_s = statistics.median(f[0] for f in figs)
                    row = {"task": kind, "arm": arm, "clients": clients, "tok_s": round(tok_s, 1),
                           "acceptance": round(statistics.median(f[1] for f in figs), 2),
                           "ok": min(f[2] for f in figs), "requests": n_req}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                e.close()
    finally:
        server.kill()
        server.wait()
    base = {(r["task"], r["clients"]): r["tok_s"] for r in rows if r["arm"] == "off"}
    cols = sorted({(r["task"], r["clients"]) for r in rows}, key=lambda k: (k[0] != "rewrite", k))
    lines = ["| arm | " + " | ".join(f"{t}, {c} clients" for t, c in cols) + " |", "|---|" + "---|" * len(cols)]
    for arm in ARMS:
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
    table = "\n".join(lines)
    print(table)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.md").write_text(table + "\n")
    (out / "speculative.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["ok"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
