"""A resumed request on the engine: given its prompt and the tokens it generated before (on a
replica that failed it), it goes on with the same tokens and the same text as if it had never
stopped: greedy, across held-back stop strings, under a grammar."""

from __future__ import annotations

import pytest

from engine import RequestError, SamplingParams

PROMPT = "hello world, tell me a story"
N = 24


def run(e, prompt: list[int], params: SamplingParams, n_resumed: int = 0,
        id_slot: int = -1) -> tuple[list[str], list[int], object]:
    """A request's outputs: the text of each, every token, the final output."""
    r = e.make_request(prompt, params, n_resumed=n_resumed)
    r.id_slot = id_slot
    q = e.outputs.register(r.id)
    e.submit(r)
    texts, tokens = [], []
    while True:
        o = q.get(timeout=60)
        texts.append(o.text)
        tokens.extend(o.tokens)
        if o.finish_reason is not None:
            return texts, tokens, o


def text_before(e, prompt: list[int], params: SamplingParams, k: int) -> tuple[str, list[int]]:
    """What a client had been sent when the request had generated ``k`` tokens, and those tokens."""
    r = e.make_request(prompt, params)
    q = e.outputs.register(r.id)
    e.submit(r)
    sent, tokens = [], []
    while len(tokens) < k:
        o = q.get(timeout=60)
        sent.append(o.text)
        tokens.extend(o.tokens)
        assert o.finish_reason is None
    e.cancel(r.id)
    while o.finish_reason is None:
        o = q.get(timeout=60)
    assert len(tokens) == k
    return "".join(sent), tokens


def check_resumes(e, params: SamplingParams, points: list[int]) -> None:
    prompt = e.tokenize_prompt(PROMPT)
    texts, tokens, final = run(e, prompt, params)
    whole = "".join(texts)
    for k in points:
        if k >= len(tokens):
            continue
        sent, before = text_before(e, prompt, params, k)
        assert before == tokens[:k]
        rest = params.model_copy(update={"max_tokens": params.max_tokens - k})
        r_texts, r_tokens, r_final = run(e, prompt + before, rest, n_resumed=k)
        assert r_tokens == tokens[k:], k
        assert sent + "".join(r_texts) == whole, k
        assert r_final.finish_reason == final.finish_reason and r_final.stop_word == final.stop_word
        assert r_final.completion_tokens + k == final.completion_tokens


def test_a_resumed_greedy_request_goes_on_with_the_same_tokens_and_text(make_engine):
    e = make_engine(n_parallel=2)
    check_resumes(e, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), [1, 5, 12, N - 1])


def test_a_resumed_request_holds_back_and_then_sends_a_partly_matched_stop_string(make_engine):
    """Text held back for a stop string that has begun is held again on the new replica: a
    stop that never completes sends it later, one that completes ends the output where it would have."""
    e = make_engine(n_parallel=2)
    prompt = e.tokenize_prompt(PROMPT)
    whole = "".join(run(e, prompt, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0])
    assert len(whole) > 12
    for stop in (whole[6:10] + "\u2603never", whole[len(whole) // 2: len(whole) // 2 + 3]):
        check_resumes(e, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, stop=[stop]), list(range(1, N)))


def test_a_resumed_request_continues_its_grammar_where_it_was(make_engine):
    e = make_engine(n_parallel=2)
    grammar = 'root ::= "x" [a-z]{3} "\\n" [a-z]{0,1000}'
    check_resumes(e, SamplingParams(temperature=0, max_tokens=N, grammar=grammar), [1, 2, 4, 9])


def test_a_resumed_output_its_grammar_refuses_is_the_requests_error(make_engine):
    e = make_engine(n_parallel=1)
    prompt = e.tokenize_prompt(PROMPT)
    with pytest.raises(RequestError, match="grammar"):
        e.make_request(prompt + prompt[-2:], SamplingParams(grammar='root ::= "x"+'), n_resumed=2)
