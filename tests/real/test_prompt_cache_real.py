"""The prompt cache on a sliding-window model (Gemma 3 270M, window 512): a turn whose template
re-renders an earlier answer rolls back to the checkpoint taken at the end of that turn's
prompt, past the window, instead of evaluating the whole conversation again."""

from __future__ import annotations

from engine import SamplingParams
from tests.test_prompt_cache import run as run_one


def words(seed: int, n: int) -> list[int]:
    return [(37 * k + 1009 * seed) % 20000 + 1000 for k in range(n)]


def run(e, prompt: list[int], max_tokens: int = 8):
    return run_one(e, prompt, params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def test_a_re_rendered_answer_rolls_back_to_the_prompts_checkpoint_past_the_window(make_gemma):
    e = make_gemma(n_parallel=2, n_ctx=4096)
    assert e.model.n_swa == 512 and e.n_kept == 2
    first = [2, *words(1, 560)]
    _, answer, _ = run(e, first)
    # the next turn appends the answer and a long message: the slot's KV moves past the window
    second = first + answer + words(2, 600)
    run(e, second)
    (holder,) = [v for v in e.slot_views() if v.n_cached > len(second)]
    # the window dropped the positions the first prompt's end attends over
    assert e.groups[0].ctx.seq_pos_min(holder.seq_id) > len(first) - e.model.n_swa
    # the third renders the first answer otherwise (a reasoning model dropping its thinking)
    third = first + answer[3:] + words(3, 40)
    text, _, fin = run(e, third)
    assert fin.cached_tokens == len(first)  # the checkpoint at the end of the first prompt
    (kept,) = [g.prefix.kept for g in e.groups]
    assert kept.n_hits == 1 and kept.n_reused == len(first)

    # without the cache the window cannot go back there: the whole prompt is evaluated again
    off = make_gemma(n_parallel=2, n_ctx=4096, prompt_cache_mib=0)
    run(off, first)
    run(off, second)
    _, _, fin_off = run(off, third)
    assert fin_off.cached_tokens == 0

    # the restored state is the one the first prompt left: the third turn's text equals the text of
    # the same prefix evaluated in the same steps on a fresh slot (llama.cpp's greedy text depends
    # on how a prompt was cut into micro-batches, so a whole-prompt evaluation is no oracle here)
    ref = make_gemma(n_parallel=1, n_ctx=4096, prompt_cache_mib=0)
    run(ref, first, max_tokens=1)
    ref_text, _, ref_fin = run(ref, third)
    assert ref_fin.cached_tokens == len(first)
    assert text == ref_text


def test_conversations_beyond_the_slots_take_their_history_back_on_a_window_model(make_gemma):
    # one slot and three entries (36 MiB each): two conversations in turn, with the checkpoints
    # at their prompts' ends
    e = make_gemma(n_parallel=1, n_ctx=2048, prompt_cache_mib=110)
    assert e.n_kept == 3
    hist = {i: [2, *words(10 + i, 300)] for i in range(2)}
    reused = []
    for turn in range(2):
        for i in range(2):
            prompt = hist[i] + words(20 + 2 * turn + i, 30)
            _, toks, fin = run(e, prompt)
            if turn:
                reused.append((fin.cached_tokens, len(hist[i])))
            hist[i] = prompt + toks
    assert all(c >= n - 1 for c, n in reused), reused
