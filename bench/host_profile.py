"""Where the host path's CPU goes: the headline's two-group cell under its 32-client load, with
the in-process stack sampler (observability/stacks.py) in the ingress and engine replicas.

``make bench-host`` prints, per replica, the CPU milliseconds per generated token of each
thread and of the frames they were in (self time at the innermost Python frame, and
inclusive), from the sampler's files taken before and after the measured loads; with each
process's CPU per token from /proc, as ``make bench`` reports it. The sampler costs the
sampled processes a little CPU of its own; read the shares, not the totals. A thread whose
time sits at its outermost frame (an event loop's ``run_forever``, a thread's ``run``) spent
it in C below Python: the event loop's system calls, Ray's core worker, llama.cpp.
Writes ``bench/results/host_profile.md``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from pathlib import Path

from bench import cpu
from bench.clients import make_prompts, run_http
from bench.headline import MODEL, SHAPE, Cell, _load, deploy_ours
from observability.stacks import ENV, FLUSH_S, read_collapsed
from tests.models.synthetic import write_model

RESULTS = Path(__file__).resolve().parent / "results"
FLUSH_WAIT_S = FLUSH_S + 1  # each sampler has rewritten its file since


def summarise(before: Counter[str], after: Counter[str], n_tokens: int, top: int = 15) -> list[str]:
    """Markdown lines: per thread, then the frames with the most self and inclusive time."""
    d = after - before  # the stacks' time between the two files
    per = 1000.0 * max(n_tokens, 1)  # microseconds -> ms per token

    def table(title: str, c: Counter[str]) -> list[str]:
        rows = [f"| {k} | {v / per:.4f} |" for k, v in c.most_common(top)]
        return [f"| {title} | ms/token |", "|---|---|", *rows, ""]

    threads: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for stack, us in d.items():
        frames = stack.split(";")
        threads[frames[0]] += us
        leaf[f"{frames[0]}: {frames[-1]}"] += us
        for f in set(frames[1:]):
            inclusive[f"{frames[0]}: {f}"] += us
    return [f"sampled: {sum(d.values()) / per:.3f} ms/token", "", *table("thread", threads),
            *table("innermost frame (self)", leaf), *table("frame (inclusive)", inclusive)]


def main(argv: list[str] | None = None) -> int:
    from bench.stack import HttpStack

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", type=int, default=2, help="measured repetitions of the 32-client load")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)
    where = Path(a.out) / "stacks"
    where.mkdir(parents=True, exist_ok=True)
    for f in where.glob("*.txt"):
        f.unlink()
    os.environ[ENV] = str(where)  # the Ray nodes start with it; their workers inherit it
    if not MODEL.exists():
        write_model(MODEL, SHAPE)
    c = Cell("pipeline-groups", groups=2)
    stack = HttpStack(ingress="direct")
    try:
        deploy_ours(stack, c)
        run_http(stack.base, make_prompts(4, 8, seed=99), 4, 4)
        time.sleep(FLUSH_WAIT_S)
        before = {f.name: read_collapsed(f) for f in where.glob("*.txt")}
        c0, n_tok, t0 = cpu.snapshot(), 0, time.monotonic()
        for rep in range(a.loads):
            res = _load(stack.base, c, seed=rep)
            n_tok += sum(t.n_tokens for t in res.timings if t.ok)
        wall = time.monotonic() - t0
        c1 = cpu.snapshot()
        time.sleep(FLUSH_WAIT_S)
        after = {f.name: read_collapsed(f) for f in where.glob("*.txt")}
    finally:
        stack.close()
    per_process = cpu.per_token_ms(c0, c1, n_tok)
    lines = [f"# Host path profile: {c.name}", "",
             f"{a.loads} loads, {n_tok} tokens, {n_tok / wall:.1f} tok/s with the sampler on; machine: {cpu.describe()}",
             "", "| process | CPU ms/token (/proc) |", "|---|---|", *[f"| {k} | {v} |" for k, v in per_process.items()], ""]
    for name in sorted(after):
        lines += [f"## {name.rsplit('-', 1)[0]} replica", "", *summarise(before.get(name, Counter()), after[name], n_tok)]
    out = Path(a.out) / "host_profile.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
