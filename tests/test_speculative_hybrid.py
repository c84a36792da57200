"""Speculation on a hybrid model (Qwen3.5's Gated DeltaNet layers: a recurrent state that cannot be
cut at a position): a row's rejected drafts are taken back from the state's snapshots
(llama.cpp's ``n_rs_seq``), so the output is the model's with every drafter, on the split, and a
state with rejected tokens in it never reaches the prompt cache.

The models are the tiny ``qwen35`` of ``tests/models/families``, its trunk's additions to the
residual stream scaled down (``trunk``) so that a bigram drafter (its MTP block, or the same
model with no trunk as a draft model) is right part of the time: drafts are both accepted and
rejected, and a rejection is taken back from the middle of a row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import Engine, SamplingParams
from tests.conftest import engine_factory
from tests.models.families import write_family
from tests.test_mtp import check_mtp_kv
from tests.test_speculative import check_kv, spec_totals

pytestmark = pytest.mark.gpu

TRUNK = 0.3
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = ["the king said hello to the world", "a dog and a cat went to the house number 12",
           "hello", "the queen of node 3 answers"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("hybrid-spec")
    return {"target": str(write_family(d / "qwen35-mtp.gguf", "qwen35", mtp=True, trunk=TRUNK)),
            "bigram": str(write_family(d / "qwen35-bigram.gguf", "qwen35", trunk=0.0))}


@pytest.fixture
def make(models: dict[str, str]) -> Iterator[Callable[..., Engine]]:
    yield from engine_factory(model=models["target"], n_parallel=4, n_ctx=4 * 1024, n_threads=1, repack=False)


def spec_of(kind: str, models: dict[str, str]) -> dict:
    base = {"n_max": 4, "p_min": 0.0, "max_rows": 8}
    return {"mtp": {"type": "mtp", **base}, "draft": {"type": "draft", "model": models["bigram"], **base},
            "ngram": {"type": "ngram", "max_rows": 8, "n_max": 4}}[kind]


def run(e: Engine, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: [t for o in e.stream(p, params) for t in o.tokens], prompts))


@pytest.mark.parametrize("kind", ["mtp", "draft"])
def test_greedy_output_is_the_models_with_drafts_taken_back_from_a_recurrent_state(make, models, kind):
    want = run(make(), PROMPTS)
    spec = make(speculative=spec_of(kind, models))
    got = run(spec, PROMPTS)
    assert got == want
    check_kv(spec)
    drafted, accepted = spec_totals(spec)
    # drafts were accepted (the bigram is right part of the time) and rejected: the state went
    # back from the middle of a row, and the answers are still the model's
    assert 0 < accepted < drafted, (drafted, accepted)
    assert run(spec, PROMPTS) == want  # again, each prompt's state now in the cache


def test_mtp_on_the_split_with_two_groups_gives_the_models_tokens(make, models, rpc_endpoint):
    want = run(make(), PROMPTS)
    split = make(pipeline_groups=2, rpc_endpoints=[rpc_endpoint], peer_layers=2, speculative=spec_of("mtp", models))
    assert run(split, PROMPTS) == want  # the recurrent layers and their snapshots on the peer
    drafted, accepted = spec_totals(split)
    assert 0 < accepted < drafted
    check_mtp_kv(split)


def ended_on_a_rejection(e: Engine, prompt: str) -> list[int]:
    """What the slot holds after an answer to ``prompt`` whose last step rejected drafts: one
    stopped by a stop string in that step (an answer cut by ``max_tokens`` never is: its last
    step drafts no further than its end). Greedy, so the same every run."""
    g = e.groups[0]
    pieces = [o.text for o in e.stream(prompt, GREEDY) if o.text.strip()]
    for word in dict.fromkeys(p.strip() for p in pieces):
        answer = e.generate(prompt, GREEDY.model_copy(update={"stop": [word]}))
        if g.prefix.rolled_back and answer.final.stop_word == word:
            return list(g.slots[0].cache_tokens)
    pytest.fail("no answer ended on a rejected draft")


def test_an_answer_that_ended_on_a_rejection_leaves_no_rejected_token_in_any_cached_state(make, models):
    """The last step of an answer rejected drafts: its slot's state is taken back only when that
    sequence next decodes. A prompt continuing it reuses it, and a prompt that evicts it to the
    prompt cache never copies the state before it is taken back; both answer as a cold engine."""
    spec = make(n_parallel=1, speculative=spec_of("mtp", models))
    cold = make(n_parallel=1, cache_prompt=False)
    prompt = " ".join(PROMPTS)  # long enough for the prompt cache to keep
    more = spec.tokenizer.encode(" and then", add_special=False)
    nxt = ended_on_a_rejection(spec, prompt) + more
    got = spec.generate(nxt, GREEDY)
    assert got.final.cached_tokens == len(nxt) - len(more)  # the slot's own state, taken back
    assert got.tokens == cold.generate(nxt, GREEDY).tokens
    check_kv(spec)

    nxt = ended_on_a_rejection(spec, prompt) + more
    spec.generate(PROMPTS[1], GREEDY)  # takes the slot: what it held would go to the prompt cache
    assert spec.generate(nxt, GREEDY).tokens == cold.generate(nxt, GREEDY).tokens
    check_kv(spec)


def test_ngram_drafts_on_a_hybrid_model_keep_its_output(make, models):
    # a prompt that repeats: the n-gram drafter proposes its continuation, mostly wrongly
    prompts = [" ".join(["the king said hello to the world"] * 4), " ".join(["a dog and a cat"] * 5)]
    want = run(make(), prompts)
    spec = make(speculative=spec_of("ngram", models))
    assert run(spec, prompts) == want
    check_kv(spec)


def test_a_recurrent_draft_model_follows_the_history_without_evaluating_it_again(make, models):
    """The draft model is a hybrid too: its slot sequences never take a draft (the drafts after a
    row's first go in a scratch copy), so each step feeds it only what the history gained."""
    prompt = " ".join(PROMPTS * 5)
    want = make().generate(prompt, GREEDY)
    e = make(speculative=spec_of("draft", models))
    got = e.generate(prompt, GREEDY)
    assert got.tokens == want.tokens
    drafter = e.groups[0].runner.drafter
    drafted, accepted = spec_totals(e)
    assert 0 < accepted < drafted
    # the prompt once, each generated token once, the drafts: not the history at every step
    assert drafter.n_fed <= got.final.prompt_tokens + got.final.completion_tokens + drafted, drafter.n_fed
    for s in e.groups[0].slots:  # the scratch copies are gone
        assert e.groups[0].runner.drafter.ctx.seq_pos_max(s.seq_id + drafter.n_seq) == -1


def test_micro_batches_too_small_for_a_rows_snapshots_are_refused_and_the_smallest_serves(make, models):
    with pytest.raises(ValueError, match="n_ubatch above n_max"):
        make(n_ubatch=5, speculative=spec_of("mtp", models))
    # the smallest that holds a row's end: prompts are split around the rows' snapshots
    want = run(make(), PROMPTS)
    small = make(n_ubatch=6, speculative=spec_of("mtp", models))
    assert run(small, PROMPTS) == want
    check_kv(small)


def test_without_backoff_every_row_drafts_at_every_step_as_llama_server(make, models):
    want = run(make(), PROMPTS)
    steps = {}
    for backoff in (True, False):
        e = make(speculative={**spec_of("mtp", models), "backoff": backoff})
        assert run(e, PROMPTS) == want
        drafted, accepted = spec_totals(e)
        steps[backoff] = (sum(p.drafts for p in e.profiles()), drafted, accepted)
    # a row backs off after drafts all rejected; without, it drafts again the next step: more
    # drafts, more accepted (make families: the same counts as llama-server's draft-mtp)
    assert steps[False][0] > steps[True][0] and steps[False][2] > steps[True][2], steps
