"""The engine's edges (no Ray): late slot actions, failed restores, leaked samplers,
requests cut by shutdown, and a decode stalled on a frozen peer."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import Future

import llama_cpp
import pytest

from engine import SamplingParams
from engine.messages import SlotOpMsg
from engine.sampling import SamplerChain
from engine.types import SHUTTING_DOWN, Fault

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_a_slot_action_given_up_by_its_caller_never_runs(make_engine):
    e = make_engine(n_parallel=2)
    e.generate("a prompt that fills a slot", GREEDY)
    slot = next(v for v in e.slot_views() if v.n_cached > 0)
    late: Future = Future()
    late.cancel()  # what Engine.slot_action does when its wait times out first
    e.groups[slot.group].inbox.put(SlotOpMsg("erase", slot.id, None, late))
    # a later action on the same group runs after it: the group has handled the first by then
    assert e.slot_action(1 - slot.id, "erase", None)["id_slot"] == 1 - slot.id
    assert e.slot_views()[slot.id].n_cached == slot.n_cached
    assert e.groups[slot.group]._by_id[slot.id].cache_tokens  # noqa: SLF001 - the KV is still there


def test_a_failed_restore_leaves_the_schedulers_view_empty(make_engine, tmp_path):
    e = make_engine(n_parallel=1, slot_save_path=str(tmp_path))
    e.generate("a prompt that fills the slot", GREEDY)
    assert e.slot_views()[0].n_cached > 0
    (tmp_path / "bad.bin").write_bytes(b"not a slot file" * 100)
    with pytest.raises(RuntimeError):
        e.slot_action(0, "restore", "bad.bin")
    # the slot's KV was dropped: the scheduler must not pick it for the old prefix
    assert e.slot_views()[0].n_cached == 0
    c = e.generate("a prompt that fills the slot", GREEDY)
    assert c.final.cached_tokens == 0 and c.final.finish_reason == "length"


def test_a_sampler_chain_that_fails_to_build_is_freed(monkeypatch):
    freed: list = []
    real_free = llama_cpp.llama_sampler_free

    def free(ptr):
        freed.append(ptr)
        real_free(ptr)

    def broken(*_a):
        raise RuntimeError("no dist sampler")

    monkeypatch.setattr(llama_cpp, "llama_sampler_free", free)
    monkeypatch.setattr(llama_cpp, "llama_sampler_init_dist", broken)
    with pytest.raises(RuntimeError, match="no dist sampler"):
        SamplerChain(SamplingParams(temperature=0.8, top_k=5), n_vocab=1000)
    assert len(freed) == 1


def test_a_request_cut_by_shutdown_ends_with_an_error_not_cancelled(make_engine):
    e = make_engine(n_parallel=1)
    it = e.stream("a long one", SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True))
    next(it)
    e.close()
    last = None
    for o in it:
        last = o
    assert last is not None
    assert last.finish_reason == "error" and last.fault is Fault.SHUTDOWN and last.message == SHUTTING_DOWN


def test_a_frozen_peer_shows_as_a_stalled_decode(make_engine, rpc_endpoint, rpc_server_pid):
    e = make_engine(n_parallel=1, rpc_endpoints=[rpc_endpoint], peer_layers=1)
    assert e.stalled_for() == 0.0
    it = e.stream("a long one", SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True))
    next(it)
    os.kill(rpc_server_pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while e.stalled_for() < 1.5:
            assert time.monotonic() < deadline, "the decode did not block on the stopped peer"
            time.sleep(0.1)
    finally:
        os.kill(rpc_server_pid, signal.SIGCONT)
    # the peer answers again: the same request goes on
    n = 0
    for o in it:
        n += o.n_tokens
        if n >= 3:
            break
    assert n >= 3
    it.close()
    deadline = time.monotonic() + 10
    while e.stalled_for() > 1.0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_sampler_that_fails_ends_its_request_and_the_group_goes_on(make_engine, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    real = SamplerChain.sample

    def sample(self, row):
        if self.params.seed == 666:
            raise RuntimeError("no token can continue the grammar")
        return real(self, row)

    monkeypatch.setattr(SamplerChain, "sample", sample)
    e = make_engine(n_parallel=2)
    bad = SamplingParams(temperature=0.5, seed=666, max_tokens=8)
    good = SamplingParams(temperature=0.5, seed=1, max_tokens=8, ignore_eos=True)
    with ThreadPoolExecutor(2) as ex:
        fb, fg = ex.submit(e.generate, "one", bad), ex.submit(e.generate, "two", good)
        b, g = fb.result(60), fg.result(60)
    assert b.final.finish_reason == "error" and "no token can continue" in b.final.message
    assert b.final.fault is Fault.INTERNAL  # a sampler that raised: the engine's own error, a 500
    assert g.final.finish_reason == "length" and g.final.completion_tokens == 8
    assert e.healthy and e.generate("three", good).final.completion_tokens == 8


def test_t_max_predict_ms_ends_the_output_at_a_newline_after_the_limit(make_engine):
    e = make_engine(n_parallel=1)
    grammar = 'root ::= "x" [a-z]{3} "\\n" [a-z]{0,1000}'
    slow = e.generate("go", SamplingParams(temperature=0.5, seed=1, max_tokens=200, grammar=grammar,
                                           t_max_predict_ms=1))
    assert slow.final.finish_reason == "length" and "\n" in slow.text
    assert slow.final.completion_tokens < 200 and len(slow.text.split("\n", 1)[1]) < 100
    # before a newline, the limit does not cut
    no_newline = e.generate("go", SamplingParams(temperature=0.5, seed=1, max_tokens=40, grammar='root ::= [a-z]{40,1000}',
                                                 t_max_predict_ms=1))
    assert no_newline.final.completion_tokens == 40


def test_max_tokens_0_evaluates_and_caches_the_prompt_only(make_engine):
    """llama-server's n_predict 0 (llama.vscode warms its context with it)."""
    e = make_engine(n_parallel=1)
    prompt = "a prompt to keep in the slot " * 4
    warm = e.generate(prompt, SamplingParams(temperature=0, max_tokens=0))
    assert warm.final.finish_reason == "length" and warm.final.completion_tokens == 0 and warm.text == ""
    again = e.generate(prompt + " and more", SamplingParams(temperature=0, max_tokens=2))
    assert again.final.cached_tokens >= warm.final.prompt_tokens - 1


def test_return_progress_reports_each_prompt_chunk(make_engine):
    e = make_engine(n_parallel=1, n_batch=16, n_ubatch=16)
    prompt = "tell me a story about a model split over two nodes " * 5
    outs = list(e.stream(prompt, SamplingParams(temperature=0, max_tokens=2, return_progress=True)))
    progress = [o.progress for o in outs if o.progress is not None]
    total = len(e.tokenize_prompt(prompt))
    assert len(progress) == -(-total // 16)  # one per chunk of the batch
    assert [p[0] for p in progress] == sorted(p[0] for p in progress) and progress[-1][0] == total
    assert all(p[1] == total for p in progress)
    assert outs[-1].finish_reason == "length"


def test_post_sampling_probs_are_the_chains_distribution(make_engine):
    import math

    e = make_engine(n_parallel=1)
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, seed=3, max_tokens=4, ignore_eos=True, logprobs=5,
                            post_sampling_probs=True)
    c = e.generate("hello", params)
    for _piece, lp, top in c.final.logprobs or ():
        assert len(top) == 3 and abs(sum(math.exp(v) for _, v in top) - 1) < 1e-4  # top-k kept 3
        assert any(abs(v - lp) < 1e-6 for _, v in top)  # the chosen token is among them
    greedy = e.generate("hello", params.model_copy(update={"temperature": 0.0}))
    assert all(lp == 0.0 and top == ((top[0][0], 0.0),) for _, lp, top in greedy.final.logprobs or ())
    assert greedy.final.logprobs  # a greedy pick is certain


def test_a_draft_that_fails_to_load_leaves_no_context_behind(make_engine, monkeypatch, model_path):
    """Native handles are freed by construction whatever fails while an engine is built: here
    the second group's drafter, after the first group (its context and its draft context) and
    the second group's context exist. Every context is freed, and both models after them."""
    import llama_cpp

    from engine import runner
    from engine.native.context import Context
    from engine.native.model import Model
    from engine.speculation.drafters import ModelDrafter

    made: list = []
    models: list = []
    freed: list = []
    real_init, real_model_init = Context.__init__, Model.__init__
    real_free, real_model_close = llama_cpp.llama_free, Model.close

    def recording_init(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self)

    def recording_model(self, *a, **kw):
        real_model_init(self, *a, **kw)
        models.append(self)

    def recording_free(ptr):
        freed.append("ctx")
        real_free(ptr)

    def recording_close(self):
        if getattr(self, "ptr", None):
            freed.append("model")
        real_model_close(self)

    calls = []

    def second_fails(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the draft context could not be made")
        return ModelDrafter(*a, **kw)

    monkeypatch.setattr(Context, "__init__", recording_init)
    monkeypatch.setattr(Model, "__init__", recording_model)
    monkeypatch.setattr(Model, "close", recording_close)
    monkeypatch.setattr(llama_cpp, "llama_free", recording_free)
    monkeypatch.setattr(runner, "ModelDrafter", second_fails)
    with pytest.raises(RuntimeError, match="draft context"):
        make_engine(n_parallel=2, pipeline_groups=2, speculative={"type": "draft", "model": model_path})
    assert len(made) == 3 and all(c.ptr is None for c in made)  # group 0, its drafter's, group 1
    assert len(models) == 2 and all(m.ptr is None for m in models)  # the target and the draft model
    assert freed == ["ctx"] * 3 + ["model"] * 2, freed
