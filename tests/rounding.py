"""Comparing two runs that llama.cpp's CPU kernels round differently: a row computed in a batch
of another size (another group's split, a verify batch of drafts) moves its log probabilities by
a few thousandths, so a seeded draw that lands on a boundary of the distribution, or the last
place of a top-k list, may flip. What must hold is the distribution, not the draw."""

from __future__ import annotations

from collections.abc import Sequence

ROUNDING = 0.02  # nats: how far two runs' log probabilities of one token may differ


def same_distribution(top1: dict, top2: dict, tol: float = ROUNDING) -> bool:
    """Two top-k lists (token -> log probability) of one position are the same distribution up to
    rounding: the tokens in both agree within ``tol``, and a token in one list only is a near tie
    with the last place of the other (it fell out at the cut by rounding)."""
    common = set(top1) & set(top2)
    if any(abs(top1[k] - top2[k]) >= tol for k in common):
        return False
    for mine, other in ((top1, top2), (top2, top1)):
        floor = min(other.values(), default=0.0)
        if any(abs(mine[k] - floor) >= tol for k in set(mine) - common):
            return False
    return True


def first_difference(a: Sequence, b: Sequence) -> int | None:
    """The first position where two token lists differ, or None when they are equal."""
    d = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if d is None and len(a) != len(b):
        return min(len(a), len(b))
    return d


def agree_until_they_differ(t1: list[int], lp1: list, t2: list[int], lp2: list) -> bool:
    """Whether two sampled runs are equal, or differ only from a position where both runs'
    distributions agree to rounding, up to and at that position (``lp``: each token's
    ``(piece, logprob, top)`` as the engine gives it). Returns True when they are equal."""
    d = first_difference(t1, t2)
    if d is None:
        return True
    for i in range(min(d + 1, len(lp1), len(lp2))):
        top1, top2 = dict(lp1[i][2]), dict(lp2[i][2])
        assert same_distribution(top1, top2), (i, top1, top2)
    return False
