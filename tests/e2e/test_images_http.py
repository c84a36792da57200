"""Images over HTTP on the split, N = 2, through each API's own client: the OpenAI SDK (chat,
streamed and not, and the Responses API), Anthropic's SDK, llama-server's /completion and the
page. The model has random weights: what the tests hold is that every API answers an image
request with the same greedy text for the same conversation, that the next turn reuses the
image's KV, and that hostile images are refused in the endpoint's own shape."""

from __future__ import annotations

import base64

import anthropic
import httpx
import openai
import pytest

from deployments.api.media import MEDIA_MARKER
from tests.e2e.browser import chromium
from tests.e2e.test_http_api import APP
from tests.images import data_url, png, png_bomb
from tests.models.projector import ProjectorShape

IMG = png(48, 36, 11)
GREEDY = {"temperature": 0, "top_k": 1, "max_tokens": 10}
N_ROWS = ProjectorShape().n_image_tokens


@pytest.fixture(scope="module")
def base(deploy) -> str:
    return deploy(APP)


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_messages(text: str = "what is in this image?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMG)}},
                                         {"type": "text", "text": text}]}]


def test_the_model_says_it_takes_images(base, client):
    m = client.models.list().data[0]
    assert m.model_extra["capabilities"] == ["completion", "multimodal"]
    assert m.model_extra["modalities"] == ["text", "vision"]
    props = httpx.get(base + "/props", timeout=30).json()
    assert props["modalities"] == {"vision": True, "audio": False, "video": False}
    assert props["media_marker"] == MEDIA_MARKER


def test_an_image_chat_through_every_api_answers_the_same(base, client):
    first = client.chat.completions.create(model="m", messages=chat_messages(), extra_body={"top_k": 1},
                                           temperature=0, max_tokens=10)
    text = first.choices[0].message.content
    assert text and first.usage.prompt_tokens > N_ROWS
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=chat_messages(), extra_body={"top_k": 1}, temperature=0, max_tokens=10, stream=True)
        if c.choices)
    assert streamed == text
    claude = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=120)
    msg = claude.messages.create(model="m", max_tokens=10, extra_body={"temperature": 0, "top_k": 1}, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMG).decode()}},
        {"type": "text", "text": "what is in this image?"}]}])
    assert msg.content[0].text == text
    resp = client.responses.create(model="m", max_output_tokens=10, temperature=0, extra_body={"top_k": 1}, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMG)},
                                     {"type": "input_text", "text": "what is in this image?"}]}])
    assert resp.output_text == text


def test_the_next_turn_about_the_same_image_reuses_its_kv(client):
    msgs = chat_messages("first question")
    one = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=6)
    msgs += [{"role": "assistant", "content": one.choices[0].message.content},
             {"role": "user", "content": "and the second?"}]
    two = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=6)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached >= one.usage.prompt_tokens - 1 > N_ROWS, (cached, one.usage.prompt_tokens)


def test_llama_servers_completion_takes_multimodal_data(base):
    r = httpx.post(base + "/completion", timeout=120, json={
        "prompt": {"prompt_string": f"look: {MEDIA_MARKER} it is", "multimodal_data": [base64.b64encode(IMG).decode()]},
        "n_predict": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["tokens_evaluated"] > N_ROWS


def test_hostile_images_get_a_400_in_the_endpoints_shape(base, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(png_bomb(50_000, 50_000))}}]}])
    assert "50000x50000" in str(e.value)
    r = httpx.post(base + "/v1/messages", timeout=30, json={"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                                                  "data": base64.b64encode(IMG).decode()}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "not the declared" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/chat/completions", timeout=30, json={"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMG)}}] * 1000}]})
    assert r.status_code == 400 and "at most 16" in r.json()["error"]["message"]
    # the engine is untouched: an image chat right after answers
    assert client.chat.completions.create(model="m", messages=chat_messages(), max_tokens=2).choices[0].message.content


def test_the_page_attaches_an_image(base, tmp_path):
    path = tmp_path / "cat.png"
    path.write_bytes(IMG)
    with chromium() as ctx:
        page = ctx.new_page()
        page.goto(base + "/")
        page.locator("[data-testid=attach]").wait_for(state="visible", timeout=30_000)
        page.set_input_files("[data-testid=attach-input]", str(path))
        page.locator("[data-testid=attached] img").wait_for(timeout=10_000)
        page.fill("#set-max_tokens", "8")
        page.fill("[data-testid=prompt]", "what is this?")
        page.click("[data-testid=send]")
        answer = page.locator("[data-testid=msg-assistant]").last
        answer.locator("[data-testid=stats]").wait_for(timeout=60_000)
        assert page.locator("[data-testid=msg-user] [data-testid=msg-image]").count() == 1
        assert not answer.locator("[data-testid=error]").count(), answer.inner_text()
        assert "cached" in answer.locator("[data-testid=stats]").inner_text()
