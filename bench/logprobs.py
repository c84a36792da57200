"""What log probabilities cost: the engine (no Ray, no HTTP) on a synthetic model with a
32,000-token vocabulary, 16 slots in 2 groups, 32 requests of 32 tokens, where no request,
every other request or every request asks for ``logprobs`` with 5 alternatives. Each arm
runs ``--repeats`` times, interleaved; the host's sampling phase per sampled row comes from
the groups' profiler. Rows that do not ask pay one attribute check: the "half" arm's sampling
time should sit halfway between "none" and "all".

    python -m bench.logprobs
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench.clients import make_prompts, run_engine
from bench.stack import ROOT
from engine import Engine, EngineConfig
from tests.models.synthetic import ModelShape, write_model

SHAPE = ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=32000, seed=11)
ARMS = {"none": lambda i: {}, "half": lambda i: {"logprobs": 5} if i % 2 == 0 else {}, "all": lambda i: {"logprobs": 5}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args(argv)
    model = ROOT / "models" / "bench-logprobs.gguf"
    if not model.exists():
        write_model(model, SHAPE)
    cfg = EngineConfig(model=str(model), n_ctx=16 * 64, n_parallel=16, pipeline_groups=2, n_threads=1,
                       sample_threads=1, max_queued_requests=4096)
    e = Engine(cfg)
    figures: dict[str, list[tuple[float, float]]] = {k: [] for k in ARMS}
    try:
        prompts = make_prompts(a.requests, 16)
        run_engine(e, make_prompts(4, 4, seed=99), 4, 2)  # warm-up
        for _ in range(a.repeats):
            for name, extra in ARMS.items():
                p0 = e.profiles()
                res = run_engine(e, prompts, 16, a.tokens, extra)
                d = [b.minus(x) for x, b in zip(p0, e.profiles(), strict=True)]
                rows = sum(x.rows for x in d)
                sample_us = 1e6 * sum(x.sample for x in d) / max(rows, 1)
                tok_s = sum(t.n_tokens for t in res.timings) / res.wall_s
                figures[name].append((tok_s, sample_us))
    finally:
        e.close()
    print(f"{'arm':6} {'tok/s (median)':>15} {'sampling us/row (median)':>26}")
    for name, runs in figures.items():
        print(f"{name:6} {statistics.median(r[0] for r in runs):15.0f} {statistics.median(r[1] for r in runs):26.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
