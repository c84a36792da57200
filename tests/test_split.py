"""The layer split over a ggml RPC stage (a server process on loopback), without Ray.

Two contexts on one RPC endpoint share one connection; the engine disables llama.cpp's
graph reuse by default so that one context can never recompute the other's graph. These
tests hold the result: greedy output over the split is byte-identical for N = 1, 2 and 4
groups and to the unsplit model, under concurrent load, over many steps.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import SamplingParams

log = logging.getLogger(__name__)

PROMPTS = [f"the {w} of the pipeline node number {i} said" for i, w in enumerate(
    ["king", "queen", "dog", "cat", "tree", "house", "water", "fire"])]
P = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def outputs(engine) -> list[str]:
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        return list(ex.map(lambda p: engine.generate(p, P).text, PROMPTS))


def test_default_device_order_puts_the_rpc_device_first(make_engine, rpc_endpoint):
    e = make_engine(n_parallel=2, rpc_endpoints=[rpc_endpoint])
    assert e.devices == ["RPC0", "CPU"] or (e.devices[0].startswith("RPC") and e.devices[-1] != "RPC0")


def test_unknown_device_is_refused_with_the_list(make_engine, rpc_endpoint):
    with pytest.raises(ValueError, match="available devices: .*CPU"):
        make_engine(n_parallel=2, rpc_endpoints=[rpc_endpoint], devices=["RPC0", "GPU7"])


def test_split_greedy_identical_for_1_2_4_groups_and_unsplit(make_engine, rpc_endpoint):
    digests = {}
    results = {}
    unsplit = make_engine(n_parallel=8, n_ctx=4096)
    results["unsplit"] = outputs(unsplit)
    unsplit.close()
    for n in (1, 2, 4):
        e = make_engine(n_parallel=8, n_ctx=4096, pipeline_groups=n, rpc_endpoints=[rpc_endpoint])
        results[n] = outputs(e)
        # several rounds so the contexts interleave on the shared connection for many steps
        assert outputs(e) == results[n]
        e.close()
    for k, v in results.items():
        digests[k] = hashlib.md5("\x00".join(v).encode()).hexdigest()
        log.warning("split greedy md5 %s: %s", k, digests[k])
    assert results["unsplit"] == results[1] == results[2] == results[4]


def test_local_first_order_is_possible_and_identical(make_engine, rpc_endpoint):
    rpc_first = make_engine(n_parallel=4, n_ctx=2048, pipeline_groups=2, rpc_endpoints=[rpc_endpoint])
    a = [rpc_first.generate(p, P).text for p in PROMPTS[:4]]
    rpc_first.close()
    local_first = make_engine(
        n_parallel=4, n_ctx=2048, pipeline_groups=2, rpc_endpoints=[rpc_endpoint], devices=["CPU", "RPC0"]
    )
    assert local_first.devices == ["CPU", "RPC0"]
    assert [local_first.generate(p, P).text for p in PROMPTS[:4]] == a


def test_tensor_split_moves_layers(make_engine, rpc_endpoint):
    e = make_engine(n_parallel=2, rpc_endpoints=[rpc_endpoint], tensor_split=[1.0, 3.0])
    assert e.generate("hello", P).final.completion_tokens == 48


def test_peer_layers_puts_exactly_that_many_layers_on_the_peer(make_engine, rpc_endpoint, model_path, caplog):
    import re

    from engine.native import Model

    n_layer = Model.n_layer_of(model_path)
    assert n_layer >= 3
    with caplog.at_level(logging.DEBUG, logger="llama_cpp.native"):
        make_engine(n_parallel=2, rpc_endpoints=[rpc_endpoint], peer_layers=n_layer - 2)
    placed = dict(re.findall(r"layer +(\d+) assigned to device (\w+)", caplog.text))
    # llama.cpp's own record of the placement; layer n_layer is the output layer
    on_peer = sorted(int(i) for i, d in placed.items() if d.startswith("RPC"))
    assert on_peer == list(range(n_layer - 2)), placed
    assert placed[str(n_layer)] == "CPU"


def test_peer_layers_refused_without_a_split(make_engine):
    with pytest.raises(ValueError, match="peer_layers needs"):
        make_engine(n_parallel=2, peer_layers=1)
