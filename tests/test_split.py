"""The layer split over a ggml RPC stage (a server process on loopback), without Ray.

Two contexts on one RPC endpoint share one connection; the engine disables llama.cpp's
graph reuse by default so that one context can never recompute the other's graph. These
tests hold the result: greedy output over the split is byte-identical for N = 1, 2 and 4
groups and to the unsplit model, under concurrent load, over many steps.
"""

from __future__ import annotations

import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import SamplingParams
from tests.conftest import RPC_PORT
from tests.link import CountingLink

# the engine's own assertions, run on a GPU too (bench/device/run.sh: `pytest -m gpu`)
pytestmark = pytest.mark.gpu

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
        make_engine(n_parallel=2, rpc_endpoints=[rpc_endpoint], devices=["CPU", "GPU7"])


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
    rpc = rpc_first.devices[0]  # the endpoint's device name (RPC<n>, in the process's order of registration)
    rpc_first.close()
    local_first = make_engine(
        n_parallel=4, n_ctx=2048, pipeline_groups=2, rpc_endpoints=[rpc_endpoint], devices=["CPU", rpc]
    )
    assert local_first.devices == ["CPU", rpc]
    assert [local_first.generate(p, P).text for p in PROMPTS[:4]] == a


def test_tensor_split_moves_layers(make_engine, rpc_endpoint):
    e = make_engine(n_parallel=2, rpc_endpoints=[rpc_endpoint], tensor_split=[1.0, 3.0])
    assert e.generate("hello", P).final.completion_tokens == 48


def test_peer_layers_puts_exactly_that_many_layers_on_the_peer(make_engine, rpc_endpoint, model_path, caplog):
    import re

    from engine.native.model import Model

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


def test_a_shared_prefix_is_copied_on_the_peer_not_over_the_link(make_engine):
    """The copy of a prefix's KV on the peer is the RPC server's own: what crosses the link for
    a request that copies 300 tokens' KV is what crosses for one that reuses its own cache,
    give or take the copy commands, far under the KV it copies. Output as without sharing."""
    from deployments.stage import server as rpc_server
    from engine.types import Request

    port = RPC_PORT + 7
    proc = rpc_server.launch("127.0.0.1", port, threads=1)
    link = CountingLink(port)
    system = [(7 * i + 3) % 4000 + 10 for i in range(300)]
    one = SamplingParams(temperature=0, max_tokens=1)

    def on(e, slot: int, tail: list[int]) -> tuple[int, object]:
        r: Request = e.make_request(system + tail, one)
        r.id_slot = slot
        q = e.outputs.register(r.id)
        before = link.sent
        e.submit(r)
        while (o := q.get(timeout=60)).finish_reason is None:
            pass
        return link.sent - before, o

    e = None
    try:
        e = make_engine(n_parallel=4, n_ctx=4096, rpc_endpoints=[f"127.0.0.1:{link.port}"])
        on(e, 0, [1, 2, 3, 4, 5])
        copied, a = on(e, 1, [6, 7, 8, 9, 10])  # slot 1 takes slot 0's prefix
        own, b = on(e, 1, [11, 12, 13, 14, 15])  # slot 1 reuses its own
        assert a.cached_tokens == b.cached_tokens == len(system) and e.groups[0].prefix.n_copied == len(system)
        # the prefix's f16 K and V in a single layer of the synthetic model (2 KV heads of 64)
        one_layer_kv = len(system) * 2 * 128 * 2
        assert own > 0 and copied - own < one_layer_kv / 4, (copied, own, one_layer_kv)
        plain = make_engine(n_parallel=4, n_ctx=4096, share_prefix=False)
        assert plain.generate(system + [6, 7, 8, 9, 10], one).text == a.text
    finally:
        if e is not None:
            e.close()  # before its server goes: ggml aborts on a dead connection's buffers
        link.close()
        proc.kill()
        proc.wait()


def moe_model(tmp_path):
    """Two layers of 8 f16 experts: each expert tensor 12.6 MB, over the RPC hash threshold."""
    from tests.models.synthetic import ModelShape, write_model

    shape = ModelShape(n_layer=2, n_embd=512, n_head=4, n_head_kv=2, n_ff=1536, n_vocab=1024, n_expert=8,
                       n_expert_used=2, seed=11)
    path = write_model(tmp_path / "moe.gguf", shape)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # written back, as a GGUF on disk is: the kernel drops only clean pages
    os.close(fd)
    return path


def test_the_peers_weights_leave_the_local_page_cache(tmp_path, rpc_endpoint):
    """Once sent, the peer's layers are no longer held on the local node: not in the engine's
    mappings, not in the page cache; the local layer's pages stay; the text is unchanged."""
    from engine import Engine, EngineConfig
    from engine.native.page_cache import resident_bytes, tensor_ranges

    model = str(moe_model(tmp_path))
    cfg = dict(model=model, n_parallel=1, n_ctx=512, n_threads=1)
    alone = Engine(EngineConfig(**cfg))
    want = alone.generate([1, 300, 301, 302], P).text
    alone.close()
    e = Engine(EngineConfig(**cfg, peer_layers=1, rpc_endpoints=[rpc_endpoint]))
    try:
        peer, local = tensor_ranges(model, ("blk.0.",)), tensor_ranges(model, ("blk.1.",))
        assert e.model.layer_devices[0].startswith("RPC") and e.model.layer_devices[1] == "CPU"
        assert e.model.released_bytes > 3 * 8 * 1536 * 512 * 2 * 0.99
        assert e.generate([1, 300, 301, 302], P).text == want
        # what stays is the pages a peer tensor shares with a neighbour (norms of 2 KB)
        assert resident_bytes(model, peer) < sum(b - a for a, b in peer) / 100, resident_bytes(model, peer)
        assert resident_bytes(model, local) > sum(b - a for a, b in local) * 0.9
    finally:
        e.close()


def test_a_warm_tensor_cache_sends_hashes_not_weights(tmp_path):
    """With the stage's tensor cache (``rpc.cache_dir``), a second load of the same model sends
    each large weight's hash instead of its bytes: the first load carries the peer's experts
    (three tensors of 12.6 MB), the second a small part of them; the text is the same."""
    from deployments.stage import server as rpc_server
    from engine import Engine, EngineConfig

    model = moe_model(tmp_path)
    experts = 3 * 8 * 1536 * 512 * 2  # the peer's layer: gate, up and down experts, f16
    cache = tmp_path / "cache"
    port = RPC_PORT + 8
    proc = rpc_server.launch("127.0.0.1", port, threads=1, cache_dir=rpc_server.private_dir(str(cache)))
    link = CountingLink(port)
    sent, texts = [], []
    try:
        for _ in range(2):
            before = link.sent
            e = Engine(EngineConfig(model=str(model), n_parallel=1, n_ctx=512, n_threads=1, peer_layers=1,
                                    rpc_endpoints=[f"127.0.0.1:{link.port}"]))
            texts.append(e.generate([1, 300, 301, 302], P).text)
            e.close()
            sent.append(link.sent - before)
        assert sent[0] > experts, sent
        assert sent[1] < experts / 10, sent
        assert len(list(cache.iterdir())) == 3 and texts[0] == texts[1]
    finally:
        link.close()
        proc.kill()
        proc.wait()


def test_the_process_holds_one_ggml_and_a_model_without_devices_stays_local(make_engine, rpc_endpoint, model_path):
    """The engine's own ggml calls go to the copy libllama uses: pip's wheel has each library
    three times (``.so``, ``.so.0``, ``.so.0.x``) and opening the plain name loaded a second ggml
    (its own device registry, logger and buffer types) into the process, where a GPU load
    crashed. One registry means an RPC server registered for one engine is seen by every later
    load in the process: a model loaded without devices still gets only this node's."""
    from engine.native.devices import list_devices
    from engine.native.model import Model

    split = make_engine(n_parallel=1, rpc_endpoints=[rpc_endpoint])
    assert split.model.layer_devices[0].startswith("RPC")
    libs = [line.rsplit(maxsplit=1)[-1] for line in open("/proc/self/maps") if "/libggml" in line]
    by_name: dict[str, set[str]] = {}
    for path in libs:
        by_name.setdefault(os.path.basename(path).split(".so")[0], set()).add(path)
    assert by_name and all(len(paths) == 1 for paths in by_name.values()), by_name
    assert any(d.name.startswith("RPC") for d in list_devices(memory=False))  # the one registry has it
    m = Model(model_path)
    try:
        assert m.layer_devices and not any(d.startswith("RPC") for d in m.layer_devices.values()), m.layer_devices
    finally:
        m.close()


def test_an_rpc_server_is_not_started_on_a_port_another_process_listens_on(rpc_endpoint):
    """A port taken (an RPC server left running) is refused by name, not taken for the new
    server: that one could not bind it, and the engine would talk to the other."""
    from deployments.stage import server as rpc_server

    with pytest.raises(RuntimeError, match="taken"):
        rpc_server.launch("127.0.0.1", RPC_PORT, threads=1)
