"""Topologies on the four-raylet cluster: replicas (one whole model per node, no stage), and
``auto`` choosing between them from what the model needs against what each node states."""

from __future__ import annotations

import collections
import os
import signal
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from deployments.stage.actor import NAMESPACE, STAGE_NAME
from tests.e2e.conftest import NODE_MEMORY
from tests.e2e.streams import replicas_seen, served_by

APP = {"n_ctx": 1024, "n_parallel": 4, "n_threads": 1}


def test_replicas_serve_a_whole_model_on_every_node_and_one_down_leaves_the_others_serving(deploy):
    from ray import serve

    base = deploy({**APP, "topology": "replicas"})
    serving = {n["NodeID"] for n in ray.nodes() if n["Alive"] and ({"stage_local", "stage_peer"} & set(n["Resources"]))}
    reps = replicas_seen(base, len(serving))
    engine = serve.get_deployment_handle("engine", "pgroups")
    infos = {r: engine.info.remote(replica=r).result(timeout_s=30) for r in reps}
    # one replica per node, each with the whole model on its own device, and no RPC stage anywhere
    assert {i["node"] for i in infos.values()} == serving
    assert all(i["topology"] == "replicas" and not any(d.startswith("RPC") for d in i["devices"] or []) for i in infos.values())
    with pytest.raises(ValueError):
        ray.get_actor(STAGE_NAME, namespace=NAMESPACE)
    props = httpx.get(base + "/props", timeout=10).json()
    assert props["topology"]["topology"] == "replicas" and props["topology"]["reason"].startswith("configured")
    # the page's live view: every replica, its local stage only
    view = httpx.get(base + "/pipeline", timeout=30)
    assert view.status_code == 200, view.text
    assert {r["replica"] for r in view.json()["replicas"]} == set(reps)
    assert all([s["stage"] for s in r["stages"]] == ["local"] for r in view.json()["replicas"])

    where = collections.Counter(served_by(base, f"question number {i} about topic {i % 7}") for i in range(24))
    assert len(where) >= 2, where  # a burst spreads over the nodes

    victim = sorted(reps)[0]
    os.kill(infos[victim]["pid"], signal.SIGKILL)
    # the others serve: after the router has seen the replica go, every request is answered
    deadline = time.monotonic() + 60
    ok = 0
    while ok < 8:
        r = httpx.post(base + "/v1/completions", json={"prompt": f"after the kill {ok}", "max_tokens": 4}, timeout=60)
        if r.status_code == 200:
            assert r.headers["x-engine-replica"] != victim
            ok += 1
        else:
            ok = 0
            assert time.monotonic() < deadline, r.text
            time.sleep(0.5)
    # and the killed node's replica comes back by itself
    back = replicas_seen(base, len(serving), timeout_s=240)
    assert victim not in back


def test_auto_serves_replicas_when_the_model_fits_a_node_and_splits_it_when_not(deploy, model_path):
    from deployments.app import plan_topology
    from deployments.args import AppArgs

    # each node states NODE_MEMORY; 64k cells of KV do not fit in it, 1k do
    big = plan_topology(AppArgs(model=model_path, n_ctx=65536, n_parallel=4, rpc={"port": 50155}))
    assert big.topology == "layer_split" and "does not fit" in big.reason, big
    assert big.node_bytes == NODE_MEMORY and big.need_bytes > NODE_MEMORY
    base = deploy({**APP, "topology": "auto", "rpc": {"port": 50156, "threads": 1}})
    props = httpx.get(base + "/props", timeout=10).json()
    assert props["topology"]["topology"] == "replicas" and props["topology"]["reason"].startswith("auto: fits"), props
    replicas_seen(base, props["topology"]["nodes"])
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text)}
    topo = [s for s in fams["pgroups_topology"].samples]
    assert topo and all(s.labels["topology"] == "replicas" and s.value == 1 for s in topo), topo
