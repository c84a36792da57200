"""Real clients, unchanged: the bodies llama-server's own clients send (kept as fixtures in
tests/fixtures/clients.json, each naming the source file it was read from), OpenAI's types
with nulls, clients left at their default model name, llama-server's routes, fields, timings,
probabilities and metric names."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_http_api import APP
from tests.models.synthetic import ModelShape, write_model

FIXTURES = {k: v for k, v in json.loads((Path(__file__).parents[1] / "fixtures" / "clients.json").read_text()).items()
            if not k.startswith("_")}


@pytest.fixture(scope="module")
def base(deploy) -> str:
    """The API app on a synthetic model that carries FIM tokens (for /infill), with embeddings;
    slots of 2,048 tokens, which dspy's JSON prompts need."""
    path = Path(__file__).parents[2] / "models" / "synthetic-fim.gguf"
    if not path.exists():
        write_model(path, ModelShape(fim=True))
    return deploy({**APP, "model": str(path), "embeddings": True, "n_ctx": 8192})


def sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_a_clients_own_body_is_served(base, name):
    fx = FIXTURES[name]
    body = {**fx["body"], **fx.get("test_overrides", {})}  # a short answer; the fields stay the client's
    with httpx.stream("POST", base + fx["path"], json=body, timeout=120) as r:
        assert r.status_code == 200, (name, r.read()[:300])
        if body.get("stream"):
            events = sse(r)
            assert events, name
            last = events[-1]
        else:
            last = json.loads(r.read())
    if fx["path"] in ("/infill", "/completion"):
        answers = last if isinstance(last, list) else [last]  # n_cmpl > 1: a list, as llama-server answers
        assert len(answers) == body.get("n_cmpl", 1)
        for a in answers:
            assert a["stop"] is True and "content" in a and a["generation_settings"]["n_ctx"] > 0, a
            assert a["timings"]["prompt_per_second"] >= 0 and a["tokens_predicted"] == body["n_predict"] or \
                a["stop_type"] != "limit", a
    else:
        assert "timings" in last and last["timings"]["predicted_n"] >= 1, last  # the web UI's statistics bar
        ended = [e for e in events if e["choices"]][-1] if body.get("stream") else last  # before a usage chunk
        assert ended["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), ended
        if body.get("stream"):  # Zed parses every chunk: model, object and choices in each, whole usage
            assert all({"model", "object", "choices"} <= e.keys() for e in events), events[:2]
            usage = [e["usage"] for e in events if e.get("usage")]
            assert all({"prompt_tokens", "completion_tokens", "total_tokens"} <= u.keys() for u in usage)
        if body.get("return_progress"):  # the web UI's prompt progress
            progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
            assert progress and progress[-1]["processed"] == progress[-1]["total"] > 0, events[:3]


def test_fields_sent_as_null_mean_their_default(base):
    body = {"messages": [{"role": "user", "content": "hi"}], "n": None, "stream": None, "max_tokens": 3,
            "temperature": None, "stop": None, "tools": None, "tool_choice": None, "response_format": None,
            "logprobs": None, "top_logprobs": None, "seed": None, "user": None}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


@pytest.mark.parametrize("model", ["gpt-4o-mini", "gpt-3.5-turbo", "whatever/any:latest"])
def test_any_model_name_serves_the_model(base, model):
    r = httpx.post(base + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_unknown_fields_are_ignored_and_counted(base):
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "frobnicate_7b": True}, timeout=60)
    assert r.status_code == 200, r.text
    text = httpx.get(base + "/metrics", timeout=30).text
    counts = {s.labels.get("field"): s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "pgroups_ignored_request_fields_total"}
    assert counts.get("frobnicate_7b", 0) >= 1, counts


def test_llama_servers_route_aliases_and_models_meta(base):
    assert httpx.get(base + "/v1/health").status_code == 200
    for path in ("/v1/models", "/models"):
        data = httpx.get(base + path, timeout=30).json()["data"]
        assert data[0]["meta"]["n_vocab"] > 0 and data[0]["meta"]["n_ctx_train"] > 0, data
    r = httpx.post(base + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    r = httpx.post(base + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


def test_completion_probabilities_with_n_probs(base):
    r = httpx.post(base + "/completion", json={"prompt": "hello", "n_predict": 3, "n_probs": 2, "ignore_eos": True},
                   timeout=60)
    probs = r.json()["completion_probabilities"]
    assert len(probs) == 3 and all(len(p["top_logprobs"]) == 2 and "id" in p and p["logprob"] <= 0 for p in probs)
    with httpx.stream("POST", base + "/completion", json={"prompt": "hello", "n_predict": 3, "n_probs": 1,
                                                          "ignore_eos": True, "stream": True}, timeout=60) as s:
        events = sse(s)
    assert sum(len(e.get("completion_probabilities", [])) for e in events) == 3


def test_the_agents_sdks_responses_body(base):
    # what the OpenAI Agents SDK's default model (OpenAIResponsesModel) sends for a plain agent
    body = {"model": "gpt-4.1", "input": [{"role": "user", "content": "hi"}], "instructions": "Be brief.",
            "include": [], "tools": [], "stream": False, "store": None, "top_p": None, "temperature": None,
            "truncation": None, "max_output_tokens": 4, "tool_choice": None, "parallel_tool_calls": None,
            "reasoning": None, "text": None, "metadata": None, "extra_headers": None}
    r = httpx.post(base + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["type"] == "output_text"


def test_llamacpp_metric_names_count_what_the_project_counts(base):
    httpx.post(base + "/v1/completions", json={"prompt": "count me", "max_tokens": 3, "ignore_eos": True}, timeout=60)
    values: dict[str, float] = {}
    for f in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        for s in f.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    assert values["llamacpp:tokens_predicted_total"] == values["pgroups_generation_tokens_total"] > 0
    assert values["llamacpp:prompt_tokens_total"] == \
        values["pgroups_prompt_tokens_total"] - values["pgroups_prompt_tokens_cached_total"]
    assert values["llamacpp:n_decode_total"] > 0 and "llamacpp:requests_processing" in values
    assert values["llamacpp:n_tokens_max"] >= 3 + 2  # the request above: its prompt and its 3 tokens


def test_a_reasoning_models_thinking_is_reasoning_content(base):
    """The synthetic model's output is forced by a grammar into DeepSeek's shape."""
    body = {"messages": [{"role": "user", "content": "think first"}], "reasoning_format": "deepseek", "max_tokens": 60,
            "grammar": 'root ::= "<think>" [a-z]{2,8} "</think>" [a-z]{2,8}'}
    msg = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"] and "<think>" not in msg["content"] + msg["reasoning_content"]
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        deltas = [e["choices"][0]["delta"] for e in sse(r) if e.get("choices")]
    thinking = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert thinking.isalpha() and content.isalpha(), deltas
    whole = httpx.post(base + "/v1/chat/completions", json={**body, "reasoning_format": "none"}, timeout=60).json()
    assert whole["choices"][0]["message"]["content"].startswith("<think>")


def test_embeddings_through_the_openai_sdk_and_llama_servers_route(base):
    import numpy as np
    from openai import OpenAI

    c = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    r = c.embeddings.create(model="text-embedding-3-small", input=["hello world", "another text"])  # base64 by default
    vecs = [np.asarray(d.embedding) for d in r.data]
    assert len(vecs) == 2 and all(abs(np.linalg.norm(v) - 1) < 1e-3 for v in vecs) and r.usage.prompt_tokens > 2
    floats = c.embeddings.create(model="x", input="hello world", encoding_format="float").data[0].embedding
    assert np.allclose(floats, vecs[0], atol=1e-5)
    native = httpx.post(base + "/embedding", json={"content": "hello world"}, timeout=60).json()
    assert np.allclose(native[0]["embedding"][0], vecs[0], atol=1e-5)
    assert httpx.post(base + "/v1/embeddings", json={"input": "x", "dimensions": 3}, timeout=60).status_code == 400


def test_post_sampling_probs_and_response_fields(base):
    body = {"prompt": "hello", "n_predict": 3, "n_probs": 2, "ignore_eos": True, "post_sampling_probs": True,
            "temperature": 1.0, "top_k": 2, "top_p": 1.0, "min_p": 0.0, "seed": 1}
    probs = httpx.post(base + "/completion", json=body, timeout=60).json()["completion_probabilities"]
    assert all(0 < p["prob"] <= 1 and 1 <= len(p["top_probs"]) <= 2 and "logprob" not in p for p in probs), probs
    picked = httpx.post(base + "/completion", json={**body, "response_fields": ["content", "timings/prompt_n"]},
                        timeout=60).json()
    assert set(picked) == {"content", "prompt_n"}, picked


# ---- each client's first use: discovery and settings, as its source reads them -----------------------

WEBUI_NUMBERS = ("temperature", "top_k", "top_p", "min_p", "dynatemp_range", "dynatemp_exponent", "xtc_probability",
                 "xtc_threshold", "typ_p", "repeat_last_n", "repeat_penalty", "presence_penalty", "frequency_penalty",
                 "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "max_tokens")


def test_llama_cpps_web_ui_syncs_its_settings_and_sizes_its_context(base):
    """tools/server/webui (ggml-org/llama.cpp): services/parameter-sync.service.ts at 23758f3b takes each
    setting from /props default_generation_settings.params when it is a number (samplers: a list it
    joins with ';'); services/slots.ts at 02a65364 reads /slots[0].n_ctx, else assumes 4,096."""
    props = httpx.get(base + "/props", timeout=30).json()
    params = props["default_generation_settings"]["params"]
    for k in WEBUI_NUMBERS:
        assert isinstance(params[k], int | float) and not isinstance(params[k], bool), (k, params.get(k))
    assert isinstance(params["samplers"], list) and all(isinstance(s, str) for s in params["samplers"])
    assert props["default_generation_settings"]["n_ctx"] == httpx.get(base + "/slots", timeout=30).json()[0]["n_ctx"]
    assert props["default_generation_settings"]["n_ctx"] != 4096 and isinstance(props["build_info"], str)
    # the app serves the synthetic projector: the web UI offers image attachments by this
    assert props["modalities"] == {"vision": True, "audio": False, "video": False} and props["total_slots"] > 0


def test_props_params_sent_back_are_served(base):
    """The web UI sends its settings, synced from /props default_generation_settings.params, back
    with each request: this server's params, and llama-server's (tests/test_deployment.py), sent
    whole through /completion and chat (streamed, as stream: true says; until the slot is full, as
    n_predict -1 says, so the stream is left once it runs) are served, and none is an unknown field."""
    from tests.test_deployment import LLAMA_SERVER_SLOT_PARAMS

    ours = httpx.get(base + "/props", timeout=30).json()["default_generation_settings"]["params"]
    assert ours["seed"] == 4294967295  # llama-server's "random"
    routes = (("/completion", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                          "content": "hi"}]}))
    for params in (ours, LLAMA_SERVER_SLOT_PARAMS):
        for path, extra in routes:
            with httpx.stream("POST", base + path, json={**params, **extra}, timeout=120) as r:
                assert r.status_code == 200, (path, r.read()[:300])
                first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: {"))[6:])
            assert "content" in first or first.get("choices"), (path, first)
    text = httpx.get(base + "/metrics", timeout=30).text
    ignored = {s.labels.get("field") for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pgroups_ignored_request_fields_total"}
    assert not ignored & (set(ours) | set(LLAMA_SERVER_SLOT_PARAMS)), ignored


def test_zeds_llama_cpp_provider_sees_tools_and_the_context(base):
    """crates/language_models/src/provider/llama_cpp.rs (zed-industries/zed at b304fe89): tools on when
    /props chat_template_caps.supports_tool_calls or .supports_tools; the context from
    default_generation_settings.n_ctx, else /v1/models meta.n_ctx."""
    props = httpx.get(base + "/props", timeout=30).json()
    caps = props["chat_template_caps"]
    assert caps["supports_tool_calls"] or caps["supports_tools"]
    model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]
    assert model["id"] and model["meta"]["n_ctx"] == props["default_generation_settings"]["n_ctx"] > 0


def test_open_webui_reads_the_speed_from_the_streams_usage(base):
    """backend/open_webui/utils/middleware.py (open-webui/open-webui at 000032ed): for each chunk,
    usage = data.get("usage") or {}; usage.update(data.get("timings", {})), kept as the last one seen
    (a "timings": null would raise there)."""
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 6,
            "stream_options": {"include_usage": True}}
    seen = None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
        for data in sse(r):
            usage = data.get("usage", {}) or {}
            usage.update(data.get("timings", {}))
            if usage:
                seen = usage
    assert seen is not None and seen["completion_tokens"] >= 1 and seen["predicted_per_second"] >= 0, seen


def test_sillytaverns_status_check_and_token_count(base):
    """src/endpoints/backends/text-completions.js and src/endpoints/tokenizers.js (SillyTavern at
    1ac6780e): the status is GET /v1/models' data[0].id; tokens are counted by POST /tokenize
    {content}, reading tokens.length."""
    ids = [m["id"] for m in httpx.get(base + "/v1/models", timeout=30).json()["data"]]
    assert ids and ids[0]
    r = httpx.post(base + "/tokenize", json={"content": "Hello there"}, timeout=30).json()
    assert len(r["tokens"]) >= 1


# ---- client libraries that read what llama-server writes, through their own code -------------------


def test_haystacks_streamed_reply_carries_its_usage(base, monkeypatch):
    """haystack's OpenAIChatGenerator streams without stream_options and keeps the last usage
    any chunk carries (haystack/components/generators/utils.py, haystack-ai 3.4): the usage
    comes on the chunk that ends the answer, as llama-server wrote it."""
    monkeypatch.setenv("HAYSTACK_TELEMETRY_ENABLED", "False")
    from haystack.components.generators.chat import OpenAIChatGenerator
    from haystack.dataclasses import ChatMessage
    from haystack.utils import Secret

    chunks = []
    gen = OpenAIChatGenerator(api_key=Secret.from_token("none"), model="gpt-4o-mini", api_base_url=base + "/v1",
                              streaming_callback=chunks.append, generation_kwargs={"max_tokens": 5}, max_retries=0)
    reply = gen.run([ChatMessage.from_user("hi")])["replies"][0]
    assert reply.text == "".join(c.content for c in chunks) and reply.meta["finish_reason"] in ("stop", "length")
    usage = reply.meta["usage"]
    assert usage and 1 <= usage["completion_tokens"] <= 5 and usage["prompt_tokens"] > 1, reply.meta
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_dspys_json_adapter_gets_json_by_its_structured_output_request(base, monkeypatch):
    """dspy.LM("openai/<a model its catalog knows>"): ChatAdapter's answer (gibberish here)
    fails to parse, so dspy retries with its JSONAdapter, which sends response_format
    json_schema; a typed signature with the JSONAdapter sends it at once. The answer is JSON
    by the grammar, whatever the model."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # dspy's model catalog, without a download
    import dspy

    # room for the whitespace the grammar allows between tokens (up to 21 characters a gap)
    lm = dspy.LM("openai/gpt-4o-mini", api_base=base + "/v1", api_key="none", cache=False, max_tokens=256,
                 temperature=0, num_retries=0)

    class Sum(dspy.Signature):
        question: str = dspy.InputField()
        answer: int = dspy.OutputField()
        sure: bool = dspy.OutputField()

    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        typed = dspy.Predict(Sum)(question="1 + 1?")
    assert isinstance(typed.answer, int) and isinstance(typed.sure, bool), typed
    with dspy.context(lm=lm):  # dspy's default adapter: ChatAdapter, then its JSONAdapter fallback
        plain = dspy.Predict("question -> answer: int")(question="1 + 1?")
    assert isinstance(plain.answer, int), plain


def test_the_llm_clis_continued_conversation_sends_the_earlier_turns(base, tmp_path):
    """simonw/llm with an extra OpenAI model (extra-openai-models.yaml): `llm -c` and `llm chat`
    resend the conversation's turns; the server's usage, as llm logs it, shows them arrive."""
    import subprocess
    import sys

    (tmp_path / "extra-openai-models.yaml").write_text(f"- model_id: pgroups\n  model_name: any\n"
                                                       f"  api_base: {base}/v1\n")
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path)}

    def llm(*args: str, stdin: str | None = None) -> str:
        r = subprocess.run([sys.executable, "-m", "llm", *args], env=env, input=stdin, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, (args, r.stdout[-500:], r.stderr[-1000:])
        return r.stdout

    llm("-m", "pgroups", "-o", "max_tokens", "4", "What is the capital of France?")
    llm("-c", "-o", "max_tokens", "4", "And of Italy?")
    llm("chat", "-m", "pgroups", "-o", "max_tokens", "4", stdin="one\ntwo\nthree\nexit\n")
    logs = json.loads(llm("logs", "-n", "0", "--json"))
    turns: dict[str, list[dict]] = {}
    for r in sorted(logs, key=lambda r: r["datetime_utc"]):
        turns.setdefault(r["conversation_id"], []).append(r)
    assert sorted(len(t) for t in turns.values()) == [2, 3], logs
    for conv in turns.values():
        for before, after in zip(conv, conv[1:], strict=False):  # each turn's prompt holds the one before
            assert after["input_tokens"] > before["input_tokens"] + before["output_tokens"], conv


@pytest.fixture(scope="module")
def demo(deploy) -> str:
    """The demo model (it ends its JSON strings, as a random one never does), with slots that
    hold smolagents' system prompt (about 2,000 of its tokens)."""
    from engine.models import CHAT_MODEL

    if not CHAT_MODEL.exists():
        pytest.fail(f"{CHAT_MODEL} is missing: run `make model`")
    # no projector: the synthetic one is the synthetic model's width, not this model's
    return deploy({**APP, "model": str(CHAT_MODEL), "n_ctx": 8192, "n_parallel": 2, "mmproj": None})


def test_smolagents_structured_code_step_is_whole_json(demo):
    """smolagents' CodeAgent(use_structured_outputs_internally=True) sends response_format
    json_schema {thought, code}, stop ["Observation:", "Calling tools:", "</code>"] and no
    max_tokens (agents.py, smolagents 1.26), so a step runs until the model ends its JSON or the
    slot is full. The step's output is the whole object it parses."""
    from smolagents import ActionStep, CodeAgent, OpenAIServerModel
    from smolagents.utils import AgentParsingError

    model = OpenAIServerModel(model_id="gpt-4o-mini", api_base=demo + "/v1", api_key="none", temperature=0)
    agent = CodeAgent(tools=[], model=model, use_structured_outputs_internally=True, max_steps=1, verbosity_level=0)
    events = agent.run("What is 1 + 1?", stream=True)
    step = next(e for e in events if isinstance(e, ActionStep))  # the first step only: one model call
    events.close()
    parsed = json.loads(step.model_output)
    assert set(parsed) == {"thought", "code"} and all(isinstance(v, str) for v in parsed.values()), parsed
    assert not isinstance(step.error, AgentParsingError), step.error  # the code may fail to run; its JSON is whole
