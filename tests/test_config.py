"""Configuration as users write it: sampling parameters, the engine's config and the app's
arguments (no model, no Ray)."""

import pytest
from pydantic import ValidationError

from deployments.args import AppArgs, RpcArgs
from engine.config import EngineConfig
from engine.sampling import SamplingParams


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


def test_app_args_refuse_unsafe_rpc_bind_and_bad_groups():
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


def test_app_args_are_the_engine_config_plus_the_deployments_keys(monkeypatch):
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
        "rpc", "api_key", "cache_salt_by_key", "request_timeout_s", "max_body_bytes", "stage_timeout_s", "stage_stall_factor",
        "stage_stall_floor_s", "resume_limit", "resume_wait_s", "placement", "replicas",
        "allow_unauthenticated", "strict_request_fields", "topology", "body_timeout_s", "min_body_rate",
        "max_requests_per_client", "cors_origins", "allowed_hosts", "head_timeout_s", "keep_alive_timeout_s",
        "max_head_bytes", "max_connections", "max_connections_per_client"}


def test_every_shipped_config_serves_directly_and_every_node_gets_serves_tuning():
    """The shipped Serve configs run no Serve proxy (the ingress serves HTTP itself), and the
    ray up configs start every node with the Serve settings the local cluster uses."""
    from pathlib import Path

    import yaml

    from cluster.local_cluster import SERVE_TUNING, tuned_env

    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / "deployments" / "configs").glob("*.yaml")):
        assert yaml.safe_load(path.read_text())["proxy_location"] == "Disabled", path.name
    for name in ("two-sparks.yaml", "four-sparks.yaml"):
        cfg = yaml.safe_load((root / "cluster" / name).read_text())
        for key in ("head_start_ray_commands", "worker_start_ray_commands"):
            start = next(c for c in cfg[key] if "ray start" in c)
            for k, v in SERVE_TUNING.items():
                assert f"{k}={v}" in start, (name, key, k)
    assert tuned_env({"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"})["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"


def test_salting_by_key_needs_keys_and_a_key_list_holds_no_empty_key():
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="set api_key"):
        AppArgs(cache_salt_by_key=True)
    with pytest.raises(ValidationError, match="non-empty"):
        AppArgs(api_key=["a", ""])
    assert AppArgs(api_key=["a", "b"], cache_salt_by_key=True).cache_salt_by_key
