"""MTP drafting per group: the model's own next-token head drafts, the target verifies.

Two synthetic hy_v3 models with one MTP layer: one whose head agrees with the model by
construction (every draft accepted) and one whose head is random (drafts rejected, the
rollback exercised). Greedy output is the same with MTP on and off, for 1, 2 and 4 groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pydantic import ValidationError

from engine import Engine, EngineConfig, SamplingParams
from engine.config import SpeculativeConfig
from engine.speculation.mtp import PairedKv, pairs
from tests.conftest import RPC_PORT, engine_factory
from tests.link import CountingLink
from tests.models.synthetic import ModelShape, write_mtp_model
from tests.test_speculative import check_kv, run

SHAPE = ModelShape(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=1024, seed=11)
MTP = {"type": "mtp", "n_max": 4, "p_min": 0.0, "max_rows": 8}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPTS = ["the king said hello to the world", "a dog and a cat went to the house number 12", "hello"]


@pytest.fixture(scope="session")
def mtp_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("mtp")
    return {head: str(write_mtp_model(d / f"{head}.gguf", SHAPE, head=head)) for head in ("agree", "random")}


@pytest.fixture
def make_mtp(mtp_models):
    """``make(head, **config)``: an engine on the agreeing (or random) MTP model."""
    engines = []

    def make(head: str = "agree", **kw):
        e = Engine(EngineConfig(**{"model": mtp_models[head], "n_threads": 1, "n_ctx": 4096, **kw}))
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()


def totals(e) -> tuple[int, int, int]:
    ps = e.profiles()
    return sum(p.drafts for p in ps), sum(p.drafted for p in ps), sum(p.accepted for p in ps)


def pinned(e, prompt: str, slot: int) -> list[int]:
    """Greedy tokens of ``prompt`` run on slot ``slot``."""
    r = e.make_request(prompt, GREEDY)
    r.id_slot = slot
    q = e.outputs.register(r.id)
    e.submit(r)
    toks = []
    while (o := q.get(timeout=60)).finish_reason is None:
        toks.extend(o.tokens)
    return toks + list(o.tokens)


def check_mtp_kv(e) -> None:
    """The MTP context of every group holds the positions its target context holds."""
    check_kv(e)
    for g in e.groups:
        for s in g.slots:
            assert g.runner.mtp.ctx.seq_pos_max(s.seq_id) == g.ctx.seq_pos_max(s.seq_id), s.id


# ---- units ------------------------------------------------------------------------------------


def test_each_row_is_paired_with_the_state_of_the_position_before_it():
    h = np.arange(7 * 2, dtype=np.float32).reshape(7, 2)  # row k's state: [2k, 2k + 1]
    pending = {5: np.array([-1.0, -1.0], np.float32)}
    zero = np.zeros(2, np.float32)
    # sequence 5: rows 0..3 (a pending state from the step before); sequence 2: rows 4..6 (none)
    got = pairs([(5, 0, 4), (2, 4, 3)], h, pending, zero)
    assert got.tolist() == [[-1, -1], [0, 1], [2, 3], [4, 5], [0, 0], [8, 9], [10, 11]]


class Recorder:
    """A context's sequence operations, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def seq_rm(self, *a) -> bool:
        self.calls.append(("rm", *a))
        return True

    def seq_cp(self, *a) -> None:
        self.calls.append(("cp", *a))


def test_the_carried_state_follows_every_cut_and_copy_of_the_kv():
    target, mtp = Recorder(), Recorder()
    kv = PairedKv(target, mtp)
    kv.h = np.arange(6, dtype=np.float32).reshape(6, 1)  # row k's state: [k]
    kv.rows = {3: (2, 10, 4)}  # sequence 3: batch rows 2..5 at positions 10..13
    kv.pending[3] = kv.h[5]
    kv.seq_rm(3, 12)  # a rejected draft: the sequence ends at 11, batch row 3
    assert kv.pending[3].tolist() == [3.0] and target.calls == mtp.calls == [("rm", 3, 12, -1)]
    kv.seq_cp(3, 7)  # a whole stream: the same end
    assert kv.pending[7].tolist() == [3.0]
    kv.seq_cp(3, 8, 0, 11)  # a range up to position 10: batch row 2
    assert kv.pending[8].tolist() == [2.0]
    kv.seq_rm(8, 5)  # before what the last decode computed: no state at hand
    kv.seq_rm(7, 0)  # dropped
    assert 8 not in kv.pending and 7 not in kv.pending and 7 not in kv.rows


def test_mtp_takes_no_model_and_a_model_without_mtp_layers_is_refused(make_engine, model_path):
    with pytest.raises(ValidationError, match="takes no model"):
        SpeculativeConfig(type="mtp", model=model_path)
    with pytest.raises(ValueError, match="no MTP|has none"):
        make_engine(speculative={"type": "mtp"})


# ---- the engine -----------------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_greedy_output_is_the_same_with_mtp_on_and_off(make_mtp, groups):
    plain = make_mtp(n_parallel=4, pipeline_groups=groups)
    spec = make_mtp(n_parallel=4, pipeline_groups=groups, speculative=MTP)
    for p in PROMPTS:
        want = run(plain, p, GREEDY)
        got = run(spec, p, GREEDY)
        assert got[0] == want[0] and got[1] == want[1]
        assert got[2].completion_tokens == 40
        check_mtp_kv(spec)
    drafts, drafted, accepted = totals(spec)
    # the head agrees with the model: every draft is accepted, several tokens per step
    assert drafted > 0 and accepted == drafted, (drafted, accepted)
    assert sum(p.steps for p in spec.profiles()) < sum(p.steps for p in plain.profiles()) / 2


def test_seeded_sampling_gives_the_same_tokens_with_mtp(make_mtp):
    seeded = SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True)
    plain = make_mtp(n_parallel=2)
    spec = make_mtp(n_parallel=2, speculative=MTP)
    for p in PROMPTS:
        assert run(spec, p, seeded)[0] == run(plain, p, seeded)[0]
    assert totals(spec)[2] > 0  # some drafts were accepted while sampling


def test_a_random_head_is_rejected_and_rolled_back_without_changing_the_output(make_mtp):
    plain = make_mtp("random", n_parallel=4)
    spec = make_mtp("random", n_parallel=4, speculative=MTP)
    for p in PROMPTS:
        assert run(spec, p, GREEDY)[0] == run(plain, p, GREEDY)[0]
        check_mtp_kv(spec)
    drafts, drafted, accepted = totals(spec)
    assert drafts > 0 and accepted < drafted / 4, (drafts, drafted, accepted)


def test_concurrent_rows_draft_together_and_keep_their_own_output(make_mtp):
    """Four rows in one batch, over two groups, with a random head (rejections) and the
    agreeing one: each stream is what it is alone without speculation."""
    prompts = [p + " again" for p in [*PROMPTS, "one more"]]
    for head in ("agree", "random"):
        plain = make_mtp(head, n_parallel=4)
        want = [run(plain, p, GREEDY)[0] for p in prompts]
        spec = make_mtp(head, n_parallel=4, pipeline_groups=2, speculative=MTP)
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda p, e=spec: run(e, p, GREEDY)[0], prompts))
        assert got == want
        check_mtp_kv(spec)
        assert all(p.drafted > 0 for p in spec.profiles())  # both groups drafted


@pytest.mark.parametrize("kv_unified", [False, True])
def test_shared_prefixes_and_n_choices_carry_the_mtp_state(make_mtp, kv_unified):
    """A prompt that copies another slot's prefix, and n = 3 choices whose followers copy the
    leader's prompt: their MTP KV is copied with the target's, output as without MTP, and
    drafts are still accepted after the copy."""
    system = "the king said hello to the world " * 12
    plain = make_mtp(n_parallel=4)
    spec = make_mtp(n_parallel=4, speculative=MTP, kv_unified=kv_unified)
    tails = ["and the queen", "and the dog", "and the house"]
    want = [run(plain, system + t, GREEDY)[0] for t in tails]
    # slot 1 copies slot 0's finished prefix; then slots 2 and 3 arrive together, and 3 waits
    # for the prefix on its way in 2
    assert pinned(spec, system + tails[0], 0) == want[0]
    assert pinned(spec, system + tails[1], 1) == want[1]
    with ThreadPoolExecutor(2) as ex:
        both = list(ex.map(lambda a: pinned(spec, system + tails[a[0]], a[1]), [(2, 2), (2, 3)]))
    assert both == [want[2], want[2]]
    assert spec.groups[0].prefix.n_copied > 0
    check_mtp_kv(spec)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    _, before, acc_before = totals(spec)
    outs = [c.text for c in spec.generate_n(system + "and the cat", greedy, 3)]
    want = run(plain, system + "and the cat", greedy)[1]
    assert all(t == want for t in outs), outs
    _, drafted, accepted = totals(spec)
    assert drafted > before and accepted - acc_before == drafted - before
    check_mtp_kv(spec)


def test_a_restored_slot_brings_its_mtp_state_back(make_mtp, tmp_path):
    spec = make_mtp(n_parallel=1, speculative=MTP, slot_save_path=str(tmp_path))
    prompt = "a dog and a cat went to the house number 12 " * 4
    first = run(spec, prompt, GREEDY)[0]
    saved = spec.slot_action(0, "save", "s.bin")
    assert saved["n_saved"] > 0 and (tmp_path / "s.bin.mtp").is_file()
    spec.slot_action(0, "erase", None)
    spec.slot_action(0, "restore", "s.bin")
    check_mtp_kv(spec)
    _, before, _ = totals(spec)
    again = run(spec, prompt, GREEDY)
    assert again[0] == first and again[2].cached_tokens > 0
    _, drafted, accepted = totals(spec)
    assert drafted > before and accepted == drafted
    # a file saved without its MTP state: the slot drafts nothing for it, the output is the same
    (tmp_path / "s.bin.mtp").unlink()
    spec.slot_action(0, "restore", "s.bin")
    assert spec.groups[0].runner.mtp.ctx.seq_pos_max(0) == -1
    assert run(spec, prompt, GREEDY)[0] == first


def test_the_mtp_head_runs_on_the_local_device_nothing_extra_crosses_the_link(make_mtp):
    """Over the layer split, the hidden states and the MTP layer stay on the local device:
    the link carries no more with MTP than without (here less: fewer steps for the same
    tokens), and the output is the same."""
    from deployments.stage import server as rpc_server

    port = RPC_PORT + 9
    proc = rpc_server.launch("127.0.0.1", port, threads=1)
    link = CountingLink(port)
    engines = []
    try:
        sent = {}
        toks = {}
        for label, kw in (("none", {}), ("mtp", {"speculative": MTP})):
            e = make_mtp(n_parallel=2, rpc_endpoints=[f"127.0.0.1:{link.port}"], **kw)
            engines.append(e)
            before = link.sent
            toks[label] = run(e, PROMPTS[0], GREEDY)[0]
            sent[label] = link.sent - before
            e.close()
        assert toks["mtp"] == toks["none"]
        assert 0 < sent["mtp"] <= sent["none"], sent
    finally:
        for e in engines:
            e.close()
        link.close()
        proc.kill()
        proc.wait()


def test_metrics_report_drafted_and_accepted_per_group_and_under_llama_servers_names(make_mtp):
    from prometheus_client.parser import text_string_to_metric_families

    from observability.metrics import EngineMetrics

    spec = make_mtp("random", n_parallel=4, pipeline_groups=2, speculative=MTP)
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda p: run(spec, p, GREEDY), PROMPTS[:2]))
    drafts, drafted, accepted = totals(spec)
    m = EngineMetrics("mtp", "0")
    m.collect_engine(spec, 0, 0)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}

    def total(name: str) -> float:
        return sum(s.value for s in fams[name].samples if s.name.endswith("_total"))

    assert total("llamacpp:spec_decode_num_draft_tokens") == drafted > 0
    assert total("llamacpp:spec_decode_num_accepted_tokens") == accepted
    assert total("llamacpp:spec_decode_num_drafts") == drafts > 0
    per_group = {s.labels["group"]: s.value for s in fams["pgroups_group_spec_drafted_tokens"].samples
                 if s.name.endswith("_total")}
    assert set(per_group) == {"0", "1"} and sum(per_group.values()) == drafted


def test_no_drafts_above_max_rows(make_mtp):
    """Four rows generating in one group with max_rows 1: the group drafts only in the steps
    where at most one row generates (as the load starts and drains)."""
    spec = make_mtp(n_parallel=4, speculative={**MTP, "max_rows": 1})
    prompts = [p + " again" for p in [*PROMPTS, "one more"]]
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda p: run(spec, p, GREEDY), prompts))
    drafts, _, _ = totals(spec)
    steps = sum(p.steps for p in spec.profiles())
    assert drafts < steps / 3, (drafts, steps)
    busy = make_mtp(n_parallel=4, speculative={**MTP, "max_rows": 4})
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda p: run(busy, p, GREEDY), prompts))
    assert totals(busy)[0] > 3 * drafts  # the same load under a higher threshold drafts
    assert make_mtp(n_parallel=1, speculative={**MTP, "max_rows": 0}).groups[0].runner.mtp is None


# ---- the families' own MTP blocks ------------------------------------------------------------------


@pytest.fixture
def make_glm(tmp_path) -> Iterator[Callable[..., Engine]]:
    """Engines on the tiny ``glm4moe`` with its MTP block."""
    from tests.models.families import write_family

    path = str(write_family(tmp_path / "glm4moe-mtp.gguf", "glm4moe", mtp=True, trunk=0.3))
    yield from engine_factory(model=path, n_parallel=4, n_ctx=4096, n_threads=1, repack=False)


def test_glm_s_mtp_block_drafts_on_the_split_with_two_groups_and_keeps_the_output(make_glm, rpc_endpoint):
    """GLM-4.5 / 4.6's MTP block (an MoE decoder layer, as its checkpoints carry it) on the tiny
    ``glm4moe``: drafts accepted and rejected, greedy as without them, four rows at once over two
    groups on the split. (Qwen3.5's, on a hybrid: tests/test_speculative_hybrid.py.)"""
    prompts = [f"the {w} of the pipeline node number {i} said" for i, w in enumerate(["king", "queen", "dog", "cat"])]
    plain = make_glm()
    want = [run(plain, p, GREEDY)[0] for p in prompts]
    spec = make_glm(pipeline_groups=2, rpc_endpoints=[rpc_endpoint], peer_layers=2, speculative=MTP)
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda p: run(spec, p, GREEDY)[0], prompts))
    assert got == want
    check_mtp_kv(spec)
    _, drafted, accepted = totals(spec)
    assert 0 < accepted < drafted, (drafted, accepted)
