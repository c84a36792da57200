"""The benchmark a person runs (``make bench``): this project against llama-server, side by side.

One model, one split, one load, one run: upstream llama-server with rpc-server (both layer
orders it can be given), then this project over HTTP with one and two pipeline groups, each
unpinned and pinned (the peer stage on core 0, the local stage's compute on core 1, so
each stage has a "machine" of its own and everything else floats), then partial load: 8
and 16 clients on 32 slots with a shared 200-token system prefix. Every cell runs its load
twice on the same server (the second repetition shows decay) and reports tokens/s, TPOT,
TTFT, the CPU milliseconds per generated token of every process, and the micro-batches
llama.cpp cut each step into. Writes ``bench/results/latest.{json,md,png}``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import cpu
from bench.clients import make_prompts, run_http
from bench.layout import layout, pin_processes
from bench.llama_server import LlamaServer
from tests.models.synthetic import ModelShape, write_model

log = logging.getLogger("bench")
ROOT = Path(__file__).resolve().parents[1]
SHAPE = ModelShape(n_layer=8, n_embd=1024, n_head=16, n_head_kv=8, n_ff=2816, n_vocab=32000, seed=11)
MODEL = ROOT / "models" / "bench-8L-1024d-32000v-f16.gguf"
# a mixture of experts of the same active compute a token (two of eight experts, each a quarter
# of the dense block), four times its feed-forward weights: the experts of the first N_PEER
# layers live on the peer, as a big MoE's do on a pair
MOE_SHAPE = ModelShape(n_layer=8, n_embd=1024, n_head=16, n_head_kv=8, n_ff=1408, n_vocab=32000, n_expert=8,
                       n_expert_used=2, ftype="q8_0", seed=11)
MOE_MODEL = ROOT / "models" / "bench-8L-1024d-32000v-8x2-moe-q8_0.gguf"
# 5 layers on the peer, 3 and the output layer on the local node
N_PEER = 5
SLOTS = 32
N_PROMPT, N_GEN = 56, 32
PREFIX = 200
LS_PORT, LS_RPC_PORT = 8767, 50173
LAYOUT = layout()  # the pinned cells' cores (bench/layout.py): on 2 cores, 0 for the peer, 1 local
PEER_CPUS, LOCAL_CPUS, THREADS = LAYOUT.peer, LAYOUT.local, LAYOUT.threads


@dataclass(frozen=True)
class Cell:
    system: str  # "llama-server" | "pipeline-groups"
    groups: int = 1  # pipeline groups (llama-server: 1)
    output_local: bool = True  # llama-server only: the project's layer order
    pinned: bool = False
    clients: int = SLOTS
    requests_per_client: int = 4
    shared_prefix: int = 0

    @property
    def n_prompt(self) -> int:
        return N_PROMPT + self.shared_prefix

    share_prefix: bool = True  # pipeline-groups only: slots share prefixes (engine/cache/prefix.py)
    topology: str = "layer_split"  # pipeline-groups only: or "replicas", one engine per node (half the slots each)
    flash_attn: str = "auto"  # llama-server only: its -fa setting
    ingress: str = "direct"  # pipeline-groups only: the ingress serves HTTP itself; "proxy": Serve's proxy actor
    moe: bool = False  # the mixture-of-experts model (MOE_SHAPE) instead of the dense one

    @property
    def model(self) -> Path:
        return MOE_MODEL if self.moe else MODEL

    @property
    def n_ctx(self) -> int:
        per_slot = max(256, 1 << (self.n_prompt + N_GEN - 1).bit_length())  # a power of two that holds it
        return SLOTS * per_slot

    @property
    def name(self) -> str:
        if self.system == "llama-server":
            what = "llama-server, output " + ("local" if self.output_local else "on peer") + f", -fa {self.flash_attn}"
        elif self.topology == "replicas":
            what = "pipeline-groups, replicas (one per node, no split)"
        elif self.topology == "single":
            what = "pipeline-groups, one node alone (no split)"
        else:
            what = (f"pipeline-groups, groups {self.groups}" + ("" if self.share_prefix else ", no prefix sharing")
                    + (", Serve proxy" if self.ingress == "proxy" else ""))
        load = f"{self.clients} clients" + (f", {self.shared_prefix}-token shared prefix" if self.shared_prefix else "")
        return ("MoE: " if self.moe else "") + f"{what}, {'pinned' if self.pinned else 'unpinned'}, {load}"


def cells() -> list[Cell]:
    """llama-server at its best: both layer orders and every flash-attention setting (pinned:
    the project's order, every setting); this project with 1 and 2 groups and as replicas."""
    ls, pg = Cell("llama-server"), Cell("pipeline-groups")
    refs = [replace(ls, output_local=local, flash_attn=fa) for local in (False, True) for fa in ("auto", "on", "off")]
    rep = replace(pg, topology="replicas")
    out = [*refs, pg, replace(pg, groups=2), replace(pg, groups=2, ingress="proxy"), rep]
    out += [replace(ls, pinned=True, flash_attn=fa) for fa in ("auto", "on", "off")]
    out += [replace(c, pinned=True) for c in (pg, replace(pg, groups=2), rep, replace(pg, topology="single"))]
    for n in (8, 16):
        part = {"clients": n, "requests_per_client": 4, "shared_prefix": PREFIX}
        out += [replace(ls, **part), replace(pg, **part), replace(pg, groups=2, **part)]
    # the MoE cell: its experts on the peer, groups 1 and 2 against llama-server
    out += [replace(ls, moe=True, output_local=local) for local in (False, True)]
    out += [replace(pg, moe=True), replace(pg, groups=2, moe=True)]
    return out


def _metric_sums(base: str) -> dict[str, float]:
    return metric_sums(httpx.get(base + "/metrics", timeout=30).text)


def metric_sums(text: str) -> dict[str, float]:
    """Each series of a Prometheus exposition, summed over its labels."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def ttft_parts(d: dict[str, float]) -> dict[str, float]:
    """Where a request's first token waited, on average, from the engine's own histograms:
    before the engine (the client's mean TTFT less ``engine``: HTTP, ingress, Ray), in the
    engine's queue for a slot, and from its slot's start to its first token (its prefill
    step and the steps before it)."""
    def mean(name: str) -> float:
        n = d.get(name + "_count", 0.0)
        return round(d.get(name + "_sum", 0.0) / n, 3) if n else 0.0

    n = d.get("pgroups_time_to_first_token_seconds_count", 0.0)
    return {"engine": mean("pgroups_time_to_first_token_seconds"), "queue": mean("pgroups_request_queue_time_seconds"),
            "slot_to_first_token": round(d.get("pgroups_prompt_seconds_total", 0.0) / n, 3) if n else 0.0}


def _load(base: str, c: Cell, seed: int):
    prompts = make_prompts(c.clients * c.requests_per_client, c.n_prompt, seed=seed, shared_prefix=c.shared_prefix)
    return run_http(base, prompts, c.clients, N_GEN)


def measure(base: str, c: Cell, ours: bool) -> dict:
    """Warm up, then the load twice; figures of each repetition."""
    run_http(base, make_prompts(4, 8, seed=99), 4, 4)
    reps = []
    for rep in range(2):
        m0 = _metric_sums(base)
        c0 = cpu.snapshot()
        res = _load(base, c, seed=rep)
        c1 = cpu.snapshot()
        f = res.figures()
        n_tok = sum(t.n_tokens for t in res.timings if t.ok)
        f["cpu_ms_per_token"] = cpu.per_token_ms(c0, c1, n_tok)
        stage = f["cpu_ms_per_token"].get("rpc stage", 0.0)
        m1 = _metric_sums(base)
        d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
        # prompt tokens evaluated (not reused from a cache), as both servers count them
        f["prompt_evaluated"] = int(d.get("llamacpp:prompt_tokens_total", 0))
        if ours:
            steps = d.get("pgroups_group_decode_steps_total", 0) or 1
            f["ubatches_per_step"] = round(d.get("pgroups_group_ubatches_total", 0) / steps, 2)
            f["rows_per_step"] = round(d.get("pgroups_group_sampled_rows_total", 0) / steps, 1)
            local = 1000 * d.get("pgroups_group_decode_cpu_seconds_total", 0) / max(n_tok, 1)
            f["cpu_ms_per_token"]["local stage (in engine replica)"] = round(local, 3)
            f["ttft_parts_s"] = ttft_parts(d)
            stage += local
        else:
            stage += f["cpu_ms_per_token"].get("llama-server", 0.0)  # its host path included
        f["stage_cpu_ms_per_token"] = round(stage, 3)
        reps.append(f)
        log.warning("%s, repetition %d: %s", c.name, rep + 1, f)
    return {**c.__dict__, "name": c.name, "reps": reps, "tok_s": reps[0]["tok_s"],
            "tok_s_rep2": reps[1]["tok_s"], "ttft_median_s": reps[0]["ttft_median_s"],
            "tpot_ms": reps[0]["tpot_ms"], "stage_cpu_ms_per_token": reps[0]["stage_cpu_ms_per_token"],
            "ttft_p99_s": reps[0]["ttft_p99_s"], "prompt_evaluated": reps[0]["prompt_evaluated"],
            "errors": sum(r["errors"] for r in reps)}


def place_the_rest(pinned: bool) -> None:
    """Where the box has cores to spare (bench/layout.py), a pinned cell's Ray, HTTP and load
    client processes go on them; an unpinned cell's float over every core again. The stages
    pin themselves (rpc.cpus, local_cpus; taskset for llama-server and rpc-server)."""
    if not LAYOUT.rest:
        return
    cores = LAYOUT.rest if pinned else LAYOUT.every
    pin_processes([os.getpid(), *cpu.pids(lambda role: role not in ("rpc stage", "llama-server"))], cores)


def run_llama_server(c: Cell) -> dict:
    place_the_rest(c.pinned)
    srv = LlamaServer(c.model, n_layer=SHAPE.n_layer, n_peer=N_PEER, output_local=c.output_local, slots=SLOTS,
                      flash_attn=c.flash_attn, threads=THREADS,
                      n_ctx=c.n_ctx, port=LS_PORT, rpc_port=LS_RPC_PORT,
                      peer_cpus=PEER_CPUS if c.pinned else None, local_cpus=LOCAL_CPUS if c.pinned else None)
    try:
        return measure(srv.base, c, ours=False)
    finally:
        srv.close()


def run_ours(stack, c: Cell) -> dict:  # noqa: ANN001 - bench.run.HttpStack
    deploy_ours(stack, c)
    return measure(stack.base, c, ours=True)


def deploy_ours(stack, c: Cell) -> None:  # noqa: ANN001 - bench.run.HttpStack
    """Serve cell ``c`` on ``stack``."""
    # replicas: the same slots and context in all, half on each node (its own whole model);
    # pinned, the local node's replica on the local core, the peer node's on the peer's core
    # single: one node alone, the whole model on its core, no stage (what a replica is on its own)
    per_node = 2 if c.topology == "replicas" else 1
    args = {
        "model": str(c.model), "n_ctx": c.n_ctx // per_node, "n_parallel": SLOTS // per_node, "pipeline_groups": c.groups,
        "n_threads": THREADS, "devices": ["RPC0", "CPU"], "peer_layers": N_PEER,
        "n_batch": 512, "max_queued_requests": 4096, "local_cpus": LOCAL_CPUS if c.pinned else None,
        "rpc": {"port": 50174, "threads": THREADS, "cpus": PEER_CPUS if c.pinned else None},
        "share_prefix": c.share_prefix, "topology": "layer_split" if c.topology == "single" else c.topology,
    }
    if c.topology == "single":
        args.update(devices=None, peer_layers=None, rpc=None)
    place_the_rest(c.pinned)  # before the deploy: the new replica's processes inherit it
    stack.deploy(args)


def main(out: Path, only: str | None = None) -> list[dict]:
    from bench.stack import HttpStack

    todo = [c for c in cells() if only is None or only in c.name]
    for path, shape in ((MODEL, SHAPE), (MOE_MODEL, MOE_SHAPE)):
        if not path.exists() and any(c.model == path for c in todo):
            write_model(path, shape)
    t0 = time.monotonic()
    results: list[dict] = []
    partial = out / "latest.partial.json"  # each cell as it ends: a later failure keeps the run so far
    out.mkdir(parents=True, exist_ok=True)

    def done(r: dict) -> None:
        results.append(r)
        partial.write_text(json.dumps(results, indent=1))

    for c in todo:
        if c.system == "llama-server":
            done(run_llama_server(c))
    for ingress in ("direct", "proxy"):
        ours = [c for c in todo if c.system == "pipeline-groups" and c.ingress == ingress]
        if not ours:
            continue
        stack = HttpStack(ingress=ingress)
        try:
            for c in ours:
                done(run_ours(stack, c))
        finally:
            stack.close()
    meta = {"machine": f"{os.cpu_count()} cores, {os.uname().machine}", "cores": os.cpu_count(), "cpu": cpu.describe(),
            "model": ", ".join(sorted({c.model.name for c in todo})), "moe_model": f"{MOE_MODEL.name} (the MoE cells: {MOE_SHAPE.n_expert} experts, "
                                              f"{MOE_SHAPE.n_expert_used} a token, n_ff {MOE_SHAPE.n_ff} each)",
            "shape": SHAPE.__dict__, "split": f"{N_PEER} layers on the peer, {SHAPE.n_layer - N_PEER} and the output local",
            "layout": LAYOUT.describe(), "n_prompt": N_PROMPT, "n_gen": N_GEN, "slots": SLOTS, "wall_s": round(time.monotonic() - t0, 1),
            "command": "make bench" + (f" BENCH_ARGS='--only \"{only}\" --out {out}'" if only else "")}
    from bench.report import write_headline

    print(write_headline(results, meta, out))
    partial.unlink(missing_ok=True)
    return results
