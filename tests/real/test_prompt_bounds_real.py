"""The premise of refusing a prompt from its bytes, on the real vocabularies: no text takes
fewer tokens than its bytes (those a token must stand for) over the most bytes one token
stands for. SmolLM2's byte-level BPE lacks tokens for a few bytes (llama.cpp drops them);
Gemma's SentencePiece has runs of whitespace and ellipses as single tokens."""

from __future__ import annotations

import pytest

from engine.models import CHAT_MODEL
from engine.native.model import Model
from engine.text.tokenizer import Tokenizer, TokenLimit

TEXTS = ["", " " * 5000, "\n" * 3000, "\t \n" * 1000, "a" * 4000, "\x04\x06\x13\x14\x16\x1d" * 500,
         "\U00040000\U00080000" * 300, "é🙂中" * 700, "…" * 2000, "<|im_start|>" * 300, "<start_of_turn>user\n" * 200,
         "The quick brown fox jumps over the lazy dog. " * 100, "{\"a\": [1, 2, 3]}\n" * 200,
         "".join(chr(c) for c in range(1, 0x3000) if not 0xD800 <= c < 0xE000) * 2]


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def tokenizer(request: pytest.FixtureRequest, gemma_path: str) -> Tokenizer:
    path = str(CHAT_MODEL) if request.param == "smollm2" else gemma_path
    if not CHAT_MODEL.exists():
        pytest.fail(f"{CHAT_MODEL} is missing: run `make model`")
    model = Model(path, devices=None, n_gpu_layers=0)
    yield Tokenizer(model)
    model.close()


def test_the_bytes_bound_never_refuses_a_text_that_fits(tokenizer):
    tok = tokenizer
    assert tok.max_token_bytes is not None  # both vocabularies bound a token's bytes
    for text in TEXTS:
        tokens = tok.encode(text)
        for raw in (None, text.encode()):
            assert tok._counted(text, raw) <= tok.max_token_bytes * max(len(tokens), 1), text[:20]  # noqa: SLF001
        tok.encode(text, limit=TokenLimit(max(len(tokens), 1), "the test's limit"))  # at its own length: served
