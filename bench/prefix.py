"""Shared prefixes, measured (``make bench-prefix``): 32 clients whose prompts share a
1,000-token system prompt arrive together, one request each, on 32 slots.

llama-server reuses a slot's *own* cached prefix only, so each of its slots evaluates the
system prompt again; this project (two pipeline groups) copies the KV of a prefix another
slot of the group holds or is computing, so each group evaluates it once. Same model, split
and server settings as ``make bench``'s headline (bench/headline.py); the load runs twice on
each server, each time with a new system prompt (cold both times). Prints and writes
``bench/results/prefix.{json,md}``: prompt tokens evaluated (each server's
``llamacpp:prompt_tokens_total``), the cached tokens its usage reported, TTFT median and p99,
tokens/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

from bench import cpu
from bench.headline import MODEL, SHAPE, Cell, run_llama_server, run_ours
from tests.models.synthetic import write_model

log = logging.getLogger("bench")
RESULTS = Path(__file__).resolve().parent / "results"
SYSTEM_PROMPT = 1000
CLIENTS = 32


def cells() -> list[Cell]:
    load = {"clients": CLIENTS, "requests_per_client": 1, "shared_prefix": SYSTEM_PROMPT}
    pg = Cell("pipeline-groups", groups=2, **load)
    return [Cell("llama-server", **load), replace(pg, share_prefix=False), pg]


COLS = ("name", "prompt_evaluated", "cached_tokens", "ttft_median_s", "ttft_p99_s", "tok_s")


def markdown(results: list[dict], meta: dict) -> str:
    lines = ["| server | " + " | ".join(COLS[1:]) + " |", "|" + "---|" * len(COLS)]
    for r in results:
        for i, rep in enumerate(r["reps"]):
            vals = [f"{r['name']} (run {i + 1})"] + [str(rep.get(c)) for c in COLS[1:]]
            lines.append("| " + " | ".join(vals) + " |")
    lines += ["", f"Machine: {meta['machine']}; CPU: {meta['cpu']}; model {meta['model']}; {CLIENTS} clients, "
              f"prompts of {meta['n_prompt']} tokens ({SYSTEM_PROMPT} shared); `{meta['command']}` took {meta['wall_s']} s."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.stack import HttpStack

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if not MODEL.exists():
        write_model(MODEL, SHAPE)
    t0 = time.monotonic()
    todo = cells()
    results = [run_llama_server(c) for c in todo if c.system == "llama-server"]
    stack = HttpStack()
    try:
        results += [run_ours(stack, c) for c in todo if c.system == "pipeline-groups"]
    finally:
        stack.close()
    meta = {"machine": f"{os.cpu_count()} cores, {os.uname().machine}", "cpu": cpu.describe(), "model": MODEL.name,
            "n_prompt": todo[0].n_prompt, "wall_s": round(time.monotonic() - t0, 1), "command": "make bench-prefix"}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix.json").write_text(json.dumps({"meta": meta, "cells": results}, indent=1))
    table = markdown(results, meta)
    (out / "prefix.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
