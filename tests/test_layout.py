"""The benchmark's pinned cells: which cores each stage gets on boxes of different sizes."""

from bench.layout import layout


def test_two_cores_give_each_stage_one_and_let_the_rest_float():
    lay = layout([0, 1])
    assert (lay.peer, lay.local, lay.rest, lay.threads) == ([0], [1], [], 1)


def test_sixteen_cores_give_each_stage_a_third_and_the_rest_its_own():
    lay = layout(list(range(16)))
    assert lay.peer == [0, 1, 2, 3, 4] and lay.local == [5, 6, 7, 8, 9] and lay.rest == list(range(10, 16))
    assert lay.threads == 5 and lay.every == list(range(16))
    assert not set(lay.peer) & set(lay.local) and "5-9" in lay.describe()
