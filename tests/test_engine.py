"""The engine on its own (no Ray): determinism, concurrency, cancel, prompt reuse, limits."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import QueueFullError, RequestError, SamplingParams
from tests.models.synthetic import ModelShape, write_model

# the engine's own assertions, run on a GPU too (bench/device/run.sh: `pytest -m gpu`)
pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24)
PROMPTS = [f"once upon a time there lived a king number {i} and" for i in range(8)]


def test_greedy_is_deterministic(make_engine):
    e = make_engine(n_parallel=2)
    a = e.generate("hello world, tell me a story", GREEDY)
    b = e.generate("hello world, tell me a story", GREEDY)
    assert a.text == b.text and a.text
    assert a.final.finish_reason in ("length", "stop")
    assert a.final.completion_tokens >= 1


def test_concurrent_equals_sequential(make_engine):
    e = make_engine(n_parallel=8, n_ctx=4096)
    with ThreadPoolExecutor(8) as ex:
        together = list(ex.map(lambda p: e.generate(p, GREEDY).text, PROMPTS))
    one_by_one = [e.generate(p, GREEDY).text for p in PROMPTS]
    assert together == one_by_one
    assert len(set(together)) > 1


def test_max_tokens_gives_length(make_engine):
    e = make_engine(n_parallel=1)
    c = e.generate("hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert c.final.finish_reason == "length"
    assert c.final.completion_tokens == 5


def test_max_tokens_is_clamped_to_the_slot_context(make_engine):
    e = make_engine(n_parallel=4, n_ctx=256)  # 64 tokens per slot
    r = e.make_request("hello world", SamplingParams(max_tokens=10_000))
    assert r.n_predict == e.n_ctx_slot - len(r.prompt_tokens)
    c = e.generate("hello world", SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    assert c.final.finish_reason == "length"
    assert c.final.prompt_tokens + c.final.completion_tokens == e.n_ctx_slot


def test_prompt_longer_than_slot_is_refused(make_engine):
    e = make_engine(n_parallel=4, n_ctx=256)
    with pytest.raises(RequestError, match="shorten the prompt"):
        e.make_request("hello " * (e.n_ctx_slot + 10), GREEDY)
    # the engine still serves
    assert e.generate("hello", GREEDY).text


def test_bad_token_ids_are_refused(make_engine):
    e = make_engine(n_parallel=1)
    with pytest.raises(RequestError):
        e.make_request([1, 2, 10_000_000], GREEDY)
    with pytest.raises(RequestError):
        e.make_request([], GREEDY)
    with pytest.raises(RequestError):
        e.make_request("hi", SamplingParams(logit_bias={10_000_000: 1.0}))


def test_stop_string_ends_generation_and_is_not_emitted(make_engine):
    e = make_engine(n_parallel=1)
    full = e.generate("hello world", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    c = e.generate("hello world", SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))
    assert c.final.finish_reason == "stop"
    assert c.text == full[: full.index(stop)]


def test_cancel_frees_the_slot(make_engine):
    e = make_engine(n_parallel=1)
    it = e.stream("hello", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    first = next(it)
    assert first.finish_reason is None
    it.close()  # abandons the request: the engine cancels it
    deadline = time.monotonic() + 10
    while e.slot_views()[0].state != "idle" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert e.slot_views()[0].state == "idle"
    assert e.scheduler.counts() == (0, 0)
    assert e.generate("hello", GREEDY).text


def test_cancel_of_waiting_request(make_engine):
    e = make_engine(n_parallel=1)
    long = e.make_request("a", SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    waiting = e.make_request("b", GREEDY)
    q1 = e.outputs.register(long.id)
    q2 = e.outputs.register(waiting.id)
    e.submit(long)
    e.submit(waiting)
    assert e.scheduler.counts()[1] == 1
    assert e.cancel(waiting.id)
    assert q2.get(timeout=5).finish_reason == "cancelled"
    e.cancel(long.id)
    while (o := q1.get(timeout=10)).finish_reason is None:
        pass
    assert o.finish_reason == "cancelled"


def test_prompt_reuse_evaluates_fewer_tokens(make_engine):
    e = make_engine(n_parallel=2)
    prompt = "once upon a time there lived a king and a queen in a big house " * 4
    a = e.generate(prompt, GREEDY)
    groups_tokens_before = e.profiles()[0].batch_tokens
    b = e.generate(prompt + " the dog", GREEDY)
    evaluated = e.profiles()[0].batch_tokens - groups_tokens_before
    assert a.final.cached_tokens == 0
    assert b.final.cached_tokens >= a.final.prompt_tokens - 1
    assert evaluated < b.final.prompt_tokens  # only the new suffix (plus decode rows)


def test_cache_prompt_off_reuses_nothing(make_engine):
    e = make_engine(n_parallel=1, cache_prompt=False)
    e.generate("hello world and more", GREEDY)
    assert e.generate("hello world and more", GREEDY).final.cached_tokens == 0


def test_queue_full_is_refused(make_engine):
    e = make_engine(n_parallel=1, max_queued_requests=1)
    p = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    reqs = [e.make_request("x", p) for _ in range(3)]
    e.submit(reqs[0])
    e.submit(reqs[1])
    with pytest.raises(QueueFullError):
        e.submit(reqs[2])
    for r in reqs[:2]:
        e.cancel(r.id)


def test_seeded_sampling_is_reproducible(make_engine):
    e = make_engine(n_parallel=2)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42, max_tokens=24)
    assert e.generate("hello", p).text == e.generate("hello", p).text
    q = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=43, max_tokens=24)
    assert e.generate("hello", p).text != e.generate("hello", q).text


def test_penalties_and_logit_bias_change_greedy_output(make_engine):
    e = make_engine(n_parallel=1)
    base = e.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    banned = {t: -100.0 for t in e.tokenizer.encode(base.text, add_special=False)}
    biased = e.generate(
        "hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=banned)
    )
    assert biased.text != base.text


def test_q8_model_loads_and_generates(make_engine, q8_model):
    e = make_engine(model=q8_model, n_parallel=1, n_ctx=512)
    assert e.generate("hello", GREEDY).final.completion_tokens >= 1


def test_synthetic_model_shapes(tmp_path):
    shape = ModelShape(n_layer=3, n_embd=96, n_head=3, n_head_kv=1, n_ff=160, n_vocab=2000, seed=3)
    p = write_model(tmp_path / "m.gguf", shape)
    import gguf

    r = gguf.GGUFReader(str(p))
    names = {t.name for t in r.tensors}
    assert "blk.2.ffn_down.weight" in names and "blk.3.attn_q.weight" not in names
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert list(emb.shape) == [96, 2000]
    assert "tokenizer.chat_template" in r.fields
    # same seed, same bytes
    p2 = write_model(tmp_path / "m2.gguf", shape)
    assert p.read_bytes() == p2.read_bytes()


def test_the_header_walker_reads_what_gguf_reads(tmp_path):
    """engine.native.gguf_shape walks the header without the vocabulary's numpy views; its tensor
    table (what the page release drops) and fields equal gguf's own reader's."""
    import gguf

    from engine.native.gguf_shape import LongArray, read_header, read_shape

    p = write_model(tmp_path / "m.gguf", ModelShape(n_layer=3, n_embd=96, n_head=3, n_head_kv=1, n_ff=160,
                                                     n_vocab=2000, seed=3))
    r, h = gguf.GGUFReader(str(p)), read_header(str(p))
    assert [(t.name, int(t.data_offset), int(t.n_bytes)) for t in r.tensors] == \
        [(t.name, t.data_offset, t.n_bytes) for t in h.tensors]
    assert set(r.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"} == set(h.fields)
    assert h.fields["tokenizer.ggml.tokens"] == LongArray(gguf.GGUFValueType.STRING, 2000)
    assert h.fields["llama.block_count"] == 3 and h.fields["general.architecture"] == "llama"
    shape = read_shape(str(p))
    assert (shape.n_layer, shape.n_embd, shape.n_head, shape.n_head_kv) == (3, 96, 3, 1)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_header(str(bad))


def test_chat_template(make_engine):
    e = make_engine(n_parallel=1)
    text = e.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n") and "hi" in text


def test_many_threads_submitting(make_engine):
    e = make_engine(n_parallel=4, pipeline_groups=2)
    errors = []

    def one(i: int) -> None:
        try:
            c = e.generate(f"request {i}", SamplingParams(temperature=0, max_tokens=6))
            assert c.final.finish_reason in ("stop", "length")
        except Exception as ex:  # pragma: no cover - reported below
            errors.append(ex)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(v.state == "idle" for v in e.slot_views())


def test_compute_failure_stops_the_group_and_fails_requests(make_engine):
    """A negative llama_decode code (a lost RPC stage) fails the requests and marks the engine unhealthy."""
    from engine.errors import NativeError

    e = make_engine(n_parallel=2)
    assert e.healthy
    ctx = e.groups[0].ctx

    def broken(batch):
        raise NativeError("llama_decode failed with -3", -3)

    ctx.decode = broken
    out = e.generate("hello", GREEDY)
    assert out.final.finish_reason == "error" and "decode failed" in out.final.message
    deadline = time.monotonic() + 5
    while e.healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not e.healthy
    # later requests are refused at once instead of hanging
    with pytest.raises(RuntimeError, match="unhealthy"):
        e.submit(e.make_request("x", GREEDY))


def test_a_request_that_fails_to_start_reports_its_own_figures(make_engine, monkeypatch):
    import engine.runner as runner_mod

    e = make_engine(n_parallel=1)
    first = e.generate("hello world", GREEDY)  # the slot now holds this request's figures
    assert first.final.completion_tokens >= 1

    class Broken:
        def __init__(self, *a, **kw):
            raise RuntimeError("no sampler today")

    monkeypatch.setattr(runner_mod, "SamplerChain", Broken)
    failed = e.generate("hello again", GREEDY)
    assert failed.final.finish_reason == "error" and "no sampler today" in failed.final.message
    assert failed.final.completion_tokens == 0 and failed.final.cached_tokens == 0
    assert 0.0 <= failed.final.t_queue <= failed.final.t_end
    monkeypatch.undo()
    assert e.generate("hello world", GREEDY).text == first.text  # the group goes on


@pytest.mark.parametrize("extra", [
    {"typical_p": 0.7}, {"top_n_sigma": 1.5}, {"xtc_probability": 0.5, "xtc_threshold": 0.05},
    {"dry_multiplier": 0.8}, {"dynatemp_range": 0.5}, {"mirostat": 1}, {"mirostat": 2},
    {"samplers": ("min_p", "temperature"), "min_p": 0.1}, {"min_keep": 5, "top_p": 0.5},
], ids=lambda d: ",".join(d))
def test_llama_servers_samplers_run_seeded_and_deterministic(make_engine, extra):
    e = make_engine(n_parallel=1)
    p = SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True, **extra)
    a, b = e.generate("once upon a time", p), e.generate("once upon a time", p)
    assert a.text == b.text and a.final.completion_tokens == 12


def test_the_sampler_order_leaves_out_what_it_does_not_name(make_engine):
    e = make_engine(n_parallel=1)
    greedy = e.generate("once upon a time", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).text
    # top-k 1 alone (no temperature stage): the most likely token, whatever the seed
    for seed in range(3):
        p = SamplingParams(temperature=1.5, top_k=1, samplers=("top_k",), seed=seed, max_tokens=12, ignore_eos=True)
        assert e.generate("once upon a time", p).text == greedy
    with pytest.raises(ValueError, match="unknown samplers"):
        SamplingParams(samplers=("top_q",))


def test_the_end_of_generation_token_is_one_of_the_tokens_returned(make_engine):
    """As llama-server's return_tokens: every sampled token, the end one too (it is no text)."""
    e = make_engine()
    eos = e.model.eos
    out = e.generate("hello", SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0}))
    assert out.final.finish_reason == "stop"
    assert out.tokens == [eos] and out.final.completion_tokens == 1 and out.text == ""
