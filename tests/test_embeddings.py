"""Embeddings from one more context of the served model: pooled, normalised, deterministic, the
same over the RPC split, and refused clearly when off or too long."""

from __future__ import annotations

import numpy as np
import pytest

from engine import RequestError


def test_embeddings_are_normalised_pooled_vectors(make_engine):
    e = make_engine(n_parallel=2, embeddings=True, n_ubatch=64, n_batch=64)
    vecs, n_tokens = e.embed(["hello world", "the model splits layers", [1, 300, 301, 302]])
    assert len(vecs) == 3 and n_tokens == len(e.tokenize_prompt("hello world")) + \
        len(e.tokenize_prompt("the model splits layers")) + 4
    assert all(v.shape == (e.embedder.n_embd,) and abs(float(np.linalg.norm(v)) - 1) < 1e-4 for v in vecs)
    assert e.embedder.pooling == "mean"  # a causal model's GGUF names no pooling
    again, _ = e.embed(["hello world"])
    assert np.allclose(again[0], vecs[0], atol=1e-5)  # the same text, the same vector
    assert float(vecs[0] @ vecs[1]) < 0.9999  # other text, another vector
    # generation still runs beside it
    from engine import SamplingParams
    assert e.generate("hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)).final.completion_tokens == 3
    with pytest.raises(RequestError, match="at most 64"):
        e.embed(["word " * 200])
    with pytest.raises(RequestError, match="empty"):
        e.embed([[]])


def test_embeddings_off_is_a_clear_refusal(make_engine):
    with pytest.raises(RequestError, match="embeddings: true"):
        make_engine(n_parallel=1).embed(["x"])


def test_embeddings_over_the_split_equal_the_unsplit_ones(make_engine, rpc_endpoint):
    texts = ["hello world", "pipeline groups keep both stages busy"]
    plain, _ = make_engine(n_parallel=1, embeddings=True, repack=False).embed(texts)
    split, _ = make_engine(n_parallel=1, embeddings=True, repack=False, rpc_endpoints=[rpc_endpoint],
                           peer_layers=2).embed(texts)
    for a, b in zip(plain, split, strict=True):
        assert float(a @ b) > 0.9999, float(a @ b)
