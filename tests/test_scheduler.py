"""Choosing a slot across groups (engine/scheduler.py) from the snapshots the groups publish:
a cached prefix, least recently used, balance between groups, consecutive sequences."""

import numpy as np

from engine.cache.prefix import group_prefixes
from engine.cache.tokens import common_prefix
from engine.scheduler import choose_slot
from engine.slots import SlotView

SYSTEM_PROMPT = list(range(100, 200))  # a 100-token shared prefix


def view(i: int, tokens: list[int], group: int = 0, seq_id: int | None = None) -> SlotView:
    seq = i if seq_id is None else seq_id
    return SlotView(i, group, seq, "idle", len(tokens), None, np.asarray(tokens, dtype=np.int32))


def idle_view(i: int, group: int, seq: int, tokens: list[int]) -> SlotView:
    return view(i, tokens, group, seq)


def test_common_prefix():
    a = np.array([1, 2, 3, 4], np.int32)
    assert common_prefix(a, np.array([1, 2, 9], np.int32)) == 2
    assert common_prefix(a, a[:2]) == 2
    assert common_prefix(a, np.array([], np.int32)) == 0


def test_choose_slot_by_longest_common_prefix():
    views = [view(0, [1, 2]), view(1, [1, 2, 3, 4]), view(2, [])]
    prompt = np.array([1, 2, 3, 4, 5], np.int32)
    assert choose_slot(views, prompt, {}, 0.1).id == 1


def test_choose_slot_lru_when_no_prefix():
    views = [view(0, [7]), view(1, [8]), view(2, [9])]
    prompt = np.array([1, 2, 3], np.int32)
    assert choose_slot(views, prompt, {0: 5.0, 1: 1.0, 2: 3.0}, 0.1).id == 1


def test_choose_slot_lru_when_prefix_below_similarity():
    views = [view(0, [1] + [0] * 10), view(1, [])]
    prompt = np.array([1] + [5] * 99, np.int32)
    assert choose_slot(views, prompt, {0: 9.0, 1: 1.0}, 0.1).id == 1


def test_choose_slot_spreads_empty_slots_over_groups():
    # two groups of four slots, nothing cached: the first request goes to group 0, the second
    # to group 1 (not slot 1 of group 0 as lowest id or LRU order would have it)
    views = [view(i, [], group=i // 4, seq_id=i % 4) for i in range(8)]
    prompt = np.array([1, 2, 3], np.int32)
    assert choose_slot(views, prompt, {}, 0.1, {}).id == 0
    assert choose_slot(views[1:], prompt, {}, 0.1, {0: {0}}).group == 1


def test_choose_slot_prefers_less_busy_group_among_near_equal_prefixes():
    shared = list(range(100, 300))  # a 200-token system prompt cached everywhere
    views = [view(1, shared + [5], group=0, seq_id=1), view(5, shared + [6], group=1, seq_id=1)]
    prompt = np.asarray(shared + [7, 8, 9], np.int32)
    assert choose_slot(views, prompt, {}, 0.1, {0: {0, 2}, 1: set()}).id == 5
    assert choose_slot(views, prompt, {}, 0.1, {0: set(), 1: {0, 2}}).id == 1
    # a much longer prefix still wins over balance
    long_prompt = np.asarray(shared[:20] + [7, 8, 9], np.int32)
    views2 = [view(1, shared[:20] + [7, 8], group=0, seq_id=1), view(5, shared[:5], group=1, seq_id=1)]
    assert choose_slot(views2, long_prompt, {}, 0.1, {0: {0, 2}, 1: set()}).id == 1


def test_choose_slot_keeps_busy_sequences_consecutive():
    # group 0 runs sequences 0 and 2: sequence 1 joins them into one run; LRU would pick 3
    views = [view(1, [], seq_id=1), view(3, [], seq_id=3)]
    prompt = np.array([1, 2], np.int32)
    assert choose_slot(views, prompt, {3: 0.0, 1: 9.0}, 0.1, {0: {0, 2}}).id == 1


def test_a_prefix_held_in_a_group_is_weighed_against_balance():
    prompt = np.asarray(SYSTEM_PROMPT + [5], np.int32)
    idle = [idle_view(0, 0, 1, []), idle_view(1, 1, 0, []), idle_view(2, 1, 1, [])]
    held = group_prefixes([(0, np.asarray(SYSTEM_PROMPT + [3], np.int32)), (1, np.asarray([1, 2], np.int32))], prompt)
    assert held == {0: 100}
    # group 0 holds the prefix (one slot busy computing it): it takes the request
    assert choose_slot(idle, prompt, {}, 0.1, {0: {0}}, held, 32).group == 0
    # busier by two: balance wins, and group 1 computes the prefix once for itself
    assert choose_slot(idle, prompt, {}, 0.1, {0: {0, 2}}, held, 32).group == 1
    # below min_shared a held prefix is not weighed
    assert choose_slot(idle, prompt, {}, 0.1, {0: {0}}, held, 200).group == 1
    # a slot's own cached prefix still wins over balance, as before
    own = [idle_view(0, 0, 1, SYSTEM_PROMPT + [3]), idle_view(1, 1, 0, [])]
    assert choose_slot(own, prompt, {}, 0.1, {0: {0, 2, 3}}, held, 32).id == 0


def test_a_long_history_held_in_a_group_outweighs_a_busier_group():
    history = list(range(3000, 4500))  # 1,500 tokens: one busy slot and one more per 256 tokens
    prompt = np.asarray(history + [5, 6], np.int32)
    idle = [idle_view(0, 0, 3, []), idle_view(4, 1, 0, []), idle_view(5, 1, 1, [])]
    held = {0: len(history)}
    # group 0 runs three requests, group 1 none: the history still wins
    assert choose_slot(idle, prompt, {}, 0.1, {0: {0, 1, 2}}, held, 32, long_prompt=256).group == 0
    # a short prefix does not: balance wins
    short = {0: 100}
    assert choose_slot(idle, np.asarray(history[:100] + [5], np.int32), {}, 0.1, {0: {0, 1, 2}}, short, 32,
                       long_prompt=256).group == 1
