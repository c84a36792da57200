"""Speculative decoding per group: drafts verified in the group's batch, the KV of rejected
drafts removed, and the output the same as without speculation."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from pydantic import ValidationError

from engine import EngineConfig, SamplingParams
from engine.config import SpeculativeConfig
from engine.slots import MAX_BACKOFF, SpecState
from engine.speculation.drafters import ngram_draft
from observability.metrics import EngineMetrics
from tests.rounding import agree_until_they_differ

PROMPTS = [
    "Once upon a time, in a land of many pipelines, there lived a scheduler who",
    "The quick brown fox jumps over the lazy dog; the quick brown fox jumps over",
    "def add(a, b): return a + b\ndef sub(a, b): return a - b\ndef",
]


def chi2_pvalue(a: list[int], b: list[int], n_perm: int = 2000) -> float:
    """Two-sample test of equal distributions: the chi-square statistic of the 2 x k table
    against its permutation distribution (no SciPy needed)."""
    vocab = {v: i for i, v in enumerate(sorted(set(a) | set(b)))}
    x = np.array([vocab[v] for v in a + b])
    k, na = len(vocab), len(a)

    def stat(labels: np.ndarray) -> float:
        t = np.stack([np.bincount(labels[:na], minlength=k), np.bincount(labels[na:], minlength=k)]).astype(float)
        exp = t.sum(1, keepdims=True) * t.sum(0, keepdims=True) / t.sum()
        return float(((t - exp) ** 2 / np.where(exp > 0, exp, 1)).sum())

    s0 = stat(x)
    rng = np.random.default_rng(0)
    return (1 + sum(stat(rng.permutation(x)) >= s0 for _ in range(n_perm))) / (n_perm + 1)


def run(e, prompt, params: SamplingParams) -> tuple[list[int], str, object]:
    toks, parts, final = [], [], None
    for o in e.stream(prompt, params):
        toks.extend(o.tokens)
        parts.append(o.text)
        final = o
    return toks, "".join(parts), final


def spec_totals(e) -> tuple[int, int]:
    ps = e.profiles()
    return sum(p.drafted for p in ps), sum(p.accepted for p in ps)


def check_kv(e) -> None:
    """Every slot's recorded tokens are exactly what its sequence holds in the KV."""
    for g in e.groups:
        for s in g.slots:
            assert g.ctx.seq_pos_max(s.seq_id) == len(s.cache_tokens) - 1, (s.id, len(s.cache_tokens))


# ---- units --------------------------------------------------------------------------------------

def test_ngram_draft_continues_the_most_recent_occurrence_of_the_longest_suffix():
    h = np.array([5, 1, 2, 3, 7, 8, 9, 1, 2, 3, 4, 6, 2, 3], np.int32)
    # suffix [2, 3]: last seen at 8..9, followed by 4 6 2 3
    assert ngram_draft(h, 2, 4, 3) == [4, 6, 2]
    # a longer suffix wins over a more recent shorter one
    h2 = np.array([1, 2, 3, 10, 11, 9, 2, 3, 20, 1, 2, 3], np.int32)
    assert ngram_draft(h2, 2, 3, 2) == [10, 11]
    assert ngram_draft(np.array([1, 2, 3, 4], np.int32), 2, 4, 5) == []
    assert ngram_draft(np.array([1, 2, 1, 2], np.int32), 2, 2, 8) == [1, 2]  # up to the end


def test_a_row_whose_drafts_are_all_rejected_backs_off_exponentially():
    st = SpecState()
    waits = []
    for _ in range(8):
        st.record(4, 0)
        n = 0
        while not st.wants():
            n += 1
        waits.append(n)
    assert waits == [1, 2, 4, 8, 16, 32, MAX_BACKOFF, MAX_BACKOFF]
    st.record(4, 1)
    st.record(4, 0)
    assert st.skip == 1  # an accepted draft resets the back-off


def test_config_refuses_what_cannot_run(model_path):
    with pytest.raises(ValidationError, match="needs model"):
        SpeculativeConfig(type="draft")
    with pytest.raises(ValidationError, match="takes no model"):
        SpeculativeConfig(type="ngram", model=model_path)
    with pytest.raises(ValidationError, match="n_min"):
        SpeculativeConfig(type="ngram", n_min=5, n_max=4)
    with pytest.raises(ValidationError):
        EngineConfig(model=model_path, speculative={"type": "ngrams"})


def test_a_draft_model_with_another_vocabulary_is_refused(make_engine, q8_model):
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(speculative={"type": "draft", "model": q8_model})


# ---- the engine -----------------------------------------------------------------------------------

SPECS = {"ngram": lambda m: {"type": "ngram", "max_rows": 8},
         "draft": lambda m: {"type": "draft", "model": m, "max_rows": 8, "p_min": 0.0}}


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_greedy_output_is_the_same_with_and_without_speculation(make_engine, model_path, kind):
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = make_engine(n_parallel=4, pipeline_groups=2, cache_prompt=False)
    spec = make_engine(n_parallel=4, pipeline_groups=2, cache_prompt=False, speculative=SPECS[kind](model_path))
    for p in PROMPTS:
        want = run(plain, p, greedy)
        got = run(spec, p, greedy)
        assert got[0] == want[0] and got[1] == want[1]
        assert got[2].completion_tokens == 48 and got[2].finish_reason == "length"
        check_kv(spec)
    drafted, accepted = spec_totals(spec)
    assert drafted > 0 and accepted > 0, (drafted, accepted)  # else this proved nothing
    # fewer target decode steps than generated tokens: several tokens per step
    steps = sum(p.steps for p in spec.profiles())
    assert steps < sum(p.steps for p in plain.profiles())
    if kind == "draft":
        assert accepted == drafted  # the model as its own draft agrees with itself


def test_concurrent_requests_with_rejections_keep_their_own_output_and_kv(make_engine):
    """Several rows draft in one batch, some drafts rejected: each row's KV is trimmed to its
    accepted tokens only (the next step attends over exactly the verified history)."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = make_engine(n_parallel=4, pipeline_groups=1, cache_prompt=False)
    spec = make_engine(n_parallel=4, pipeline_groups=1, cache_prompt=False,
                       speculative={"type": "ngram", "max_rows": 4, "ngram_min": 1})
    want = {p: run(plain, p, greedy)[0] for p in PROMPTS}
    got: dict[str, list[int]] = {}

    def one(p: str) -> None:
        got[p] = run(spec, p, greedy)[0]

    ts = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert got == want
    drafted, accepted = spec_totals(spec)
    assert 0 < accepted < drafted, (drafted, accepted)  # rejections happened and were undone
    check_kv(spec)


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(make_engine):
    """The chain samples each verified row in order and accepts before the next: one random
    draw per emitted token, as without speculation. A verify batch rounds its rows otherwise
    than one-row steps, so a draw on a boundary of the distribution may flip: a seed may differ
    only from a position where both distributions agree to rounding, and most do not differ (a
    second draw per token, or a draw from a stale row, would differ early and often)."""
    plain = make_engine(n_parallel=2, cache_prompt=False)
    spec = make_engine(n_parallel=2, cache_prompt=False, speculative={"type": "ngram", "ngram_min": 1})

    def sampled(e, params: SamplingParams) -> tuple[list[int], list]:
        outs = list(e.stream(PROMPTS[1], params))
        return [t for o in outs for t in o.tokens], [lp for o in outs for lp in o.logprobs or ()]

    identical = 0
    for seed in range(6):
        params = SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=40,
                                ignore_eos=True, logprobs=5)
        identical += agree_until_they_differ(*sampled(spec, params), *sampled(plain, params))
    assert identical >= 4, identical
    assert spec_totals(spec)[1] > 0


def test_sampled_tokens_keep_their_distribution(make_engine):
    """Independent seeds in each arm: the tokens at each position follow the same distribution
    (chi-square over the pooled counts; fails when verification skews what is emitted)."""
    n = 120
    params = {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_tokens": 12, "ignore_eos": True}
    arms = []
    for kw, seed0 in (({}, 0), ({"speculative": {"type": "ngram", "ngram_min": 1}}, 10_000)):
        e = make_engine(n_parallel=4, cache_prompt=False, **kw)
        arms.append([run(e, PROMPTS[1], SamplingParams(**params, seed=seed0 + i))[0] for i in range(n)])
        if kw:
            assert spec_totals(e)[1] > 0
    for pos in (3, 7, 11):
        a = [t[pos] for t in arms[0]]
        b = [t[pos] for t in arms[1]]
        assert len(set(a)) > 1  # a distribution, not one token
        assert chi2_pvalue(a, b) > 0.001, (pos, sorted(a), sorted(b))


def self_draft(model_path: str, **kw: object) -> dict:
    """The synthetic model as its own draft: every row drafts, every draft is accepted."""
    return {"type": "draft", "model": model_path, "p_min": 0.0, **kw}


def test_the_request_switch_and_the_row_threshold_turn_drafting_off(make_engine, model_path):
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    e = make_engine(n_parallel=4, cache_prompt=False, speculative=self_draft(model_path, max_rows=1))
    run(e, PROMPTS[1], greedy.model_copy(update={"speculative": False}))
    assert spec_totals(e) == (0, 0)
    # two choices generate side by side from the first token: two rows > max_rows 1
    e.generate_n(PROMPTS[1], greedy, 2)
    assert spec_totals(e) == (0, 0)
    run(e, PROMPTS[1], greedy)  # one row: drafts
    assert spec_totals(e)[0] > 0
    e2 = make_engine(n_parallel=4, cache_prompt=False, speculative=self_draft(model_path, max_rows=2))
    e2.generate_n(PROMPTS[1], greedy, 2)
    assert spec_totals(e2)[0] > 0


def test_logprobs_stop_strings_and_length_hold_with_several_tokens_per_step(make_engine, model_path):
    plain = make_engine(n_parallel=2, cache_prompt=False)
    spec = make_engine(n_parallel=2, cache_prompt=False, speculative=self_draft(model_path))
    lp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    outs = list(spec.stream(PROMPTS[1], lp))
    assert sum(o.n_tokens for o in outs) == 30 and max(o.n_tokens for o in outs) > 1
    got = [e for o in outs for e in o.logprobs]
    want = [e for o in plain.stream(PROMPTS[1], lp) for e in o.logprobs]
    assert [e[0] for e in got] == [e[0] for e in want]
    # a row verified in a batch of several rounds its logits a little differently (f16 weights)
    assert np.allclose([e[1] for e in got], [e[1] for e in want], atol=1e-2)
    text = plain.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)).text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    ps = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    a, b = plain.generate(PROMPTS[1], ps), spec.generate(PROMPTS[1], ps)
    assert (a.text, a.final.finish_reason, a.final.completion_tokens) == (b.text, b.final.finish_reason,
                                                                          b.final.completion_tokens)
    check_kv(spec)


def test_the_prompt_cache_reuses_a_speculated_sequence(make_engine, model_path):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_engine(n_parallel=1)
    spec = make_engine(n_parallel=1, speculative=self_draft(model_path))
    first = run(spec, PROMPTS[1], greedy)
    assert first[0] == run(plain, PROMPTS[1], greedy)[0]
    again = run(spec, PROMPTS[1] + first[1], greedy)  # the slot's cache holds the prompt and output
    assert again[2].cached_tokens > 0
    assert again[0] == run(plain, PROMPTS[1] + first[1], greedy)[0]
    check_kv(spec)


def test_metrics_export_drafted_and_accepted_tokens_per_group(make_engine, model_path):
    e = make_engine(n_parallel=2, pipeline_groups=2, speculative=self_draft(model_path))
    run(e, PROMPTS[1], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    m = EngineMetrics("m")
    m.collect_engine(e, 0, 0)
    text = m.render().decode()
    drafted, accepted = spec_totals(e)
    got = {}
    for line in text.splitlines():
        for name in ("group_spec_drafted_tokens_total", "group_spec_accepted_tokens_total", "group_spec_acceptance_ratio"):
            if line.startswith("pgroups_" + name + "{"):
                got[name] = got.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    assert got["group_spec_drafted_tokens_total"] == drafted > 0
    assert got["group_spec_accepted_tokens_total"] == accepted > 0
    assert got["group_spec_acceptance_ratio"] == 1.0  # one group drafted, all accepted; the other 0


def test_the_api_carries_the_per_request_switch():
    from deployments.api.openai import ChatCompletionRequest, CompletionRequest

    off = CompletionRequest(prompt="x", speculative=False).sampling(16)
    assert off.speculative is False
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).sampling(16).speculative is True
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", speculative="sometimes")


def test_backend_sampling_does_not_draft(make_engine, model_path):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_engine(n_parallel=2, cache_prompt=False)
    e = make_engine(n_parallel=2, cache_prompt=False, backend_sampling=True, speculative=self_draft(model_path))
    assert run(e, PROMPTS[2], greedy)[0] == run(plain, PROMPTS[2], greedy)[0]
    assert spec_totals(e) == (0, 0)


def test_the_serve_args_take_the_speculative_key():
    from deployments.args import AppArgs

    args = AppArgs(speculative={"type": "ngram", "n_max": 4})
    assert args.speculative.type == "ngram" and args.speculative.n_max == 4
    with pytest.raises(ValidationError, match="needs model"):
        AppArgs(speculative={"type": "draft"})
