"""The prompt cache beyond the slots (engine/cache/prompt_cache.py): conversations that come back
after their slot served others take their history back instead of evaluating it again; the
text does not change; routing follows the cache; a small cache evicts and nothing fails; on the
split a restore sends commands over the link, not KV."""

from __future__ import annotations

import numpy as np
import pytest

from engine import SamplingParams
from engine.cache.prompt_cache import LLAMA_MAX_SEQ, PromptCache, n_entries_for
from tests.link import CountingLink
from tests.test_resume_engine import run as run_request

P = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SYSTEM = [(11 * k + 5) % 3000 + 20 for k in range(64)]


def user(i: int, turn: int, n: int = 60) -> list[int]:
    """Conversation ``i``'s user message of ``turn``: tokens no other message shares."""
    return [(97 * i + 31 * turn + 7 * k) % 3500 + 300 for k in range(n)]


def run(e, prompt: list[int], id_slot: int = -1, params: SamplingParams = P):
    """One request to the end: (its text, the tokens it generated, its final output)."""
    texts, toks, fin = run_request(e, prompt, params, id_slot=id_slot)
    return "".join(texts), toks, fin


def chat(e, n_conv: int, n_turns: int) -> tuple[list[str], list[tuple[int, int, int]]]:
    """``n_conv`` conversations, one turn of each in turn: every turn resends the history (the
    previous prompt, its answer) and a new message. Returns the texts and, per returning turn,
    (tokens cached, the history it resent, the prompt's length)."""
    history = {i: list(SYSTEM) for i in range(n_conv)}
    texts, reuse = [], []
    for turn in range(n_turns):
        for i in range(n_conv):
            before = len(history[i])
            prompt = history[i] + user(i, turn)
            text, toks, fin = run(e, prompt)
            texts.append(text)
            if turn:
                reuse.append((fin.cached_tokens, before, len(prompt)))
            history[i] = prompt + toks
    return texts, reuse


def cache_stats(e):
    return [g.prefix.kept.stats() for g in e.groups if g.prefix.kept is not None]


# ---- the entries' bookkeeping -------------------------------------------------------------------

def test_a_save_takes_an_empty_entry_then_a_redundant_one_then_the_least_recently_used():
    c = PromptCache(0, first_seq_id=2, n_entries=3, min_tokens=4, slack=2)
    assert [e.seq_id for e in c.entries] == [2, 3, 4]
    a, b, d = c.entries
    a.cache_tokens[:] = [1, 2, 3, 4, 5]
    b.cache_tokens[:] = [9, 9, 9, 9]
    c.saved(a, False, False)
    c.saved(b, False, False)
    assert c.victim([7, 7, 7, 7], set()) == (d, False)  # empty first
    d.cache_tokens[:] = [8, 8, 8, 8]
    c.saved(d, False, False)
    # a slot holds a's tokens and more (it was restored from a): a goes first, no eviction
    assert c.victim([7, 7, 7, 7], set(), slots=[[1, 2, 3, 4, 5, 6, 7]]) == (a, False)
    # the saved tokens continue b's but for its last token (a re-rendered end): b is superseded
    assert c.victim([9, 9, 9, 0, 1, 2], set()) == (b, False)
    # else the least recently used is evicted, unless a copy will still read it
    assert c.victim([7, 7, 7, 7], set()) == (a, True)
    assert c.victim([7, 7, 7, 7], {a.seq_id}) == (b, True)
    assert c.victim([7, 7, 7, 7], {2, 3, 4}) == (None, False)
    # the counters tell an overwrite of a redundant entry from an eviction
    c.saved(b, False, True)
    c.saved(a, True, True)
    s = c.stats()
    assert (s.saves, s.superseded, s.evictions, s.misses) == (5, 1, 1, 0)


def test_where_no_prefix_can_be_taken_back_a_checkpoint_a_later_state_continues_goes_first():
    c = PromptCache(0, first_seq_id=1, n_entries=3, min_tokens=2, slack=2, exact=True)
    ckpt, final, other = c.entries
    ckpt.cache_tokens[:] = [1, 2, 3]  # a prompt's checkpoint
    final.cache_tokens[:] = [1, 2, 3, 4, 5]  # the same conversation after its answer
    other.cache_tokens[:] = [7, 7, 7, 7, 7, 7, 7, 7]  # a conversation of its own, longer than both
    for e in (other, ckpt, final):  # other least recently used
        c.saved(e, False, False)
    assert c.victim([9, 9, 9], set()) == (ckpt, False)
    # with the checkpoint excluded, nothing the others hold is continued by a longer state: an
    # eviction of the least recently used, however long the other lists are
    assert c.victim([9, 9, 9], {ckpt.seq_id}) == (other, True)


def test_a_save_is_skipped_when_little_would_be_lost_or_an_entry_holds_it_already():
    c = PromptCache(0, first_seq_id=1, n_entries=1, min_tokens=4, slack=0)
    assert not c.worth_saving([1, 2, 3, 4, 5], n_kept=2)  # 3 tokens lost: under min_tokens
    assert c.worth_saving([1, 2, 3, 4, 5, 6], n_kept=2)
    c.entries[0].cache_tokens[:] = [1, 2, 3, 4, 5, 6, 7]
    assert not c.worth_saving([1, 2, 3, 4, 5, 6], n_kept=0)


def test_the_budget_gives_whole_entries_per_group_within_llama_cpps_sequence_bound():
    assert n_entries_for(100 << 20, 10 << 20, n_groups=2, n_slots_per_group=4) == 5
    assert n_entries_for(0, 10 << 20, 2, 4) == 0
    assert n_entries_for(1 << 40, 1, 1, 8) == LLAMA_MAX_SEQ - 8


# ---- on the engine ------------------------------------------------------------------------------

@pytest.mark.parametrize("groups", [1, 2])
def test_conversations_beyond_the_slots_reuse_their_history_and_the_text_does_not_change(make_engine, groups):
    # 2 slots a group and 2 entries: 3 conversations a group fit without an eviction
    n_conv = 3 * groups
    on = make_engine(n_parallel=2 * groups, pipeline_groups=groups, n_ctx=2048 * groups)
    off = make_engine(n_parallel=2 * groups, pipeline_groups=groups, n_ctx=2048 * groups, prompt_cache_mib=0)
    assert on.n_kept == 2 and off.n_kept == 0
    # the cache's size is published before the first step (the page and /slots read it)
    assert [p.cache_capacity for p in on.profiles()] == [2] * groups
    got, reuse = chat(on, n_conv, 3)
    ref, reuse_off = chat(off, n_conv, 3)
    assert got == ref
    # every returning turn took its whole history back (all but the last answer token, never
    # decoded) and evaluated only its new message
    assert all(cached >= before - 1 for cached, before, _ in reuse), reuse
    # without the cache only the shared system prompt comes back
    assert max(c for c, _, _ in reuse_off) <= len(SYSTEM) + 1
    stats = cache_stats(on)
    assert sum(s.hits for s in stats) >= (n_conv * 2) - 2 * groups  # the rest were still in their slots
    assert sum(s.evictions for s in stats) == 0
    assert all(v.state == "idle" for v in on.slot_views()) and on.scheduler.counts() == (0, 0)
    if groups == 2:
        # each returning turn went where its history was: what another group held and was
        # evaluated again (said in the metrics) is at most a new conversation's system prompt
        sched = on.scheduler
        assert sched.n_elsewhere_tokens <= sched.n_elsewhere * len(SYSTEM), (sched.n_elsewhere, sched.n_elsewhere_tokens)


def test_a_cache_smaller_than_the_conversations_evicts_and_nothing_fails(make_engine):
    # one slot and one entry: a single conversation fits, four come back in turn
    e = make_engine(n_parallel=1, n_ctx=1024, prompt_cache_mib=3)  # 2 MiB an entry
    ref = make_engine(n_parallel=1, n_ctx=1024, prompt_cache_mib=0)
    assert e.n_kept == 1
    got, reuse = chat(e, 4, 3)
    assert got == chat(ref, 4, 3)[0]
    (s,) = cache_stats(e)
    assert s.evictions > 0 and s.saves > 0
    # only the very first prompt found nothing: every later one took at least the system prompt
    assert s.misses == 1
    # every returning turn still got at least the shared system prompt
    assert all(c >= len(SYSTEM) for c, _, _ in reuse)
    assert e.healthy and e.scheduler.counts() == (0, 0)


def test_the_prompt_cache_is_off_where_slots_cannot_share_kv(make_engine):
    e = make_engine(n_parallel=2, n_ctx=1024, share_prefix=False)
    assert e.n_kept == 0 and not cache_stats(e)


def test_the_metrics_show_the_cache(make_engine):
    from observability.metrics import EngineMetrics

    e = make_engine(n_parallel=1, n_ctx=2048)
    chat(e, 2, 2)
    m = EngineMetrics("m")
    m.collect_engine(e, 0, 0)
    text = m.render().decode()

    def value(name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"pgroups_{name}{{"))
        return float(line.rsplit(" ", 1)[1])

    (s,) = cache_stats(e)
    assert value("prompt_cache_capacity_entries") == 1
    assert value("prompt_cache_hits_total") == s.hits > 0
    assert value("prompt_cache_reused_tokens_total") == s.reused > 0
    assert value("prompt_cache_saves_total") == s.saves > 0
    assert value("prompt_cache_tokens") == s.tokens > 0
    assert value("prompt_cache_bytes") > 0


def restore_cost(make_engine, rpc_endpoint: str, n_history: int) -> tuple[int, int]:
    """Bytes over the link of a returning turn whose history (``n_history`` tokens of user text)
    is restored from the prompt cache, less those of the same turn continuing its own slot; and
    the bytes of that history's KV on the peer."""
    link = CountingLink(int(rpc_endpoint.rsplit(":", 1)[1]))
    e = make_engine(n_parallel=2, n_ctx=8192, rpc_endpoints=[f"127.0.0.1:{link.port}"])
    try:
        hist = SYSTEM + user(0, 0, n_history)

        def turn(prompt: list[int], slot: int) -> tuple[int, object, list[int]]:
            b0 = link.both
            _, toks, fin = run(e, prompt, id_slot=slot)
            return link.both - b0, fin, toks

        _, _, a_ans = turn(hist, 0)  # conversation A on slot 0
        turn(SYSTEM[:8] + user(1, 0, n_history), 0)  # B takes slot 0: A is saved into the cache
        # A comes back on slot 1: its history is restored from the cache
        restored, fin_a, _ = turn(hist + a_ans + user(0, 1), 1)
        assert fin_a.cached_tokens >= len(hist) + len(a_ans) - 1
        # the same turn where the history is still in its own slot: no restore
        c_hist = SYSTEM[:8] + user(2, 0, n_history + 56)
        _, _, c_ans = turn(c_hist, 0)
        own, fin_c, _ = turn(c_hist + c_ans + user(2, 1), 0)
        assert fin_c.cached_tokens == fin_a.cached_tokens
        (s,) = cache_stats(e)
        assert s.hits == 1
        per_token = sum(b for d, b in e.kv_bytes_per_token().items() if d.startswith("RPC"))
        return restored - own, per_token * fin_a.cached_tokens
    finally:
        e.close()  # a lost RPC connection aborts the process: the engine goes first
        link.close()


def test_on_the_split_a_restore_sends_commands_over_the_link_not_the_kv(make_engine, rpc_endpoint):
    short, kv_short = restore_cost(make_engine, rpc_endpoint, 400)
    long, kv_long = restore_cost(make_engine, rpc_endpoint, 1600)
    # a state read (llama_state_seq_get_data) would bring the peer's KV across, growing with
    # the history; the copy inside the peer costs the same few commands at any length
    assert kv_long > 3 * kv_short
    assert max(short, long) < kv_short / 10, (short, long, kv_short, kv_long)
    assert abs(long - short) < kv_short / 20, (short, long)


def test_entries_tokens_reach_the_scheduler(make_engine):
    e = make_engine(n_parallel=1, n_ctx=2048)
    run(e, SYSTEM + user(0, 0))
    run(e, user(1, 0))  # takes the slot: the first conversation is saved
    kept = e.scheduler._kept[0]
    assert len(kept) == 1 and kept[0][0] == "" and np.array_equal(kept[0][1][: len(SYSTEM)], SYSTEM)


# ---- a hybrid model: attention layers and recurrent ones (Qwen3.5's shape) -------------------------

@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.models.synthetic import ModelShape, write_hybrid_model

    # three short-convolution layers (a recurrent state) before each attention layer
    return str(write_hybrid_model(tmp_path_factory.mktemp("hybrid") / "hybrid.gguf", ModelShape(n_layer=8)))


@pytest.mark.parametrize("split", [False, True])
def test_a_hybrid_model_keeps_its_conversations_and_rolls_back_to_a_checkpoint(make_engine, hybrid_model,
                                                                               rpc_endpoint, split):
    remote = {"rpc_endpoints": [rpc_endpoint], "peer_layers": 4} if split else {}
    # 2 slots and 6 entries of 8 MiB: three conversations' last states and their prompts' checkpoints
    on = make_engine(model=hybrid_model, n_parallel=2, n_ctx=2048, prompt_cache_mib=48, **remote)
    off = make_engine(model=hybrid_model, n_parallel=2, n_ctx=2048, prompt_cache_mib=0, **remote)
    assert on.model.recurrent and on.n_kept == 6 and not on.groups[0].prefix.shareable
    got, reuse = chat(on, 3, 3)
    ref, reuse_off = chat(off, 3, 3)
    assert got == ref
    # a recurrent state is taken back whole: each returning turn continues its last state
    assert all(cached >= before - 1 for cached, before, _ in reuse), reuse
    assert all(cached == 0 for cached, _, _ in reuse_off), reuse_off
    # a turn that renders the last answer otherwise goes on from the checkpoint at its prompt's end
    first = SYSTEM + user(9, 0)
    _, answer, _ = run(on, first)
    rerendered = first + answer[3:] + user(9, 1)
    text, _, fin = run(on, rerendered)
    assert fin.cached_tokens == len(first)
    run(off, first)
    ref_text, _, ref_fin = run(off, rerendered)
    assert ref_fin.cached_tokens == 0 and text == ref_text


def test_a_hybrid_model_under_pressure_evicts_and_nothing_fails(make_engine, hybrid_model):
    e = make_engine(model=hybrid_model, n_parallel=1, n_ctx=1024, prompt_cache_mib=12)  # one entry of 8 MiB
    ref = make_engine(model=hybrid_model, n_parallel=1, n_ctx=1024, prompt_cache_mib=0)
    assert e.n_kept == 1
    assert chat(e, 3, 3)[0] == chat(ref, 3, 3)[0]
    (s,) = cache_stats(e)
    assert s.evictions > 0 and e.healthy and e.scheduler.counts() == (0, 0)


def test_an_edit_inside_a_long_prompt_of_a_hybrid_model_recomputes_from_the_checkpoint_before_it(make_engine,
                                                                                                hybrid_model):
    """Checkpoints inside a long prompt (``checkpoint_every``): the prompt's chunks end at each
    multiple, a checkpoint is kept there, and the same prompt edited after one takes it back;
    without them (0) only the prompt's end is kept and the edit is evaluated whole. The text is
    the uncached engine's."""
    every = 128
    on = make_engine(model=hybrid_model, n_parallel=1, n_ctx=2048, prompt_cache_mib=64, checkpoint_every=every)
    end_only = make_engine(model=hybrid_model, n_parallel=1, n_ctx=2048, prompt_cache_mib=64, checkpoint_every=0)
    ref = make_engine(model=hybrid_model, n_parallel=1, n_ctx=2048, prompt_cache_mib=0)
    long = SYSTEM + [t for k in range(8) for t in user(40 + k, 0)]  # 544 tokens
    edited = long[:450] + user(99, 0, 30)  # an edit after the checkpoint at 384
    for e in (on, end_only, ref):
        run(e, long)
    (s,) = cache_stats(on)
    assert s.saves >= len(long) // every  # one at each multiple, and the prompt's end
    text, _, fin = run(on, edited)
    assert fin.cached_tokens == 384
    _, _, fin_end = run(end_only, edited)
    assert fin_end.cached_tokens == 0
    ref_text, _, _ = run(ref, edited)
    assert text == ref_text


# ---- a history the other group holds (engine/cache/move.py) -------------------------------------

def greedy(e, prompt: list[int], max_tokens: int = 8, salt: str = "", id_slot: int = -1):
    """A greedy request for ``prompt`` (made, not submitted)."""
    return e.make_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                          id_slot=id_slot, cache_salt=salt)


def returning_elsewhere(e, conv: int = 0, n_user: int = 300, salt: str = "", salt_next: str | None = None,
                        answered=lambda: None):
    """Conversation ``conv``'s first turn, then a request pinned to its slot (which saves the
    history into that group's prompt cache and keeps the slot busy), then the conversation's
    next turn (under ``salt_next``): the only free slot is the other group's; ``answered()``
    once it is answered. Returns that turn's text, its final output and the history's length."""
    first = SYSTEM + user(conv, 0, n_user)
    c = e.complete(greedy(e, first, salt=salt))
    history = first + c.tokens
    held = e.slots[c.final.slot]
    r_busy = greedy(e, user(50 + conv, 0), max_tokens=4000, id_slot=held.id)
    busy = e.stream_request(r_busy)
    next(busy)  # it runs on the held slot: the scheduler's busy one from here
    try:
        c2 = e.complete(greedy(e, history + user(conv, 1), salt=salt if salt_next is None else salt_next))
        answered()
    finally:
        e.cancel(r_busy.id)
        for _ in busy:  # to its cancelled end
            pass
    assert e.slots[c2.final.slot].group != held.group  # it was served where its history was not
    return c2.text, c2.final, len(history)


def moves(e) -> list[tuple[int, int, int, int]]:
    return [g.prefix.moves() for g in e.groups]


@pytest.mark.parametrize("model", ["llama", "hybrid"])
def test_a_history_the_other_group_holds_is_moved_there_not_evaluated_again(make_engine, hybrid_model, model):
    """Two groups of one slot: a returning conversation whose group is busy is served by the
    other, which takes the history's KV (the attention cells, or the recurrent state whole)
    from the holder's context; its text is what the same turn gives evaluated from nothing.
    With ``move_min_tokens: 0`` the history is evaluated again."""
    kw = {"model": hybrid_model, "prompt_cache_mib": 96} if model == "hybrid" else {}
    on = make_engine(n_parallel=2, pipeline_groups=2, n_ctx=4096, **kw)
    off = make_engine(n_parallel=2, pipeline_groups=2, n_ctx=4096, move_min_tokens=0, **kw)
    text, fin, n_history = returning_elsewhere(on)
    assert fin.cached_tokens >= n_history - 1, (fin.cached_tokens, n_history)
    taken = moves(on)[on.slots[fin.slot].group]
    given = moves(on)[1 - on.slots[fin.slot].group]
    assert taken[:2] == (1, fin.cached_tokens) and taken[2] > 0 and given[3] == 1, moves(on)
    assert on.scheduler.n_elsewhere == 1
    ref_text, ref_fin, _ = returning_elsewhere(off)
    assert ref_fin.cached_tokens == 0 and all(m == (0, 0, 0, 0) for m in moves(off))
    assert text == ref_text
    assert on.healthy and all(v.state == "idle" for v in on.slot_views()) and on.scheduler.counts() == (0, 0)


def test_a_history_is_never_moved_to_another_salt(make_engine):
    e = make_engine(n_parallel=2, pipeline_groups=2, n_ctx=4096)
    _, fin, _ = returning_elsewhere(e, 3, salt="tenant-a", salt_next="tenant-b")
    assert fin.cached_tokens == 0 and all(m[0] == m[3] == 0 for m in moves(e)), moves(e)


def test_on_the_split_a_moved_history_costs_the_link_at_most_the_peers_kv_twice(make_engine, rpc_endpoint):
    """What a move costs on the split: the state is read from the peer and written back (the
    history's K and V in the peer's layers, each way), where evaluating the history again sends
    its activations and a graph a micro-batch. Measured over the same turns both ways."""
    link = CountingLink(int(rpc_endpoint.rsplit(":", 1)[1]))
    split = {"n_parallel": 2, "pipeline_groups": 2, "n_ctx": 8192, "rpc_endpoints": [f"127.0.0.1:{link.port}"]}
    e = make_engine(**split)
    ref = make_engine(**split, move_min_tokens=0)
    try:
        b0 = link.both
        text, fin, n_history = returning_elsewhere(e, n_user=800)
        moved = link.both - b0
        b0 = link.both
        ref_text, ref_fin, _ = returning_elsewhere(ref, n_user=800)
        evaluated = link.both - b0
        assert text == ref_text and fin.cached_tokens >= n_history - 1 and ref_fin.cached_tokens == 0
        peer_kv = sum(b for d, b in e.kv_bytes_per_token().items() if d.startswith("RPC")) * fin.cached_tokens
        (_, _, state, _), = [m for m in moves(e) if m[0]]
        assert state > peer_kv  # the state holds the peer's K and V of the history (and the local stage's)
        assert moved < evaluated + 2 * peer_kv, (moved, evaluated, peer_kv)
    finally:
        e.close()  # a lost RPC connection aborts the process: the engines go first
        ref.close()
        link.close()


def test_a_holder_that_does_not_answer_leaves_the_history_to_be_evaluated(make_engine, monkeypatch):
    """The holding group stuck (here its state read blocks): the parked request starts without
    the state after ``MOVE_WAIT_S`` and evaluates its history; the state that comes late is
    not taken."""
    import threading

    import engine.group

    monkeypatch.setattr(engine.group, "MOVE_WAIT_S", 0.5)
    e = make_engine(n_parallel=2, pipeline_groups=2, n_ctx=4096)
    ref = make_engine(n_parallel=2, pipeline_groups=2, n_ctx=4096, move_min_tokens=0)
    release = threading.Event()
    for g in e.groups:
        real = g.runner.export_history

        def stuck(*a, real=real):
            release.wait(60)
            return real(*a)

        g.runner.export_history = stuck
    try:
        text, fin, _ = returning_elsewhere(e, 4, answered=release.set)
    finally:
        release.set()
    ref_text, ref_fin, _ = returning_elsewhere(ref, 4)
    assert fin.cached_tokens == ref_fin.cached_tokens == 0 and text == ref_text
    assert all(m[0] == 0 for m in moves(e)), moves(e)
    assert e.healthy and e.scheduler.counts() == (0, 0)
