"""A history moved between groups against the same history evaluated again (``make bench-move``).

The demo's model (SmolLM2-135M-Instruct, 15 of its 30 layers on an RPC stage on loopback, a
counting relay in front of it), two groups of one slot. A conversation's first turn, then a
request pinned to its slot (its group is busy from there), then the conversation's next turn:
it is served by the other group, which takes the history's state from the holder's context
(``move_min_tokens`` 256, the default) or evaluates it again (0). For each history length:
the returning turn's first token, the bytes that crossed the link during it, the state's
bytes, and whether both answers are the same text. One engine at a time on the box.
Prints and writes ``bench/results/move.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench import cpu

RESULTS = Path(__file__).resolve().parent / "results"
RPC_PORT = 50071
HISTORIES = (500, 2000, 6000)


def words(n: int, seed: int) -> list[int]:
    """``n`` token ids of ordinary vocabulary, different per ``seed``."""
    return [1000 + (seed * 7919 + k * 104729) % 40000 for k in range(n)]


def greedy(e, prompt: list[int], max_tokens: int = 16, id_slot: int = -1):
    from engine import SamplingParams

    return e.make_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                          id_slot=id_slot)


def measure(model: str, n_history: int, move_min: int, link) -> dict:
    from engine import Engine, EngineConfig

    e = Engine(EngineConfig(model=model, n_parallel=2, pipeline_groups=2, n_ctx=2 * 8192, n_threads=1,
                            rpc_endpoints=[f"127.0.0.1:{link.port}"], peer_layers=15, move_min_tokens=move_min))
    try:
        first = words(n_history, 1)
        c = e.complete(greedy(e, first))
        busy = e.stream_request(greedy(e, words(64, 2), max_tokens=4000, id_slot=c.final.slot))
        next(busy)  # the first turn's group is busy from here
        b0 = link.both
        c2 = e.complete(greedy(e, first + c.tokens + words(64, 3)))
        n_link = link.both - b0
        busy.close()  # cancelled
        fin2, text = c2.final, c2.text
        moved = [g.prefix.moves() for g in e.groups]
        return {"history": n_history, "move_min_tokens": move_min, "cached_tokens": fin2.cached_tokens,
                "ttft_s": round(fin2.t_first_token, 3), "link_bytes": n_link,
                "state_bytes": sum(m[2] for m in moved), "text": text}
    finally:
        e.close()


def main(argv: list[str] | None = None) -> int:
    from deployments.stage import server as rpc_server
    from tests.link import CountingLink

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--histories", default=",".join(map(str, HISTORIES)))
    a = ap.parse_args(argv)
    from engine.models import CHAT_MODEL

    model = str(CHAT_MODEL)
    t0 = time.monotonic()
    proc = rpc_server.launch("127.0.0.1", RPC_PORT, threads=1)
    link = CountingLink(RPC_PORT)
    rows = []
    try:
        for n in map(int, a.histories.split(",")):
            got = {m: measure(model, n, m, link) for m in (256, 0)}
            same = got[256].pop("text") == got[0].pop("text")
            for m in (256, 0):
                rows.append({**got[m], "same_text": same})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        link.close()
        proc.kill()
        proc.wait()
    meta = {"machine": cpu.describe(), "command": "make bench-move", "wall_s": round(time.monotonic() - t0, 1)}
    lines = ["| history (tokens) | history | first token of the returning turn | over the link | state moved | same text |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        how = "moved" if r["move_min_tokens"] and r["cached_tokens"] else "evaluated again"
        lines.append(f"| {r['history']} | {how} ({r['cached_tokens']} cached) | {r['ttft_s']} s | "
                     f"{r['link_bytes'] / 1e6:.2f} MB | {r['state_bytes'] / 1e6:.2f} MB | {r['same_text']} |")
    lines += ["", f"{meta['machine']}, `{meta['command']}` took {meta['wall_s']} s."]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "move.json").write_text(json.dumps({"rows": rows, "meta": meta}, indent=1))
    (out / "move.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["same_text"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
