"""Faults under load on `make serve`'s app: every stream in flight resumes where it was.

The demo as ``make serve`` serves it (deployments/configs/local.yaml: SmolLM2-135M-Instruct split
over the RPC stage on the local Ray cluster, two pipeline groups, 8 slots, the default
``stage_timeout_s`` and resume settings), driven over HTTP with greedy chat streams of
``--tokens`` tokens (96; the end of generation ignored, so each must carry all of them). Each
cell first runs its requests with no fault (what the resumed ones must equal), then again with
the fault once every stream has text:

- ``stage-kill``: 8 streams; the RPC stage's server is killed (SIGKILL).
- ``engine-kill``: 4 streams; the engine replica's actor is killed.
- ``freeze``: 4 streams; the stage's server is stopped (SIGSTOP) for ``--freeze`` seconds (75),
  then continued if it still exists: the watchdog (``stage_timeout_s``, 60) fails the replica and
  has a fresh server started.
- ``structured``: one collected chat request and one ``json_schema`` chat stream across a stage
  kill; the stream's text must parse and hold the schema's keys.
- ``pairs``: two pairs (``replicas: 2``, a stage each, 8 slots each); 4 streams a pair, one pair's
  stage killed: the pause of its streams against the other pair's longest gap, and against one
  prefill of a prompt as long as theirs was at the kill (what a continuation evaluates). The
  other pair has room for them (with every slot of it busy, they would wait for one).

Per cell: streams completed with every token and no error event, how many equal the unfaulted
text, the longest pause a stream saw, the resumes counted by ``/metrics``. Prints one JSON line per
cell and a table; writes bench/results/faults.*. Starts its own Ray cluster (``ray stop`` first and
after: every Ray process of this user on the machine).

    python -m bench.faults [--cells stage-kill,engine-kill,freeze,structured,pairs] [--tokens 96]
    (make bench-faults)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from bench.stack import ROOT, HttpStack, demo_args

CELLS = ("stage-kill", "engine-kill", "freeze", "structured", "pairs")
TOPICS = ["the sea", "mountains", "bread", "trains", "bees", "winter", "libraries", "rivers"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "items": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                     "maxItems": 6}},
          "required": ["name", "items"], "additionalProperties": False}


@dataclass
class Stream:
    """One streamed chat answer as the client saw it."""

    body: dict
    outcome: str = "not started"
    text: str = ""
    tokens: int = 0
    replica: str = ""
    arrivals: list[float] = field(default_factory=list)

    @property
    def longest_gap(self) -> float:
        ts = self.arrivals
        return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=0.0)


def chat(i: int, tokens: int, **extra: object) -> dict:
    return {"messages": [{"role": "user", "content": f"Write a long essay about {TOPICS[i % len(TOPICS)]}."}],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True, **extra}


def run_stream(base: str, s: Stream) -> None:
    body = {**s.body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
            s.replica = r.headers.get("x-engine-replica", "")
            if r.status_code != 200:
                s.outcome = f"http {r.status_code}"
                return
            s.outcome, parts = "no end", []
            for line in r.iter_lines():
                if line.startswith('data: {"error"'):
                    s.outcome = f"error {json.loads(line[6:])['error'].get('code')}"
                elif line == "data: [DONE]":
                    s.outcome = "completed" if s.outcome == "no end" else s.outcome
                elif line.startswith("data: {"):
                    d = json.loads(line[6:])
                    if d.get("usage"):
                        s.tokens = d["usage"]["completion_tokens"]
                    text = "".join((c.get("delta") or {}).get("content") or "" for c in d.get("choices", []))
                    if text:
                        parts.append(text)
                        s.arrivals.append(time.perf_counter())
            s.text = "".join(parts)
    except httpx.HTTPError as e:
        s.outcome = f"transport {type(e).__name__}"


def start(base: str, bodies: list[dict]) -> tuple[list[Stream], list[threading.Thread]]:
    """The streams, once each has had some text."""
    streams = [Stream(b) for b in bodies]
    threads = [threading.Thread(target=run_stream, args=(base, s), daemon=True) for s in streams]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(len(s.arrivals) >= 4 for s in streams):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the streams did not start: {[s.outcome for s in streams]}")
        time.sleep(0.02)
    return streams, threads


def finish(threads: list[threading.Thread], timeout_s: float = 600.0) -> None:
    for t in threads:
        t.join(timeout_s)


def unfaulted(base: str, bodies: list[dict]) -> list[Stream]:
    streams, threads = start(base, bodies)
    finish(threads)
    return streams


def resumes(base: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pgroups_resumes_total")


def figures(name: str, streams: list[Stream], want: list[Stream], tokens: int, resumed: float, **more: object) -> dict:
    return {"cell": name, "streams": len(streams),
            "completed_all_tokens": sum(s.outcome == "completed" and s.tokens == tokens for s in streams),
            "outcomes": sorted({s.outcome for s in streams}),
            "equal_unfaulted": sum(s.text == w.text for s, w in zip(streams, want, strict=True)),
            "longest_pause_s": round(max(s.longest_gap for s in streams), 2),
            "unfaulted_longest_gap_s": round(max(w.longest_gap for w in want), 2),
            "resumes": int(resumed), **more}


def stage_pid(replica: str | None = None) -> int:
    import ray

    from deployments.stage.actor import NAMESPACE, STAGE_NAME, get_stage

    stage = get_stage() if replica is None else ray.get_actor(f"{STAGE_NAME}-{replica}", namespace=NAMESPACE)
    return ray.get(stage.health.remote())["pid"]


def kill_stage() -> None:
    os.kill(stage_pid(), signal.SIGKILL)


def kill_engine_replica() -> None:
    import ray

    [engine] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::bench#engine#")]
    ray.kill(ray.get_actor(engine["name"], namespace=engine["namespace"]), no_restart=True)


def wait_healthy(base: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(base + "/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the app did not come back")
        time.sleep(0.5)


def fault_cell(base: str, name: str, n: int, tokens: int, fault, settle: float = 0.0) -> dict:
    """``n`` streams unfaulted, then again with ``fault()`` once each has text."""
    bodies = [chat(i, tokens) for i in range(n)]
    want = unfaulted(base, bodies)
    before = resumes(base)
    streams, threads = start(base, bodies)
    t0 = time.perf_counter()
    more = fault() or {}
    finish(threads)
    done = time.perf_counter() - t0
    wait_healthy(base)
    time.sleep(settle)
    return figures(name, streams, want, tokens, resumes(base) - before, fault_to_done_s=round(done, 2), **more)


def freeze(seconds: float) -> dict:
    pid = stage_pid()
    os.kill(pid, signal.SIGSTOP)
    time.sleep(seconds)
    try:
        os.kill(pid, signal.SIGCONT)
        alive = True
    except ProcessLookupError:
        alive = False
    return {"frozen_s": seconds, "frozen_server_replaced": not alive or stage_pid() != pid}


def structured_cell(base: str, tokens: int) -> dict:
    collected_body = chat(0, tokens)
    json_body = {"messages": [{"role": "user", "content": "Give a shopping list as JSON."}], "max_tokens": 160,
                 "temperature": 0, "response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "list", "schema": SCHEMA}}}
    want_collected = httpx.post(base + "/v1/chat/completions", json=collected_body, timeout=600).json()
    want_json = unfaulted(base, [json_body])[0]
    before = resumes(base)
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=httpx.post(base + "/v1/chat/completions", json=collected_body,
                                                                timeout=600)), daemon=True)
    t.start()
    streams, threads = start(base, [json_body])
    kill_stage()
    finish([*threads, t])
    wait_healthy(base)
    s, r = streams[0], box.get("r")
    try:
        parsed = json.loads(s.text)
        valid = isinstance(parsed, dict) and set(parsed) == {"name", "items"}
    except ValueError:
        valid = False
    got = r.json() if r is not None and r.status_code == 200 else {}
    return {"cell": "structured", "json_stream": s.outcome, "json_valid": valid, "json_equal_unfaulted": s.text == want_json.text,
            "collected_status": r.status_code if r is not None else None,
            "collected_tokens": (got.get("usage") or {}).get("completion_tokens"),
            "collected_equal_unfaulted": bool(got) and got["choices"][0]["message"]["content"]
            == want_collected["choices"][0]["message"]["content"],
            "resumes": int(resumes(base) - before)}


def pairs_cell(base: str, tokens: int) -> dict:
    bodies = [chat(i, tokens) for i in range(8)]
    deadline = time.monotonic() + 240
    while len({s["replica"] for s in httpx.get(base + "/slots", timeout=10).json()}) < 2:  # both pairs up
        if time.monotonic() > deadline:
            raise TimeoutError("the second pair did not come up")
        time.sleep(0.5)
    want = unfaulted(base, bodies)
    before = resumes(base)
    streams, threads = start(base, bodies)
    victim = sorted({s.replica for s in streams})[0]
    cut = [s for s in streams if s.replica == victim]
    at_kill = max(len(s.arrivals) for s in cut)
    pid = stage_pid(victim)
    t_kill = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    finish(threads)
    others = [s for s in streams if s.replica != victim]
    pause = max(max((b - a for a, b in zip(s.arrivals, s.arrivals[1:], strict=False) if b > t_kill), default=0.0)
                for s in cut)
    # one prefill of what a continuation evaluates: its prompt (about 40 tokens) and the tokens so far
    n = 40 + at_kill
    t0 = time.perf_counter()
    httpx.post(base + "/v1/completions", json={"prompt": [1000 + i for i in range(n)], "max_tokens": 1,
                                               "cache_prompt": False}, timeout=300).raise_for_status()
    prefill = time.perf_counter() - t0
    out = figures("pairs", streams, want, tokens, resumes(base) - before)
    return {**out, "cut_streams": len(cut), "cut_pause_s": round(pause, 2),
            "other_pair_longest_gap_s": round(max((s.longest_gap for s in others), default=0.0), 2),
            "one_prefill_of_that_length_s": round(prefill, 2), "tokens_at_kill": at_kill}


def table(rows: list[dict]) -> str:
    out = ["| cell | streams complete, all tokens | equal to unfaulted | longest pause s | resumes | more |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if "streams" in r:
            more = {k: v for k, v in r.items() if k not in ("cell", "streams", "completed_all_tokens", "outcomes",
                                                           "equal_unfaulted", "longest_pause_s", "resumes")}
            out.append(f"| {r['cell']} | {r['completed_all_tokens']} of {r['streams']} | {r['equal_unfaulted']} of "
                       f"{r['streams']} | {r['longest_pause_s']} | {r['resumes']} | "
                       + ", ".join(f"{k} {v}" for k, v in more.items()) + " |")
        else:
            out.append(f"| {r['cell']} | " + ", ".join(f"{k} {v}" for k, v in r.items() if k != "cell") + " | | | | |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--freeze", type=float, default=75.0, help="seconds the stage is stopped")
    a = ap.parse_args(argv)
    cells = a.cells.split(",")
    rows: list[dict] = []
    stack = HttpStack(pairs=2)  # room for the two pairs of the last cell
    base = stack.base
    try:
        one_pair = [c for c in cells if c != "pairs"]
        if one_pair:
            stack.deploy(demo_args())
        for cell in one_pair:
            if cell == "stage-kill":
                row = fault_cell(base, cell, 8, a.tokens, kill_stage)
            elif cell == "engine-kill":
                row = fault_cell(base, cell, 4, a.tokens, kill_engine_replica)
            elif cell == "freeze":
                row = fault_cell(base, cell, 4, a.tokens, lambda: freeze(a.freeze))
            elif cell == "structured":
                row = structured_cell(base, a.tokens)
            else:
                ap.error(f"unknown cell {cell}; known: {CELLS}")
            print(json.dumps(row), flush=True)
            rows.append(row)
        if "pairs" in cells:
            stack.deploy(demo_args(replicas=2, n_parallel=8, n_ctx=4096, rpc={"per_replica": True, "threads": 1}))
            row = pairs_cell(base, a.tokens)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        stack.close()
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.md").write_text(table(rows) + "\n")
    (out / "faults.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
