"""Fast unit tests: sampling parameters, configuration, slot choice."""

import numpy as np
import pytest
from pydantic import ValidationError

from engine.config import EngineConfig
from engine.prefix import common_prefix
from engine.sampling import SamplingParams
from engine.scheduler import choose_slot
from engine.slots import SlotView


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -0.1},
        {"temperature": 2.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"max_tokens": -3},
        {"min_p": 1.5},
        {"presence_penalty": 3},
        {"logit_bias": {5: 101.0}},
        {"logit_bias": {-1: 1.0}},
        {"seed": -5},
        {"unknown": 1},
    ],
)
def test_sampling_params_refuse_out_of_range(kw):
    with pytest.raises(ValidationError):
        SamplingParams(**kw)


def test_sampling_params_defaults_and_greedy():
    assert SamplingParams(temperature=0).is_plain_greedy
    assert not SamplingParams(temperature=0, repeat_penalty=1.1).is_plain_greedy
    assert not SamplingParams(temperature=0.7).is_plain_greedy
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=None).stop == ()


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"pipeline_groups": 3, "n_parallel": 2}, "exceeds n_parallel"),
        ({"pipeline_groups": 3, "n_parallel": 8}, "multiple of pipeline_groups"),
        ({"pipeline_groups": 0}, "greater than or equal to 1"),
        ({"n_ctx": 64, "n_parallel": 16}, "under 8 tokens per slot"),
    ],
)
def test_config_refuses_bad_groups(kw, msg):
    with pytest.raises(ValidationError, match=msg):
        EngineConfig(model="m.gguf", **kw)


def test_config_partition():
    c = EngineConfig(model="m.gguf", n_ctx=8192, n_parallel=8, pipeline_groups=2, sample_threads=4)
    assert c.n_slots_per_group == 4
    assert c.n_ctx_per_group == 4096
    assert c.sample_threads_per_group() == 2
    assert EngineConfig(model="m", n_parallel=4, pipeline_groups=4, sample_threads=2).sample_threads_per_group() == 1


def view(i: int, tokens: list[int], group: int = 0, seq_id: int | None = None) -> SlotView:
    seq = i if seq_id is None else seq_id
    return SlotView(i, group, seq, "idle", len(tokens), None, np.asarray(tokens, dtype=np.int32))


def test_common_prefix():
    a = np.array([1, 2, 3, 4], np.int32)
    assert common_prefix(a, np.array([1, 2, 9], np.int32)) == 2
    assert common_prefix(a, a[:2]) == 2
    assert common_prefix(a, np.array([], np.int32)) == 0


def test_choose_slot_by_longest_common_prefix():
    views = [view(0, [1, 2]), view(1, [1, 2, 3, 4]), view(2, [])]
    prompt = np.array([1, 2, 3, 4, 5], np.int32)
    assert choose_slot(views, prompt, {}, 0.1).id == 1


def test_choose_slot_lru_when_no_prefix():
    views = [view(0, [7]), view(1, [8]), view(2, [9])]
    prompt = np.array([1, 2, 3], np.int32)
    assert choose_slot(views, prompt, {0: 5.0, 1: 1.0, 2: 3.0}, 0.1).id == 1


def test_choose_slot_lru_when_prefix_below_similarity():
    views = [view(0, [1] + [0] * 10), view(1, [])]
    prompt = np.array([1] + [5] * 99, np.int32)
    assert choose_slot(views, prompt, {0: 9.0, 1: 1.0}, 0.1).id == 1


def test_choose_slot_spreads_empty_slots_over_groups():
    # two groups of four slots, nothing cached: the first request goes to group 0, the second
    # to group 1 (not slot 1 of group 0 as lowest id or LRU order would have it)
    views = [view(i, [], group=i // 4, seq_id=i % 4) for i in range(8)]
    prompt = np.array([1, 2, 3], np.int32)
    assert choose_slot(views, prompt, {}, 0.1, {}).id == 0
    assert choose_slot(views[1:], prompt, {}, 0.1, {0: {0}}).group == 1


def test_choose_slot_prefers_less_busy_group_among_near_equal_prefixes():
    shared = list(range(100, 300))  # a 200-token system prompt cached everywhere
    views = [view(1, shared + [5], group=0, seq_id=1), view(5, shared + [6], group=1, seq_id=1)]
    prompt = np.asarray(shared + [7, 8, 9], np.int32)
    assert choose_slot(views, prompt, {}, 0.1, {0: {0, 2}, 1: set()}).id == 5
    assert choose_slot(views, prompt, {}, 0.1, {0: set(), 1: {0, 2}}).id == 1
    # a much longer prefix still wins over balance
    long_prompt = np.asarray(shared[:20] + [7, 8, 9], np.int32)
    views2 = [view(1, shared[:20] + [7, 8], group=0, seq_id=1), view(5, shared[:5], group=1, seq_id=1)]
    assert choose_slot(views2, long_prompt, {}, 0.1, {0: {0, 2}, 1: set()}).id == 1


def test_choose_slot_keeps_busy_sequences_consecutive():
    # group 0 runs sequences 0 and 2: sequence 1 joins them into one run; LRU would pick 3
    views = [view(1, [], seq_id=1), view(3, [], seq_id=3)]
    prompt = np.array([1, 2], np.int32)
    assert choose_slot(views, prompt, {3: 0.0, 1: 9.0}, 0.1, {0: {0, 2}}).id == 1


def _entries(spec: list[tuple[int, int]]) -> list:
    from engine.batching import Entry

    return [Entry(None, seq, 0, [0] * n, True) for seq, n in spec]


def test_count_ubatches_follows_llama_cpp_split_rules():
    from engine.batching import count_ubatches, order_entries

    decode = _entries([(3, 1), (0, 1), (2, 1), (1, 1)])  # the order slots became busy
    assert count_ubatches(decode, 512, unified=False) == 3  # [3], [0] ... cut at every descent
    assert count_ubatches(order_entries(decode), 512, unified=False) == 1
    gap = order_entries(_entries([(0, 1), (1, 1), (3, 1), (4, 1)]))
    assert count_ubatches(gap, 512, unified=False) == 2  # a free sequence id splits the run
    assert count_ubatches(gap, 512, unified=True) == 1
    # a prompt chunk beside decode rows: one token rides with them, the rest is its own ubatch
    mixed = order_entries(_entries([(0, 1), (1, 40), (2, 1)]))
    assert count_ubatches(mixed, 512, unified=False) == 2
    assert count_ubatches(_entries([(0, 600)]), 512, unified=True) == 2


def test_app_args_refuse_unsafe_rpc_bind_and_bad_groups():
    from deployments.args import AppArgs, RpcArgs

    for wildcard in ("0.0.0.0", "0", "0.0", "000.0.0.0", "::", "[::]", "0:0::0", " "):
        with pytest.raises(ValidationError, match="unauthenticated"):
            RpcArgs(host=wildcard)
    for private in ("10.0.0.2", "127.0.0.1", "fe80::1", "peer-node"):
        assert RpcArgs(host=private).host == private
    assert RpcArgs(host="0.0.0.0", allow_all_interfaces=True).host == "0.0.0.0"
    with pytest.raises(ValidationError, match="multiple of pipeline_groups"):
        AppArgs(n_parallel=6, pipeline_groups=4).engine_config([])
    with pytest.raises(ValidationError):
        AppArgs(unknown_key=1)
    cfg = AppArgs(n_parallel=8, pipeline_groups=2, rpc={"port": 50999}).engine_config(["127.0.0.1:50999"])
    assert cfg.rpc_endpoints == ["127.0.0.1:50999"] and cfg.n_slots_per_group == 4


def test_sse_events_encode_as_openai_chunks():
    import json as _json

    from deployments.api.openai import SseEvents

    for kind in ("completion", "chat"):
        ev = SseEvents("id-1", kind, "m", include_usage=True)
        raw = ev.chunk('a "quoted" é\n', None)
        assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
        d = _json.loads(raw[6:])
        assert d["id"] == "id-1" and d["model"] == "m" and d["usage"] is None
        c = d["choices"][0]
        assert c["finish_reason"] is None and c["index"] == 0
        text = c["delta"]["content"] if kind == "chat" else c["text"]
        assert text == 'a "quoted" é\n'
        assert d["object"] == ("chat.completion.chunk" if kind == "chat" else "text_completion")
        last = _json.loads(ev.chunk("x", "stop")[6:])
        assert last["choices"][0]["finish_reason"] == "stop"


def test_app_args_are_the_engine_config_plus_the_deployments_keys(monkeypatch):
    from deployments.args import AppArgs
    from engine import EngineConfig

    monkeypatch.setenv("PGROUPS_PROFILE", "1")
    a = AppArgs()
    cfg = a.engine_config(["10.0.0.2:50052"])
    assert cfg.profile  # the environment switch reaches the served path
    for name in EngineConfig.model_fields:
        if name != "model":
            assert getattr(cfg, name) == getattr(a, name) or name == "rpc_endpoints", name
        assert AppArgs.model_fields[name].description, name
    assert cfg.rpc_endpoints == ["10.0.0.2:50052"]
    assert cfg.n_parallel == EngineConfig(model="m").n_parallel
    assert set(AppArgs.model_fields) - set(EngineConfig.model_fields) == {
        "rpc", "api_key", "request_timeout_s", "max_body_bytes", "stage_timeout_s", "placement", "replicas",
        "allow_unauthenticated", "strict_request_fields", "topology", "body_timeout_s", "min_body_rate",
        "max_requests_per_client", "cors_origins", "allowed_hosts"}


def test_token_logprobs_are_a_log_softmax_with_the_top_alternatives():
    from engine.sampling import token_logprobs

    rng = np.random.default_rng(0)
    row = (rng.standard_normal(5000) * 4).astype(np.float32)
    ref = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64)).sum())
    lp, top = token_logprobs(row, 17, 5)
    assert abs(lp - ref[17]) < 1e-4
    assert [t for t, _ in top] == list(np.argsort(ref)[::-1][:5])
    assert all(abs(v - ref[t]) < 1e-4 for t, v in top)
    assert token_logprobs(row, 3, 0)[1] == []


def test_the_expositions_of_several_replicas_merge_into_one():
    from prometheus_client.parser import text_string_to_metric_families

    from observability.metrics import merge_exposition

    def one(replica: str, v: int) -> bytes:
        return (f'# HELP pg_tokens_total Tokens.\n# TYPE pg_tokens_total counter\npg_tokens_total{{replica="{replica}"}} {v}\n'
                f'# HELP pg_up Up.\n# TYPE pg_up gauge\npg_up{{replica="{replica}"}} 1\n').encode()

    merged = merge_exposition([one("a", 3), one("b", 5)]).decode()
    assert merged.count("# TYPE pg_tokens_total") == 1 and merged.count("# HELP pg_up") == 1
    fams = {f.name: f for f in text_string_to_metric_families(merged)}
    assert sorted((s.labels["replica"], s.value) for s in fams["pg_tokens"].samples if s.name.endswith("_total")) == \
        [("a", 3.0), ("b", 5.0)]
    assert len(fams["pg_up"].samples) == 2


def test_the_http_layer_never_loads_llama_cpp():
    """The ingress and the app builder read requests and configs without native code (their
    processes never map llama.cpp)."""
    import subprocess
    import sys

    code = ("import sys, deployments.ingress, deployments.app, engine.config, engine\n"
            "engine.SamplingParams, engine.RequestError, engine.Output\n"
            "assert 'llama_cpp' not in sys.modules, sorted(m for m in sys.modules if m.startswith('engine'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
