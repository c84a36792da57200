"""Scale-out: two pairs (an engine replica and its own RPC stage each) on the four-raylet
cluster, behind one ingress that routes by prompt prefix and load."""

from __future__ import annotations

import collections
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import ray
from prometheus_client.parser import text_string_to_metric_families

from deployments.stage.actor import NAMESPACE, STAGE_NAME
from tests.e2e.streams import replicas_seen, resumes, served_by, stream_outcome

APP = {
    "n_ctx": 2048,
    "n_parallel": 4,
    "pipeline_groups": 2,
    "n_threads": 1,
    "replicas": 2,
    "stage_timeout_s": 10.0,
    "rpc": {"per_replica": True, "threads": 1},
}


def both_pairs(base: str, timeout_s: float = 180.0) -> set[str]:
    return replicas_seen(base, 2, timeout_s)


def test_each_pair_has_its_own_stage_on_its_own_peer_node_and_requests_spread(deploy):
    from ray import serve

    base = deploy(APP)
    reps = both_pairs(base)
    engine = serve.get_deployment_handle("engine", "pgroups")
    nodes = {kind: {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(kind)}
             for kind in ("stage_local", "stage_peer")}
    # each pair: its stage (named after its replica) on its own peer node, its engine on its own local node
    stage_nodes = {ray.get(ray.get_actor(f"{STAGE_NAME}-{r}", namespace=NAMESPACE).node.remote()) for r in reps}
    engine_nodes = {engine.info.remote(replica=r).result(timeout_s=30)["node"] for r in reps}
    assert stage_nodes == nodes["stage_peer"] and engine_nodes == nodes["stage_local"], (stage_nodes, engine_nodes, nodes)

    rng = random.Random(3)
    prompts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "pi"]) for _ in range(12)) for _ in range(24)]
    with ThreadPoolExecutor(8) as ex:
        where = list(ex.map(lambda p: served_by(base, p), prompts))
    counts = collections.Counter(where)
    assert set(counts) == reps and min(counts.values()) >= 4, counts

    # /metrics: one exposition with the series of both replicas and both stages
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text)}
    up = [s for f in fams.values() for s in f.samples if s.name.endswith("stage_up")]
    assert {s.labels["replica"] for s in up} == reps, up


def test_requests_land_on_the_pair_that_holds_their_prefix(deploy):
    base = deploy(APP)
    both_pairs(base)
    rng = random.Random(5)
    prefixes = {k: " ".join(rng.choice(["one", "two", "three", "four", "five", "six"]) for _ in range(120))
                for k in ("A", "B")}
    where: dict[str, list[str]] = {"A": [], "B": []}
    for i in range(20):
        for k, pre in prefixes.items():
            where[k].append(served_by(base, f"{pre} question {i}:"))
    for k, reps in where.items():
        top, n = collections.Counter(reps).most_common(1)[0]
        assert n >= 0.9 * len(reps), (k, collections.Counter(reps))


def test_killing_one_pairs_stage_leaves_the_other_pairs_streams_intact(deploy):
    """The other pair's streams go on untouched; the killed pair's resume (on the other pair, or
    on the killed one once it is back) and complete too."""
    base = deploy(APP)
    reps = both_pairs(base)
    resumed_before = resumes(base)
    results: dict[int, tuple[str, str]] = {}

    def stream(i: int) -> None:
        headers: dict = {}
        outcome = stream_outcome(base, {"prompt": f"long request {i}", "max_tokens": 300, "ignore_eos": True}, headers)
        results[i] = (headers.get("x-engine-replica", ""), outcome)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while True:  # streams running on both pairs
        busy = collections.Counter(s["replica"] for s in httpx.get(base + "/slots", timeout=10).json() if s["is_processing"])
        if len(busy) == 2 and min(busy.values()) >= 2:
            break
        assert time.monotonic() < deadline, f"the streams did not start on both pairs: {busy}"
        time.sleep(0.05)
    victim = sorted(reps)[0]
    stage = ray.get_actor(f"{STAGE_NAME}-{victim}", namespace=NAMESPACE)
    os.kill(ray.get(stage.health.remote())["pid"], signal.SIGKILL)
    for t in threads:
        t.join(150)
    assert len(results) == 8, results
    others = [o for rep, o in results.values() if rep != victim]
    cut = [o for rep, o in results.values() if rep == victim]
    assert others and all(o == "completed" for o in others), results
    assert cut and all(o == "completed" for o in cut), results
    assert resumes(base) >= resumed_before + len(cut)
    # new requests meanwhile go to the healthy pair; the killed pair comes back by itself
    assert served_by(base, "after the kill") in reps
    back = both_pairs(base, timeout_s=240)
    assert len(back) == 2 and victim not in back
