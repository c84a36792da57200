"""Images on a Qwen-VL model (``qwen2vl``, ``qwen3vl`` with deepstack): the projector places an
image's rows in M-RoPE sections (time, row, column) and the image takes ``max(nx, ny)``
positions for its ``nx * ny`` rows (engine/cache/positions.py). Every answer here is compared
with llama.cpp's own placement: mtmd's helper evaluating the same prompt in one context,
greedy (``mtmd_greedy``), the path llama-server ``--mmproj`` takes (``make families`` compares
with llama-server itself)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from deployments.api.media import MEDIA_MARKER
from deployments.prompts import PromptMaker
from engine import SamplingParams
from tests.images import png
from tests.models.qwen_vl import SHAPES, image_grid, write_qwen_vl

pytestmark = pytest.mark.gpu
N = 12
GREEDY = SamplingParams(max_tokens=N, temperature=0, top_k=1)
# square, wide and tall images: their rows and positions differ (3 x 3, 4 x 2, 2 x 4, 11 x 7)
IMAGES = [png(56, 56, 1), png(112, 56, 2), png(56, 112, 3), png(300, 200, 4)]


def turn(text: str, image: bool = True) -> str:
    return f"<|im_start|>system\nYou look at pictures closely.<|im_end|>\n<|im_start|>user\n{MEDIA_MARKER if image else ''}{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", params=["qwen2vl", "qwen3vl"])
def pair(request, tmp_path_factory) -> tuple[str, str]:
    model, mmproj = write_qwen_vl(tmp_path_factory.mktemp(request.param), request.param)
    return str(model), str(mmproj)


@pytest.fixture
def vl(pair, make_engine):
    def make(**kw):
        return make_engine(**{"model": pair[0], "mmproj": pair[1], "n_ctx": 4096, "n_parallel": 2, **kw})
    return make


def mtmd_greedy(model: str, mmproj: str, prompt: str, images: tuple[bytes, ...], n: int = N) -> list[int]:
    """llama.cpp's own answer: mtmd tokenizes the prompt with its images and evaluates it in one
    context (``mtmd_helper_eval_chunks``), then greedy tokens one at a time."""
    from llama_cpp import mtmd_cpp as m

    mp = llama_cpp.llama_model_default_params()
    cpu_only = (ctypes.c_void_p * 1)(None)  # not llama.cpp's default: every device registered, RPC ones too
    mp.devices = ctypes.cast(cpu_only, ctypes.c_void_p)
    mdl = llama_cpp.llama_model_load_from_file(model.encode(), mp)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 4096, 512, 1, 1
    ctx = llama_cpp.llama_init_from_model(mdl, cp)
    pp = m.mtmd_context_params_default()
    pp.use_gpu, pp.n_threads, pp.print_timings, pp.warmup = False, 1, False, False
    mt = m.mtmd_init_from_file(mmproj.encode(), mdl, pp)
    chunks = m.mtmd_input_chunks_init()
    bitmaps = []
    try:
        for img in images:
            buf = (ctypes.c_uint8 * len(img)).from_buffer_copy(img)
            bitmaps.append(m.mtmd_helper_bitmap_init_from_buf(mt, buf, len(img), False))
        text = m.mtmd_input_text()
        raw = prompt.replace(MEDIA_MARKER, m.mtmd_default_marker().decode()).encode()
        text.text, text.text_len, text.add_special, text.parse_special = raw, len(raw), False, True
        arr = (m.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
        assert m.mtmd_tokenize(mt, chunks, ctypes.byref(text), arr, len(bitmaps)) == 0
        n_past = llama_cpp.llama_pos(0)
        assert m.mtmd_helper_eval_chunks(mt, ctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0
        vocab = llama_cpp.llama_model_get_vocab(mdl)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        out: list[int] = []
        for _ in range(n):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            t = int(np.argmax(logits))
            if llama_cpp.llama_vocab_is_eog(vocab, t):
                break
            out.append(t)
            tok = (llama_cpp.llama_token * 1)(t)
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tok, 1)) == 0
        return out
    finally:
        m.mtmd_input_chunks_free(chunks)
        for b in bitmaps:
            m.mtmd_bitmap_free(b)
        m.mtmd_free(mt)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(mdl)


def accepted(e, prompt: str, images: tuple[bytes, ...], rid: str = "r", **kw):
    """The engine's request for ``prompt`` with ``images`` (their rows in it)."""
    er = PromptMaker.of_engine(e).make_request(prompt, kw.pop("params", GREEDY), rid, media=images,
                                                marker=MEDIA_MARKER, **kw)
    return e.accept(er)


def ask(e, prompt: str, images: tuple[bytes, ...], rid: str = "r", **kw):
    return e.complete(accepted(e, prompt, images, rid, **kw))


def test_an_image_takes_fewer_positions_than_rows_and_answers_as_llama_cpp(vl, pair):
    e = vl(pipeline_groups=1, cache_prompt=False)
    span = accepted(e, turn("what is it"), (IMAGES[3],)).media[0]
    nx, ny = image_grid(300, 200, SHAPES[Path(pair[0]).stem])
    assert (span.n, span.n_pos) == (nx * ny, max(nx, ny)) and span.sections.shape == (4, nx * ny)
    got = [ask(e, turn("what is it"), (img,), rid=f"a{k}") for k, img in enumerate(IMAGES)]
    want = [mtmd_greedy(*pair, turn("what is it"), (img,)) for img in IMAGES]
    assert [g.tokens for g in got] == want
    assert len({g.text for g in got}) == len(IMAGES)  # each image says something of its own


@pytest.mark.parametrize("groups", [1, 2])
def test_two_images_in_one_prompt_answer_as_llama_cpp_with_any_number_of_groups(vl, pair, groups):
    e = vl(pipeline_groups=groups, cache_prompt=False)
    p = turn(f" and {MEDIA_MARKER} side by side")
    for a, b in [(IMAGES[1], IMAGES[2]), (IMAGES[3], IMAGES[0])]:
        assert ask(e, p, (a, b)).tokens == mtmd_greedy(*pair, p, (a, b))


def test_the_split_answers_as_one_node(vl, pair, rpc_endpoint):
    e = vl(pipeline_groups=2, cache_prompt=False, rpc_endpoints=[rpc_endpoint])
    assert [ask(e, turn("what is it"), (img,), rid=f"s{k}").tokens for k, img in enumerate(IMAGES[:3])] == \
        [mtmd_greedy(*pair, turn("what is it"), (img,)) for img in IMAGES[:3]]


def test_a_conversation_about_an_image_reuses_its_kv_at_the_right_positions(vl, pair):
    """The next turn reuses the first's KV, image and all, and goes on after it at the shifted
    positions; another image after the same text reuses the text before it only (one slot: its
    own KV is cut where the image begins)."""
    e = vl(pipeline_groups=1, n_parallel=1)
    first = turn("what is it")
    a = ask(e, first, (IMAGES[3],), rid="t1")
    second = first + a.text + "<|im_end|>\n" + turn("and the colour?", image=False)
    b = ask(e, second, (IMAGES[3],), rid="t2")
    span = accepted(e, first, (IMAGES[3],), "x").media[0]
    assert b.final.cached_tokens > span.start + span.n  # the image's rows among them
    assert b.tokens == mtmd_greedy(*pair, second, (IMAGES[3],))
    c = ask(e, first, (IMAGES[2],), rid="t3")  # same text before, another image
    assert 0 < c.final.cached_tokens < b.final.cached_tokens
    assert c.tokens == mtmd_greedy(*pair, first, (IMAGES[2],))


def test_ngram_drafts_after_an_image_are_verified_and_cut_at_its_shifted_positions(vl, pair):
    e = vl(pipeline_groups=1, speculative={"type": "ngram", "n_max": 4})
    p = turn("what is it")
    want = mtmd_greedy(*pair, p, (IMAGES[3],), n=32)
    got = ask(e, p, (IMAGES[3],), params=SamplingParams(max_tokens=32, temperature=0, top_k=1))
    assert got.tokens == want
    drafted, accepted = sum(p.drafted for p in e.profiles()), sum(p.accepted for p in e.profiles())
    assert drafted > accepted  # drafts were verified after the image, and some cut


def test_a_slot_file_keeps_where_its_image_sits(vl, pair, tmp_path):
    e = vl(pipeline_groups=1, n_parallel=1, slot_save_path=str(tmp_path))
    first = turn("what is it")
    a = ask(e, first, (IMAGES[1],), rid="f1")
    assert e.slot_action(0, "save", "conv.bin")["n_saved"] > 0
    assert (tmp_path / "conv.bin.positions").exists()
    ask(e, turn("something else", image=False), (), rid="other")  # the slot's KV is another's now
    assert e.slot_action(0, "restore", "conv.bin")["n_restored"] > 0
    second = first + a.text + "<|im_end|>\n" + turn("more", image=False)
    b = ask(e, second, (IMAGES[1],), rid="f2")
    span = accepted(e, first, (IMAGES[1],), "x").media[0]
    assert b.final.cached_tokens > span.start + span.n  # the image's rows among them
    assert b.tokens == mtmd_greedy(*pair, second, (IMAGES[1],))


def test_a_resumed_request_sends_its_image_again_and_goes_on_as_llama_cpp(vl, pair):
    from deployments.api.values import ResumeSpec

    e = vl(pipeline_groups=2)
    p = turn("what is it")
    er = PromptMaker.of_engine(e).make_request(p, GREEDY, "r0", media=(IMAGES[3],), marker=MEDIA_MARKER)
    whole = e.complete(e.accept(er)).tokens
    spec = ResumeSpec(er.prompt, (er.params,), GREEDY.max_tokens, True, -1, er.media)
    cont = spec.continuation(0, whole[:4], "r0x")  # a replica was lost after four tokens
    assert cont.media == (IMAGES[3],) and cont.n_resumed == 4
    assert whole[:4] + e.complete(e.accept(cont)).tokens == mtmd_greedy(*pair, p, (IMAGES[3],))
