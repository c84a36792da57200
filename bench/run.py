"""``make bench``: the headline against llama-server (bench/headline.py); ``--full``: the seed's
sweep on this machine, through HTTP and straight on the engine.

The reference split on a CPU box: the peer stage is an RPC server process with one thread
on loopback, the local stage is the CPU device with one thread, the engine's own threads
get what is left. Each cell runs twice, the second pass in reversed arm order, and keeps
the better run (these machines are noisy). Writes ``bench/results/latest.json``, a
markdown table and a PNG plot (``bench/results/sweep.*``), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.clients import LoadResult, make_prompts, run_engine, run_http
from bench.report import write_reports
from bench.stack import ROOT, HttpStack
from deployments.stage import server as rpc_server
from engine import Engine, EngineConfig
from observability.process import cpu_seconds, rss_bytes
from tests.models.synthetic import ModelShape, write_model

log = logging.getLogger("bench")
RESULTS = ROOT / "bench" / "results"
ENGINE_RPC_PORT = 50171
HTTP_RPC_PORT = 50172


@dataclass(frozen=True)
class Setup:
    shape: ModelShape
    n_prompt: int
    n_gen: int
    clients: int
    requests_per_client: int
    tensor_split: tuple[float, float] | None

    @property
    def model(self) -> Path:
        s = self.shape
        return ROOT / "models" / f"bench-{s.n_layer}L-{s.n_embd}d-{s.n_vocab}v-{s.ftype}.gguf"

    def n_ctx(self, slots: int) -> int:
        return slots * (self.n_prompt + self.n_gen + 16)


# The output layer of a 151,936-token vocabulary costs as much as ~14 of these layers, so the
# model needs enough layers for the peer to balance it.
FULL = Setup(ModelShape(n_layer=16, n_embd=1024, n_head=16, n_head_kv=4, n_ff=2816, n_vocab=151936,
                        ftype="q8_0", seed=11), n_prompt=32, n_gen=32, clients=32, requests_per_client=2,
             tensor_split=None)
QUICK = Setup(ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=32000, seed=11),
              n_prompt=16, n_gen=16, clients=8, requests_per_client=2, tensor_split=None)


def devices(order: str) -> list[str]:
    return ["RPC0", "CPU"] if order == "rpc-first" else ["CPU", "RPC0"]


def self_rss() -> int:
    return rss_bytes(os.getpid())


# ---- the engine path ---------------------------------------------------------------------------


class RpcServer:
    """The peer stage for the engine path: a server process with one thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.proc = rpc_server.launch("127.0.0.1", port, threads=1)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def engine_cell(setup: Setup, server: RpcServer, order: str, groups: int, pool: bool, slots: int,
                clients: int, tensor_split: list[float] | None = None, requests_per_client: int = 0,
                graph_reuse: bool = False, backend: bool = False) -> dict:
    cfg = EngineConfig(
        graph_reuse=graph_reuse,
        backend_sampling=backend,
        model=str(setup.model), n_ctx=setup.n_ctx(slots), n_parallel=slots, pipeline_groups=groups,
        n_threads=1, rpc_endpoints=[server.endpoint], devices=devices(order),
        sample_threads=4 if pool else 1, n_batch=max(512, slots), tensor_split=tensor_split,
        max_queued_requests=4096,
    )
    rss0 = self_rss()
    e = Engine(cfg)
    try:
        prompts = make_prompts(clients * (requests_per_client or setup.requests_per_client), setup.n_prompt)
        run_engine(e, make_prompts(groups, 4, seed=99), groups, 2)  # warm-up
        p0, c0 = e.profiles(), server.cpu()
        res = run_engine(e, prompts, clients, setup.n_gen)
        p1, c1 = e.profiles(), server.cpu()
        out = res.figures()
        out.update(_profile_figures(p0, p1, res))
        out["busy_peer"] = round((c1 - c0) / res.wall_s, 3)
        out["rss_engine_mb"] = round((self_rss() - rss0) / 2**20, 1)
        out["rss_peer_mb"] = round(server.rss() / 2**20, 1)
        return out
    finally:
        e.close()


def _profile_figures(p0: list, p1: list, res: LoadResult) -> dict:
    d = [b.minus(a) for a, b in zip(p0, p1, strict=True)]
    steps = sum(x.steps for x in d) or 1
    host = sum(x.batch + x.sample + x.detok + x.stop + x.send for x in d)
    step_total = host + sum(x.decode + x.sync for x in d)
    return {
        "busy_local": round(sum(x.decode_cpu for x in d) / res.wall_s, 3),
        "rows_per_step": round(sum(x.rows for x in d) / steps, 1),
        "host_frac": round(host / step_total, 3) if step_total else None,
        "sample_ms_per_token": round(1000 * sum(x.sample for x in d) / max(sum(x.rows for x in d), 1), 3),
    }


# ---- the HTTP path -----------------------------------------------------------------------------


def http_cell(setup: Setup, stack: HttpStack, order: str, groups: int, pool: bool, slots: int,
              clients: int, tensor_split: list[float] | None = None, requests_per_client: int = 0,
              backend: bool = False) -> dict:
    stack.deploy({
        "backend_sampling": backend,
        "model": str(setup.model), "n_ctx": setup.n_ctx(slots), "n_parallel": slots,
        "pipeline_groups": groups, "n_threads": 1, "devices": devices(order),
        "sample_threads": 4 if pool else 1, "n_batch": max(512, slots), "tensor_split": tensor_split,
        "max_queued_requests": 4096, "rpc": {"port": HTTP_RPC_PORT, "threads": 1}, "topology": "layer_split",
    })
    run_http(stack.base, make_prompts(groups, 4, seed=99), groups, 2)  # warm-up
    stack.scrape()  # opens the busy window
    n_req = clients * (requests_per_client or setup.requests_per_client)
    res = run_http(stack.base, make_prompts(n_req, setup.n_prompt), clients, setup.n_gen)
    m = stack.scrape()
    out = res.figures()
    out["busy_local"] = round(m.get(("pgroups_stage_busy_ratio", "local"), 0.0), 3)
    out["busy_peer"] = round(m.get(("pgroups_stage_busy_ratio", "peer"), 0.0), 3)
    out["rss_engine_mb"] = round(m.get(("pgroups_stage_resident_memory_bytes", "local"), 0.0) / 2**20, 1)
    out["rss_peer_mb"] = round(m.get(("pgroups_stage_resident_memory_bytes", "peer"), 0.0) / 2**20, 1)
    steps = sum(v for (n, _), v in m.items() if n == "pgroups_group_decode_steps_total") or 1
    rows = sum(v for (n, _), v in m.items() if n == "pgroups_group_sampled_rows_total")
    out["rows_per_step"] = round(rows / steps, 1)
    return out


# ---- the sweep ---------------------------------------------------------------------------------


def best_of(runs: list[dict]) -> dict:
    return max(runs, key=lambda r: (r.get("errors", 1) == 0, r.get("tok_s", 0.0)))


def sweep(cells: list[dict], run_one, repeats: int) -> list[dict]:
    """Each cell ``repeats`` times; odd passes in reversed order; keeps the best run."""
    runs: dict[int, list[dict]] = {i: [] for i in range(len(cells))}
    for rep in range(repeats):
        order = list(range(len(cells)))
        if rep % 2:
            order.reverse()
        for i in order:
            c = cells[i]
            t0 = time.monotonic()
            r = run_one(**{k: v for k, v in c.items() if k not in ("path", "backend_sampling", "sampling_pool")},
                        pool=c["sampling_pool"], backend=c["backend_sampling"])
            log.warning("%s %s: %s (%.0f s)", c["path"],
                        {k: c[k] for k in ("order", "groups", "sampling_pool", "backend_sampling", "slots")},
                        r, time.monotonic() - t0)
            runs[i].append(r)
    return [{**cells[i], **best_of(runs[i]), "runs": [r["tok_s"] for r in runs[i]]} for i in range(len(cells))]


def balance(setup: Setup, server: RpcServer) -> dict:
    """Measure each stage's CPU time per step with two groups; propose the split that equalises them."""
    n_layer = setup.shape.n_layer
    half = [n_layer // 2, n_layer - n_layer // 2]  # layers on the peer, layers local (+ the output)
    cfg = EngineConfig(model=str(setup.model), n_ctx=setup.n_ctx(setup.clients), n_parallel=setup.clients,
                       pipeline_groups=2, n_threads=1, rpc_endpoints=[server.endpoint], devices=devices("rpc-first"),
                       peer_layers=half[0], sample_threads=1, n_batch=max(512, setup.clients))
    e = Engine(cfg)
    try:
        prompts = make_prompts(setup.clients, setup.n_prompt)
        p0, c0 = e.profiles(), server.cpu()
        run_engine(e, prompts, setup.clients, setup.n_gen)
        p1, c1 = e.profiles(), server.cpu()
    finally:
        e.close()
    d = [b.minus(a) for a, b in zip(p0, p1, strict=True)]
    steps = sum(x.steps for x in d)
    peer_per_step = (c1 - c0) / steps
    local_per_step = sum(x.decode_cpu for x in d) / steps
    per_layer = peer_per_step / half[0]
    fixed_local = local_per_step - per_layer * half[1]  # output layer and the rest that cannot move
    n_peer = round(min(n_layer - 1, max(1, (n_layer + fixed_local / per_layer) / 2)))
    return {
        "measured_split": half,
        "peer_ms_per_step": round(1000 * peer_per_step, 2),
        "local_ms_per_step": round(1000 * local_per_step, 2),
        "proposed_split": [n_peer, n_layer - n_peer],
        # llama.cpp's tensor split counts the output layer as one more layer
        "tensor_split": [n_peer, n_layer + 1 - n_peer],
    }


def graph_reuse_cost(setup: Setup, server: RpcServer, split: list[float] | None, repeats: int) -> dict:
    """What disabling llama.cpp's graph reuse (the RPC race mitigation) costs, with one group.

    Reuse stays off with several groups: they share one RPC connection and its last-graph id.
    """
    cells = [{"order": "rpc-first", "groups": 1, "sampling_pool": True, "backend_sampling": False,
              "slots": setup.clients, "clients": setup.clients, "path": "engine", "tensor_split": split,
              "graph_reuse": reuse} for reuse in (False, True)]
    off, on = sweep(cells, lambda **kw: engine_cell(setup, server, **kw), repeats)
    return {"reuse_off_tok_s": off["tok_s"], "reuse_on_tok_s": on["tok_s"],
            "cost": f"{100 * (1 - off['tok_s'] / on['tok_s']):.1f} %"}


def extra_run(setup: Setup, base_cells: list[dict], a: argparse.Namespace) -> int:
    """Run only the backend-sampling cells and the graph-reuse cost; merge into the last results."""
    out = Path(a.out)
    results = json.loads((out / "sweep.json").read_text())
    meta = json.loads((out / "sweep-meta.json").read_text())
    split = meta["balance"].get("tensor_split") or meta["balance"]["proposed_split"]
    cells = [{**c, "tensor_split": split} for c in base_cells if c["backend_sampling"]]
    server = RpcServer(ENGINE_RPC_PORT)
    try:
        new = sweep([{**c, "path": "engine"} for c in cells], lambda **kw: engine_cell(setup, server, **kw), a.repeats)
        meta["graph_reuse"] = graph_reuse_cost(setup, server, split, a.repeats)
    finally:
        server.close()
    stack = HttpStack()
    try:
        new += sweep([{**c, "path": "http"} for c in cells], lambda **kw: http_cell(setup, stack, **kw), a.repeats)
    finally:
        stack.close()
    keys = ("path", "order", "groups", "sampling_pool", "backend_sampling", "slots")
    fresh = {tuple(c[k] for k in keys) for c in new}
    results = [r for r in results if tuple(r[k] for k in keys) not in fresh] + new
    meta["command"] += "; then " + "make bench BENCH_ARGS='--full --backend-only'"
    meta.pop("clients", None)
    print(write_reports(results, meta, out))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the full sweep instead of the headline")
    ap.add_argument("--only", default=None, help="headline: only the cells whose name contains this text")
    ap.add_argument("--quick", action="store_true", help="full sweep: a small model and few requests (a smoke run)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--slots", default="32,64,128,256", help="slot sweep (HTTP path)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--graph-reuse-only", action="store_true", help="only measure the graph-reuse cost")
    ap.add_argument("--backend-only", action="store_true",
                    help="only the backend-sampling cells and the graph-reuse cost, merged into the last results")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    if not a.full:
        from bench import headline

        headline.main(Path(a.out), a.only)
        return 0
    setup = QUICK if a.quick else FULL
    if not setup.model.exists():
        write_model(setup.model, setup.shape)
    t_start = time.monotonic()
    results: list[dict] = []
    base_cells = [
        {"order": o, "groups": g, "sampling_pool": pool, "backend_sampling": False, "slots": setup.clients,
         "clients": setup.clients}
        for o in ("rpc-first", "local-first") for g in (1, 2) for pool in (True, False)
    ] + [
        # the seed's backend-sampling rows: RPC first, the chain in the graph (no host pool)
        {"order": "rpc-first", "groups": g, "sampling_pool": False, "backend_sampling": True,
         "slots": setup.clients, "clients": setup.clients}
        for g in (1, 2)
    ]
    if a.backend_only:
        return extra_run(setup, base_cells, a)

    server = RpcServer(ENGINE_RPC_PORT)
    if a.graph_reuse_only:
        try:
            print(json.dumps(graph_reuse_cost(setup, server, None, a.repeats)))
        finally:
            server.close()
        return 0
    try:
        bal = balance(setup, server)
        log.warning("balance: %s", bal)
        split = list(bal["tensor_split"])
        for c in base_cells:
            c["tensor_split"] = split
        engine_cells = [{**c, "path": "engine"} for c in base_cells]
        results += sweep(engine_cells, lambda **kw: engine_cell(setup, server, **kw), a.repeats)
        default_split = [{**base_cells[0], "path": "engine", "groups": 2, "tensor_split": None}]
        bal["default_split_tok_s"] = sweep(default_split, lambda **kw: engine_cell(setup, server, **kw), 1)[0]["tok_s"]
        bal["proposed_split_tok_s"] = next(r["tok_s"] for r in results if r["groups"] == 2
                                           and r["order"] == "rpc-first" and r["sampling_pool"])
        reuse = graph_reuse_cost(setup, server, split, a.repeats)
    finally:
        server.close()

    if not a.skip_http:
        stack = HttpStack()
        try:
            http_cells = [{**c, "path": "http"} for c in base_cells]
            results += sweep(http_cells, lambda **kw: http_cell(setup, stack, **kw), a.repeats)
            slot_cells = [
                {"order": "rpc-first", "groups": g, "sampling_pool": True, "backend_sampling": False, "slots": s,
                 "clients": s, "path": "http", "tensor_split": split, "requests_per_client": 1}
                for s in (int(x) for x in a.slots.split(",")) for g in (1, 2) if s != setup.clients
            ]
            results += sweep(slot_cells, lambda **kw: http_cell(setup, stack, **kw), 1)
        finally:
            stack.close()

    meta = {
        "machine": f"{os.cpu_count()} cores, {os.uname().machine}",
        "model": setup.model.name,
        "shape": setup.shape.__dict__,
        "n_prompt": setup.n_prompt,
        "n_gen": setup.n_gen,
        "requests_per_client": setup.requests_per_client,
        "balance": bal,
        "graph_reuse": reuse,
        "wall_s": round(time.monotonic() - t_start, 1),
        "command": "make bench BENCH_ARGS='--full" + (" --quick'" if a.quick else "'"),
    }
    table = write_reports(results, meta, Path(a.out))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
