"""Fast unit tests: sampling parameters, configuration, slot choice."""

import numpy as np
import pytest
from pydantic import ValidationError

from engine.config import EngineConfig
from engine.sampling import SamplingParams
from engine.slots import SlotView, choose_slot, common_prefix


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -0.1},
        {"temperature": 2.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"max_tokens": 0},
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


def view(i: int, tokens: list[int]) -> SlotView:
    return SlotView(i, 0, i, "idle", len(tokens), None, np.asarray(tokens, dtype=np.int32))


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


def test_app_args_refuse_unsafe_rpc_bind_and_bad_groups():
    from deployments.app import AppArgs, RpcArgs

    with pytest.raises(ValidationError, match="unauthenticated"):
        RpcArgs(host="0.0.0.0")
    assert RpcArgs(host="0.0.0.0", allow_all_interfaces=True).host == "0.0.0.0"
    with pytest.raises(ValidationError, match="multiple of pipeline_groups"):
        AppArgs(n_parallel=6, pipeline_groups=4).engine_config([])
    with pytest.raises(ValidationError):
        AppArgs(unknown_key=1)
    cfg = AppArgs(n_parallel=8, pipeline_groups=2, rpc={"port": 50999}).engine_config(["127.0.0.1:50999"])
    assert cfg.rpc_endpoints == ["127.0.0.1:50999"] and cfg.n_slots_per_group == 4
