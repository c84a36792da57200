"""A real GGUF end to end: the tokens llama.cpp gives, chat templates, BOS, sliding windows."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import llama_cpp
import numpy as np
import pytest

from engine import RequestError, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The three primary colors are",
]
N_GEN = 24
GREEDY = SamplingParams(temperature=0, max_tokens=N_GEN, ignore_eos=True)
N_CTX_SLOT = 1024


# llama.cpp's kernels differ by CPU (AVX2 and AVX-512 pick others) and by context geometry, and
# round a row differently: a greedy choice between two tokens closer than this may flip
NEAR_TIE = 0.3  # logits (nats) between the chosen token and the best one


@pytest.fixture(scope="module")
def oracle(gemma_path: str) -> dict[str, tuple[int, str]]:
    """llama-cpp-python's own ``Llama`` on the same GGUF and per-sequence geometry: prompt
    token count and greedy text for each prompt."""
    llm = llama_cpp.Llama(gemma_path, n_ctx=N_CTX_SLOT, n_batch=512, n_threads=2, flash_attn=False,
                          swa_full=False, verbose=False)
    out = {}
    try:
        for p in PROMPTS:
            toks = llm.tokenize(p.encode(), add_bos=True, special=True)
            gen = []
            for t in llm.generate(toks, temp=0.0, top_k=1, reset=True):
                if len(gen) == N_GEN:
                    break
                gen.append(t)
            text = b"".join(llm.detokenize([t], special=False) for t in gen).decode("utf-8", "replace")
            out[p] = (len(toks), text)
    finally:
        llm.close()
    return out


@pytest.fixture(scope="module")
def judge(gemma_path: str) -> Iterator[Callable[[str, list[int]], tuple[int, float]]]:
    """llama.cpp's logits along a generated sequence (teacher forcing): for each token, how far
    its logit is below the best one at that position. Returns the tokens that were not the
    best and the largest gap; greedy output that equals llama.cpp's up to rounding has gaps
    only at near ties."""
    llm = llama_cpp.Llama(gemma_path, n_ctx=N_CTX_SLOT, n_batch=512, n_threads=2, flash_attn=False,
                          swa_full=False, verbose=False, logits_all=True)

    def gaps(prompt: str, tokens: list[int]) -> tuple[int, float]:
        toks = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(toks + tokens)
        rows = np.asarray(llm.scores[len(toks) - 1 : len(toks) - 1 + len(tokens)], dtype=np.float64)
        gap = rows.max(axis=1) - rows[np.arange(len(tokens)), tokens]
        return int((gap > 0).sum()), float(gap.max())

    yield gaps
    llm.close()


def _run(engine, prompts: list[str] = PROMPTS) -> dict[str, tuple[int, str]]:
    def one(p: str) -> tuple[int, str]:
        c = engine.generate(p, GREEDY)
        return c.final.prompt_tokens, c.text

    return {p: one(p) for p in prompts}


@pytest.mark.parametrize("groups", [1, 2])
def test_greedy_text_equals_llama_cpp_up_to_near_ties(make_gemma, oracle, judge, groups):
    # requests one at a time: llama.cpp's greedy output is not batch-invariant
    e = make_gemma(n_parallel=2 * groups, n_ctx=2 * groups * N_CTX_SLOT, pipeline_groups=groups, cache_prompt=False)
    got = _run(e)
    assert [n for n, _ in got.values()] == [n for n, _ in oracle.values()]  # the same prompt tokens
    identical = 0
    for p in PROMPTS:
        tokens = [t for o in e.stream(p, GREEDY) for t in o.tokens]
        assert len(tokens) == N_GEN
        flips, worst = judge(p, tokens)
        # every token is llama.cpp's best, or within a near tie of it (measured, not assumed)
        assert worst < NEAR_TIE, (p, flips, worst)
        assert flips <= 2, (p, flips)
        identical += got[p][1] == oracle[p][1]
    assert identical >= len(PROMPTS) - 2, identical
    assert all(len(text) > 10 for _, text in got.values())


def test_split_gives_the_tokens_of_the_unsplit_model(make_gemma, oracle, rpc_endpoint):
    """Over the split the peer's layers run ggml's plain CPU kernels (an RPC buffer is never
    repacked), which round differently from the repacked kernels of a local CPU, so the
    oracle there is the unsplit model with repacking off: the split itself changes nothing."""
    prompts = PROMPTS[:3]
    plain = make_gemma(n_parallel=2, n_ctx=2 * N_CTX_SLOT, cache_prompt=False, repack=False)
    want = _run(plain, prompts)
    assert [n for n, _ in want.values()] == [oracle[p][0] for p in prompts]
    plain.close()
    for groups in (1, 2):
        e = make_gemma(n_parallel=2, n_ctx=2 * N_CTX_SLOT, pipeline_groups=groups, cache_prompt=False,
                       rpc_endpoints=[rpc_endpoint], peer_layers=9, repack=False)
        assert _run(e, prompts) == want
        e.close()


def test_logprobs_equal_a_log_softmax_of_llama_cpp_pythons_logits(make_gemma, gemma_path):
    llm = llama_cpp.Llama(gemma_path, n_ctx=N_CTX_SLOT, n_batch=512, n_threads=2, flash_attn=False,
                          swa_full=False, verbose=False, logits_all=True)
    try:
        toks = llm.tokenize(PROMPTS[0].encode(), add_bos=True, special=True)
        llm.eval(toks)
        row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        pieces = {t: llm.detokenize([t]) for t in np.argsort(row)[::-1][:5]}
    finally:
        llm.close()
    ref = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
    best = np.argsort(ref)[::-1][:5]
    e = make_gemma(n_parallel=1, n_ctx=N_CTX_SLOT, cache_prompt=False)
    c = e.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    [(piece, lp, top)] = c.final.logprobs
    assert piece == pieces[best[0]] and abs(lp - ref[best[0]]) < 0.02
    assert [p for p, _ in top] == [pieces[t] for t in best]
    assert all(abs(v - ref[t]) < 0.02 for (_, v), t in zip(top, best, strict=True))


def test_concurrent_requests_all_speak_english(make_gemma):
    e = make_gemma(n_parallel=4, n_ctx=4 * N_CTX_SLOT, pipeline_groups=2)
    with ThreadPoolExecutor(4) as ex:
        texts = list(ex.map(lambda p: e.generate(p, GREEDY).text, PROMPTS[:4]))
    assert "France" in texts[0] and "100" in texts[3]
    assert len(set(texts)) == 4
    assert all(sum(c.isalpha() for c in texts[i]) > len(texts[i]) / 2 for i in (0, 1, 3))  # prose
    assert "return" in texts[2] or "fibonacci" in texts[2]  # code


# ---- chat templates and BOS ------------------------------------------------------------------


def test_no_template_in_the_gguf_falls_back_to_chatml(make_gemma):
    e = make_gemma(n_parallel=1, n_ctx=N_CTX_SLOT)
    assert e.model.chat_template() is None
    text = e.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_builtin_template_by_name(make_gemma):
    e = make_gemma(n_parallel=1, n_ctx=N_CTX_SLOT, chat_template="gemma")
    text = e.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert text.startswith("<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n")
    assert text.endswith("<start_of_turn>model\n")
    r = e.make_request(text, GREEDY)
    # the built-in template's markers are single special tokens, not text
    assert e.tokenizer.encode("<start_of_turn>", add_special=False) == r.prompt_tokens[1:2]


def test_template_that_writes_bos_gives_one_bos(make_gemma, tmp_path):
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    e = make_gemma(n_parallel=1, n_ctx=N_CTX_SLOT, chat_template_file=str(tmpl))
    bos = llama_cpp.llama_vocab_bos(e.model.vocab)
    r = e.make_request(e.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]), GREEDY)
    assert r.prompt_tokens[0] == bos and r.prompt_tokens[1] != bos


def test_jinja_renders_as_hugging_face(make_gemma):
    src = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{{ m['role'] }}={{ m['content'] | tojson }};{% endfor %}"
        "{% if tools %}tools={{ tools | tojson }};{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %}nothink;{% endif %}"
        "{{ strftime_now('%Y') | length }}"
        "{% if messages | length > 3 %}{{ raise_exception('too many') }}{% endif %}"
    )
    e = make_gemma(n_parallel=1, n_ctx=N_CTX_SLOT, chat_template=src)
    msgs = [{"role": "user", "content": "é"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    out = e.tokenizer.apply_chat_template(msgs, tools=[{"type": "function"}], kwargs={"enable_thinking": False})
    assert out == 'user="é";assistant="b";tools=' + json.dumps([{"type": "function"}]) + ";nothink;4"
    with pytest.raises(ValueError, match="too many"):
        e.tokenizer.apply_chat_template(msgs * 2)


def test_unknown_template_name_is_refused(make_gemma):
    with pytest.raises(ValueError, match="neither Jinja nor a llama.cpp built-in"):
        make_gemma(n_parallel=1, n_ctx=N_CTX_SLOT, chat_template="no-such-template")


# ---- sliding windows -----------------------------------------------------------------------------


def test_prefix_reuse_never_attends_over_dropped_window(make_gemma):
    """Gemma 3's window is 512 and its window layers keep about 1024 cells per sequence: after
    a 1500-token prompt they have dropped the first few hundred positions, so a prompt sharing
    only the first 700 tokens cannot reuse them; it must give what a fresh evaluation gives."""
    e = make_gemma(n_parallel=1, n_ctx=2048)
    assert e.model.n_swa == 512
    words = ("river stone cloud bread lamp music forest window garden letter " * 200).split()
    long_a = " ".join(words[:1500]) + " and then the story ended with"
    long_b = " ".join(words[:700]) + " but the cat said that"
    a = e.generate(long_a, GREEDY)
    assert a.final.prompt_tokens > 1500
    assert e.groups[0].ctx.seq_pos_min(0) > 700 - e.model.n_swa  # the window cache dropped them
    b = e.generate(long_b, GREEDY)
    assert b.final.cached_tokens == 0  # reprocessed: the window cache cannot serve the prefix
    fresh = make_gemma(n_parallel=1, n_ctx=2048, cache_prompt=False)
    assert fresh.generate(long_b, GREEDY).text == b.text
    # a prompt that continues the whole cached one still reuses it
    c = e.generate(long_b + " and", GREEDY)
    assert c.final.cached_tokens > 600


# ---- generation semantics ------------------------------------------------------------------------


def test_ignore_eos_never_emits_end_of_generation(make_gemma):
    e = make_gemma(n_parallel=1, n_ctx=N_CTX_SLOT)
    eog = e.tokenizer.eog_tokens
    assert eog
    # push the model toward an end-of-generation token; ignore_eos must still forbid it
    bias = {t: 50.0 for t in eog[:8]}
    for params in (SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias=bias),
                   SamplingParams(temperature=0.7, seed=3, max_tokens=16, ignore_eos=True, logit_bias=bias)):
        c = e.generate("The end.", params)
        assert c.final.finish_reason == "length" and c.final.completion_tokens == 16
        assert "<eos>" not in c.text and "<end_of_turn>" not in c.text
    stopped = e.generate("The end.", SamplingParams(temperature=0, max_tokens=16, logit_bias=bias))
    assert stopped.final.finish_reason == "stop" and stopped.final.completion_tokens == 1


def test_special_tokens_are_not_rendered_into_text(make_gemma):
    e = make_gemma(n_parallel=1, n_ctx=N_CTX_SLOT)
    sot = e.tokenizer.encode("<start_of_turn>", add_special=False, parse_special=True)
    assert len(sot) == 1 and not e.tokenizer.is_eog(sot[0])
    c = e.generate("Hello", SamplingParams(temperature=0, max_tokens=4, logit_bias={sot[0]: 100.0}))
    assert c.final.completion_tokens == 4
    assert "<start_of_turn>" not in c.text


def test_repetition_penalty_sees_the_prompt(make_gemma):
    e = make_gemma(n_parallel=1, n_ctx=N_CTX_SLOT)
    prompt = "apple apple apple apple apple apple apple apple"
    plain = e.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
    assert plain.text.strip() == "apple"
    # penalised over the prompt's tokens, the repeated word is no longer the pick
    pen = e.generate(prompt, SamplingParams(temperature=0, max_tokens=1, repeat_penalty=3.0))
    assert pen.text.strip() != "apple"


def test_prompt_too_long_is_refused(make_gemma):
    e = make_gemma(n_parallel=4, n_ctx=1024)
    with pytest.raises(RequestError, match="shorten the prompt"):
        e.make_request("word " * 400, GREEDY)


@pytest.mark.parametrize("split", [False, True])
def test_n_choices_share_the_prompts_kv_with_sliding_windows_and_over_the_split(make_gemma, rpc_endpoint, split):
    """Gemma's cache has a sliding-window part; over the split the peer's KV is copied by
    the RPC server. Greedy choices of one prompt are the single request's answer."""
    kw = {"rpc_endpoints": [rpc_endpoint], "peer_layers": 9, "repack": False} if split else {}
    e = make_gemma(n_parallel=3, n_ctx=3 * N_CTX_SLOT, cache_prompt=False, **kw)
    for p in PROMPTS[:3]:
        want = e.generate(p, GREEDY).text
        got = [c.text for c in e.generate_n(p, GREEDY, 3)]
        assert got == [want] * 3, (p, want, got)
