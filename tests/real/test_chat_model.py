"""The chat demo (SmolLM2-135M-Instruct, `make model`): its GGUF carries its template, and it ends
its turns, so a chat answer stops by itself (the README's first example)."""

from __future__ import annotations

import pytest

from deployments.api.openai import ChatCompletionRequest, chat_prompt
from engine import Engine, EngineConfig
from engine.models import CHAT_MODEL, CHAT_SHA256


@pytest.fixture(scope="module")
def chat_engine():
    if not CHAT_MODEL.exists():
        pytest.fail(f"{CHAT_MODEL} is missing: run `make model`")
    e = Engine(EngineConfig(model=str(CHAT_MODEL), n_threads=2, n_parallel=2, n_ctx=4096))
    yield e
    e.close()


def test_the_demo_answers_a_chat_and_stops(chat_engine):
    assert chat_engine.tokenizer.template.origin == "the GGUF"
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Name three colors."}], temperature=0)
    prompt, params, _ = chat_prompt(chat_engine.tokenizer, req, 256)
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    c = chat_engine.generate(prompt, params)
    assert c.final.finish_reason == "stop" and c.final.completion_tokens < 64, c.text
    assert [w for w in ("Red", "Blue", "Green") if w in c.text] == ["Red", "Blue", "Green"], c.text


def test_the_demo_file_is_the_one_pinned():
    import hashlib

    h = hashlib.sha256()
    with open(CHAT_MODEL, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    assert h.hexdigest() == CHAT_SHA256
