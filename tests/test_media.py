"""Images on pipeline groups, in the engine and in the ingress's request checks: the image's
rows enter the split like a prompt's, answers are the same for any number of groups and over
the split, the KV of an image is reused on the next turn, and hostile images are refused."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from pydantic import ValidationError

from deployments.api.anthropic import MessagesRequest
from deployments.api.llama import LlamaCompletionRequest
from deployments.api.media import CHAT_MARKER, MAX_MEDIA, MEDIA_MARKER
from deployments.api.openai import ChatCompletionRequest
from deployments.api.responses import ResponsesRequest
from deployments.prompts import PromptMaker
from engine import SamplingParams
from engine.errors import RequestError
from engine.media import MEDIA_SLOT, media_boundary, media_hash, media_ids
from tests.images import data_url, gif_frames, jpeg_cut, png, png_bomb, png_garbage, webp
from tests.models import SYNTHETIC_MMPROJ
from tests.models.projector import ProjectorShape

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=12, temperature=0, top_k=1)
N_ROWS = ProjectorShape().n_image_tokens


def chat(text: str = "describe this image") -> str:
    return f"<|im_start|>user\n{MEDIA_MARKER}{text}<|im_end|>\n<|im_start|>assistant\n"


def ask(e, images: tuple[bytes, ...], prompt: str | None = None, rid: str = "r", **kw):
    er = PromptMaker.of_engine(e).make_request(prompt or chat(), kw.pop("params", GREEDY), rid, media=images,
                                                marker=MEDIA_MARKER, **kw)
    return e.accept(er)


def answer(e, images: tuple[bytes, ...], prompt: str | None = None, rid: str = "r"):
    return e.complete(ask(e, images, prompt, rid))


@pytest.fixture
def vision(make_engine):
    def make(**kw):
        return make_engine(**{"mmproj": str(SYNTHETIC_MMPROJ), "n_ctx": 4096, "n_parallel": 4, **kw})
    return make


def test_media_ids_are_a_run_per_image_and_a_reuse_never_cuts_one():
    h = media_hash(b"an image")
    assert media_hash(b"an image") == h and media_hash(b"another") != h
    ids = media_ids(h, 16)
    assert all(t < MEDIA_SLOT for t in ids) and len(set(ids)) == 16
    prompt = [1, 2, 3, *ids, 7, 8]
    assert media_boundary(prompt, 3 + 15) == 3  # its last row is still inside it
    assert media_boundary(prompt, 3) == 3  # before the image: kept
    assert media_boundary(prompt, 10) == 3  # inside it: back to its start
    assert media_boundary(prompt, 19) == 19  # after it: kept
    two = [1, *media_ids(h, 4), *media_ids(media_hash(b"x"), 4), 5]
    assert media_boundary(two, 5) == 5  # between two images: a boundary


def test_a_medium_placed_in_fewer_positions_than_rows_shifts_what_follows():
    from engine.cache import positions as P

    shifts: P.Shifts = []
    P.after_medium(shifts, 3 + 16, 16, 4)  # text 0..2, then 16 rows on 4 positions (M-RoPE, 4 x 4)
    assert shifts == [(19, 12)]
    assert [P.position(shifts, i) for i in (0, 2, 3, 19, 20)] == [0, 2, 3, 7, 8]
    P.after_medium(shifts, 19 + 2 + 6, 6, 6)  # one a row: no shift of its own
    P.after_medium(shifts, 27 + 9, 9, 3)
    assert shifts == [(19, 12), (36, 18)] and P.position(shifts, 36) == 18
    assert P.kept(shifts, 35) == [(19, 12)] and P.kept(shifts, 36) == shifts
    P.cut(shifts, 19)  # up to the end of the first medium: its shift stays
    assert shifts == [(19, 12)]
    P.cut(shifts, 3)  # at its start: gone, index and position agree again
    assert shifts == [] and P.position(shifts, 3) == 3


def test_an_image_is_its_rows_and_changes_the_answer(vision):
    e = vision(pipeline_groups=2)
    assert e.modalities == {"vision": True, "audio": False, "video": False}
    r = ask(e, (png(40, 30, 1),))
    assert [(s.n, s.embd.shape) for s in r.media] == [(N_ROWS, (N_ROWS, 256))]
    assert all(t < MEDIA_SLOT for t in r.prompt_tokens[r.media[0].start : r.media[0].start + N_ROWS])
    a = e.complete(r).text
    b = answer(e, (png(40, 30, 2),), rid="b").text
    text_only = e.generate(chat().replace(MEDIA_MARKER, ""), GREEDY).text
    assert a != b and a != text_only


def test_the_same_image_next_turn_reuses_its_kv_and_answers_the_same(vision):
    from observability.metrics import EngineMetrics

    e = vision(pipeline_groups=2)
    img = png(64, 48, 3)
    first = answer(e, (img,), rid="a")
    again = answer(e, (img,), rid="b")
    assert again.text == first.text
    assert (e.projector.stats["encoded"], e.projector.stats["cache_hits"]) == (1, 1)  # its embeddings were kept
    m = EngineMetrics("m")
    m.collect_engine(e, 0, 0)
    text = m.render().decode()
    assert "pgroups_media_encoded_total{" in text and f"pgroups_media_rows_total{{model=\"m\",replica=\"0\"}} {N_ROWS}.0" in text
    assert again.final.cached_tokens == again.final.prompt_tokens - 1  # the image's rows among them
    other = answer(e, (png(64, 48, 4),), rid="c")
    # the prompt before the image is shared; the other image is evaluated whole
    assert other.final.cached_tokens < ask(e, (img,), rid="d").media[0].start + 1


@pytest.mark.parametrize("groups", [1, 2])
def test_image_answers_are_the_same_for_any_number_of_groups(vision, groups):
    imgs = [png(40, 30, 1), png(90, 17, 5), png(32, 32, 6)]
    one = vision(pipeline_groups=1, cache_prompt=False)
    want = [answer(one, (i,), rid=f"w{k}").text for k, i in enumerate(imgs)]
    one.close()
    e = vision(pipeline_groups=groups, cache_prompt=False)
    assert [answer(e, (i,), rid=f"g{k}").text for k, i in enumerate(imgs)] == want


def test_image_requests_at_once_across_groups_answer_as_one_at_a_time(vision):
    e = vision(pipeline_groups=2, n_parallel=4, cache_prompt=False)
    imgs = [png(40, 30, s) for s in range(6)]
    alone = [answer(e, (i,), rid=f"a{k}").text for k, i in enumerate(imgs)]
    with cf.ThreadPoolExecutor(6) as ex:
        together = list(ex.map(lambda k: answer(e, (imgs[k],), rid=f"t{k}").text, range(6)))
    assert together == alone


def test_two_images_in_one_prompt_in_order(vision):
    e = vision(pipeline_groups=2)
    a, b = png(40, 30, 1), png(40, 30, 2)
    p = f"<|im_start|>user\n{MEDIA_MARKER} and {MEDIA_MARKER}<|im_end|>\n<|im_start|>assistant\n"
    r = ask(e, (a, b), p)
    assert len(r.media) == 2 and r.media[1].start > r.media[0].start + N_ROWS
    ab, ba = e.complete(r).text, answer(e, (b, a), p, rid="ba").text
    assert ab != ba


def test_several_choices_of_an_image_prompt_evaluate_it_once(vision):
    e = vision(pipeline_groups=2, n_parallel=4)
    img = png(40, 30, 1)
    params = SamplingParams(max_tokens=8, temperature=0, top_k=1)
    r = ask(e, (img,), params=params, n=2)
    assert [f.media for f in r.family] == [r.media, r.media]
    both = e.complete_n(r)
    alone = e.complete(ask(e, (img,), params=params, rid="alone"))
    assert [c.text for c in both] == [alone.text, alone.text]


def test_the_split_answers_images_as_one_node(vision, rpc_endpoint):
    imgs = [png(40, 30, 1), png(50, 50, 9)]
    local = vision(pipeline_groups=1, cache_prompt=False)
    want = [answer(local, (i,), rid=f"l{k}").text for k, i in enumerate(imgs)]
    local.close()
    split = vision(pipeline_groups=2, cache_prompt=False, rpc_endpoints=[rpc_endpoint])
    assert [answer(split, (i,), rid=f"s{k}").text for k, i in enumerate(imgs)] == want


def test_what_the_engine_refuses(vision, make_engine):
    e = vision(pipeline_groups=1)
    with pytest.raises(RequestError, match="cannot end with an image"):
        ask(e, (png(8, 8),), f"look {MEDIA_MARKER}")
    with pytest.raises(RequestError, match="2 media markers"):
        ask(e, (png(8, 8),), f"{MEDIA_MARKER}{MEDIA_MARKER} two")
    with pytest.raises(RequestError, match="cannot be decoded"):
        ask(e, (png_garbage(),))  # whole by its header and end, no pixels in it
    assert answer(e, (gif_frames(10_000),)).final.finish_reason == "length"  # the first frame only
    plain = make_engine(n_ctx=1024, n_parallel=1)
    with pytest.raises(RequestError, match="text only"):
        ask(plain, (png(8, 8),))
    from engine.types import EngineRequest
    with pytest.raises(RequestError, match="text only"):  # the engine checks too
        plain.accept(EngineRequest.of("x", [1, MEDIA_SLOT, 5], GREEDY, media=(png(8, 8),)))


def body(*parts: dict, text: str = "what is it?") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}], "max_tokens": 4}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("what,part,words", [
    ("a remote url", image("https://example.com/cat.png"), "not fetched"),
    ("not base64", image("data:image/png;base64,@@@@"), "not valid base64"),
    ("a declared type that is not the data's", image(data_url(png(8, 8), "image/jpeg")), "not the declared"),
    ("a 50,000 x 50,000 png", image(data_url(png_bomb(50_000, 50_000))), "50000x50000"),
    ("a decompression bomb", image(data_url(png_bomb(16_000, 16_000))), "at most"),
    ("webp", image(data_url(webp(), "image/webp")), "not an image or audio format"),
    ("text as an image", image(data_url(b"hello world", "image/png")), "not an image or audio format"),
    ("audio in an image part", image(data_url(b"RIFF\x00\x00\x00\x00WAVEfmt ", "image/png")), "not image"),
    ("a jpeg without its frame header", image(data_url(jpeg_cut()[:22] + b"\xff\xd9", "image/jpeg")), "does not give"),
    ("a truncated jpeg", image(data_url(jpeg_cut(), "image/jpeg")), "cut short"),
    ("a truncated png", image(data_url(png(32, 32)[:-40])), "cut short"),
    ("an unknown part", {"type": "video_url", "video_url": {"url": "x"}}, "content parts are"),
])
def test_hostile_images_are_refused_before_any_decode(what, part, words):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body(part))
    assert words in str(e.value), (what, str(e.value)[:300])


def test_too_many_images_are_refused_by_count_not_decoded():
    url = data_url(png(8, 8))
    with pytest.raises(ValidationError, match=f"at most {MAX_MEDIA}"):
        ChatCompletionRequest.model_validate(body(*[image(url)] * 1000))
    ok = ChatCompletionRequest.model_validate(body(*[image(url)] * MAX_MEDIA))
    assert len(ok.media) == MAX_MEDIA and ok.messages[0].text().count(CHAT_MARKER) == MAX_MEDIA


def test_every_api_carries_its_images_in_prompt_order():
    a, b = png(8, 8, 1), png(9, 9, 2)
    chat_req = ChatCompletionRequest.model_validate(body(image(data_url(a)), image(data_url(b))))
    assert chat_req.media == (a, b)
    import base64
    anth = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(a).decode()}},
        {"type": "text", "text": "and"}]}]})
    assert anth.to_chat().media == (a,)
    resp = ResponsesRequest.model_validate({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": data_url(b)}]}]})
    assert resp.to_chat().media == (b,)
    comp = LlamaCompletionRequest.model_validate({"prompt": {"prompt_string": f"x {MEDIA_MARKER} y",
                                                             "multimodal_data": [base64.b64encode(a).decode()]}})
    assert comp.prompt == f"x {MEDIA_MARKER} y" and comp._media == (a,)
    with pytest.raises(ValidationError, match="URLs are not fetched"):
        MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]})


def test_a_resumed_image_request_sends_its_images_again_and_goes_on_as_before(vision):
    from deployments.api.values import ResumeSpec

    e = vision(pipeline_groups=2)
    img = png(40, 30, 1)
    er = PromptMaker.of_engine(e).make_request(chat(), GREEDY, "r0", media=(img,), marker=MEDIA_MARKER)
    outs = list(e.stream_request(e.accept(er)))
    tokens = [t for o in outs for t in o.tokens]
    whole = "".join(o.text for o in outs)
    spec = ResumeSpec(er.prompt, (er.params,), GREEDY.max_tokens, True, -1, er.media)
    cont = spec.continuation(0, tokens[:4], "r0x")  # a replica was lost after four tokens
    assert cont.media == (img,) and cont.n_resumed == 4
    rest = e.complete(e.accept(cont))
    head, n = "", 0
    for o in outs:  # what the client had from the lost replica
        if n >= 4:
            break
        head, n = head + o.text, n + len(o.tokens)
    assert head + rest.text == whole
