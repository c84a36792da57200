"""The topology's choice as a unit: what a model needs, against the nodes' memory."""

from __future__ import annotations

import os

import pytest

from deployments.topology import NodeFacts, choose, kv_bytes, missing_model, model_needs

GIB = 1 << 30


def nodes(*gib: float, has_model: bool = True) -> list[NodeFacts]:
    return [NodeFacts(f"n{i}", f"10.0.0.{i + 1}", int(g * GIB), "CPU", has_model) for i, g in enumerate(gib)]


def test_the_kv_cache_is_counted_from_the_ggufs_own_shape(model_path):
    # the synthetic model: 4 layers, 2 KV heads of 64 dimensions, f16 K and V
    assert kv_bytes(model_path, 1000) == 4 * 1000 * 2 * (64 + 64) * 2
    assert model_needs(model_path, 1000) == os.path.getsize(model_path) + kv_bytes(model_path, 1000)
    # the prompt cache's KV too: by default as much again as the slots', else its budget
    assert model_needs(model_path, 1000, None) == os.path.getsize(model_path) + 2 * kv_bytes(model_path, 1000)
    assert model_needs(model_path, 1000, 5 << 20) == model_needs(model_path, 1000) + (5 << 20)


@pytest.mark.parametrize(("need", "have", "split", "want"), [
    (10, [128, 128], True, "replicas"),  # fits: each node serves a copy
    (120, [128, 128], True, "layer_split"),  # over 80 %: split over the pair
    (120, [128, 128], False, "replicas"),  # no stage to split over
    (10, [128], True, "single"),  # one node: as configured
    (14, [128, 16], True, "layer_split"),  # the smallest node decides
])
def test_auto_picks_replicas_when_the_model_fits_every_node(need, have, split, want):
    c = choose("auto", need * GIB, nodes(*have), split)
    assert c.topology == want and c.reason.startswith("auto:"), c
    assert f"{need:.2f} GiB" in c.reason


def test_a_configured_topology_is_kept_and_says_so():
    assert choose("replicas", 500 * GIB, nodes(128, 128), True).topology == "replicas"
    c = choose("layer_split", 1, nodes(128, 128), True)
    assert c.topology == "layer_split" and c.reason.startswith("configured")


def test_a_node_without_the_model_file_is_named():
    ns = nodes(128, 128)
    ns[1] = NodeFacts("n1", "10.0.0.2", 128 * GIB, "CPU", has_model=False)
    msg = missing_model(ns, "/models/m.gguf")
    assert "10.0.0.2" in msg and "/models/m.gguf" in msg and "10.0.0.1" not in msg
    assert missing_model(nodes(1, 1), "/m") is None


def test_a_config_written_for_the_split_serves_as_replicas_unchanged():
    from deployments.args import AppArgs

    a = AppArgs(devices=["RPC0", "CPU"], peer_layers=5, rpc_endpoints=["10.0.0.2:50052"], rpc={"port": 50052})
    cfg = a.replica_config()
    assert cfg.devices == ["CPU"] and cfg.peer_layers is None and cfg.rpc_endpoints == [] and cfg.tensor_split is None
    assert cfg.n_ctx == a.n_ctx and cfg.pipeline_groups == a.pipeline_groups
    assert AppArgs(devices=["RPC0"]).replica_config().devices is None  # the default local device
