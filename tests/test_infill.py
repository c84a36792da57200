"""Fill-in-the-middle (llama-server's /infill): the prompt built from a GGUF's FIM tokens, the
request through the engine deployment, and the refusal of a model without them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deployments.api.llama import InfillRequest
from deployments.api.values import Submitted
from engine import Engine, EngineConfig, RequestError
from engine.text.infill import FimTokens, infill_tokens
from engine.types import Output
from tests.models.synthetic import ModelShape, write_model
from tests.test_deployment import connect, next_outputs, run, submit


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory: pytest.TempPathFactory, small_shape: ModelShape) -> str:
    path = Path(tmp_path_factory.mktemp("models")) / "fim.gguf"
    return str(write_model(path, ModelShape(**{**small_shape.__dict__, "fim": True})))


@pytest.fixture(scope="module")
def fim_engine(fim_model: str):
    e = Engine(EngineConfig(model=fim_model, n_threads=1, n_parallel=1, n_ctx=2048, n_batch=64))
    yield e
    e.close()


def test_the_prompt_is_laid_out_as_llama_server_lays_it_out(fim_engine):
    tok = fim_engine.tokenizer
    fim = FimTokens.of(tok)
    enc = lambda t: tok.encode(t, add_special=False, parse_special=False)  # noqa: E731
    got = infill_tokens(tok, "def f(x):\n    return", "\n\nprint(f(2))", " x", [("util.py", "import os")],
                        n_batch=64, n_ctx_slot=2048, n_predict=16)
    bos = tok.model.add_bos
    want = [fim.rep, *enc("myproject\n"), fim.sep, *enc("util.py\n"), *enc("import os"), fim.sep, *enc("filename\n"),
            *([1] if bos else []), fim.pre, *enc("def f(x):\n    return"), *enc(" x"), fim.suf,
            *enc("\n\nprint(f(2))"), fim.mid]
    assert got == want


def test_prefix_suffix_and_extra_are_cut_to_the_batch_and_the_slot(fim_engine):
    tok = fim_engine.tokenizer
    fim = FimTokens.of(tok)
    long = "word " * 500
    got = infill_tokens(tok, long, long, "", [("a.py", long)], n_batch=64, n_ctx_slot=200, n_predict=40)
    pre, suf, mid = got.index(fim.pre), got.index(fim.suf), got.index(fim.mid)
    assert suf - pre - 1 == 48  # three quarters of the batch: the prefix's tail
    assert mid - suf - 1 == 14  # a quarter, less the two markers
    assert pre - 1 == 200 - 64 - 80  # the extra chunks' tail fills the rest of the slot (BOS before FIM_PRE)
    enc = tok.encode(long, add_special=False, parse_special=False)
    assert got[pre + 1:suf] == enc[-48:] and got[suf + 1:mid] == enc[:14]


def test_a_model_without_fim_tokens_is_a_clear_400(make_engine):
    e = make_engine(n_parallel=1)
    with pytest.raises(RequestError, match="infill is not supported by this model.*FIM prefix, suffix, middle"):
        infill_tokens(e.tokenizer, "a", "b", "", [], 512, 1024, 8)


def test_infill_through_the_engine_deployment(fim_model):
    async def body(d: Any) -> None:
        s = await connect(d, "ingress-1", "c")
        req = InfillRequest.model_validate({"input_prefix": "def f(x):\n    return", "input_suffix": "\n",
                                            "input_extra": [{"text": "import os", "filename": "u.py"}],
                                            "n_predict": 6, "samplers": "edkypmxt", "cache_prompt": True,
                                            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "ignore_eos": True})
        res = await submit(d, "c", "fim-1", req)  # its prompt made as the ingress makes it
        assert isinstance(res, Submitted) and res.prompt_tokens > 10, res
        final: Output | None = None
        while final is None:
            final = next((o for o in await next_outputs(s) if o.finish_reason is not None), None)
        assert final.finish_reason == "length" and final.completion_tokens == 6

    run(fim_model, body)


def test_the_infill_sampler_runs_where_asked(fim_engine):
    from engine import SamplingParams

    tok = fim_engine.tokenizer
    prompt = infill_tokens(tok, "def f(x):\n    return", "\n", "", [], 64, fim_engine.n_ctx_slot, 8)
    c = fim_engine.generate(prompt, SamplingParams(temperature=0.8, seed=2, max_tokens=8, samplers=("top_k", "top_p", "infill")))
    assert c.final.finish_reason in ("stop", "length") and c.final.completion_tokens >= 1


@pytest.mark.parametrize("samplers, top_k, cut", [
    (("infill",), 40, True),  # top_k 40 is not in the chain's order: the chain cuts before infill
    (("top_k", "infill"), 0, True),  # top_k off
    (("top_k", "infill"), 100_000, True),  # a top-k wider than the bound
    (("infill", "top_k"), 40, True),  # the top-k comes after infill
    (("top_k", "top_p", "infill"), 40, False),  # llama.vscode's own chain: already bounded
])
def test_the_infill_sampler_never_sees_the_whole_vocabulary(fim_engine, samplers, top_k, cut):
    """llama.cpp's infill sampler is quadratic in its candidates (hours a token on 262,144): a
    top-k of at most INFILL_MAX_CANDIDATES always comes before it (bench/samplers.py measures it)."""
    import llama_cpp

    from engine import SamplingParams
    from engine.sampling import INFILL_MAX_CANDIDATES, SamplerChain

    model = fim_engine.model
    chain = SamplerChain(SamplingParams(max_tokens=1, seed=1, top_k=top_k, samplers=samplers), model.n_vocab,
                         vocab=model.vocab)
    try:
        names = [llama_cpp.llama_sampler_name(llama_cpp.llama_sampler_chain_get(chain.ptr, i)).decode()
                 for i in range(llama_cpp.llama_sampler_chain_n(chain.ptr))]
        before = names[:names.index("infill")]
        assert "top-k" in before, names
        assert (before.count("top-k") == 2 or before == ["top-k"]) if cut else before.count("top-k") == 1, names
    finally:
        chain.close()
    assert INFILL_MAX_CANDIDATES <= 256
