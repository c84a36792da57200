"""Comparing two runs that llama.cpp's CPU kernels round differently: a row computed in a batch
of another size (another group's split, a verify batch of drafts) moves its log probabilities by
a few thousandths, so a seeded draw that lands on a boundary of the distribution, or the last
place of a top-k list, may flip. What must hold is the distribution, not the draw."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

ROUNDING = 0.02  # nats: how far two runs' log probabilities of one token may differ
NEAR_TIE = 0.3  # logits (the tiny models' spread about 16): two greedy picks this close are a tie


def cpu_llama(path: str, **kw: object) -> object:
    """llama-cpp-python's ``Llama`` on this node's CPU alone, the oracle of greedy comparisons:
    with no devices given, llama.cpp takes every registered one and asks each for its memory,
    and an RPC device registered earlier in the process whose server is gone aborts it there."""
    import llama_cpp
    from llama_cpp import llama_cpp as lib

    from engine.native.devices import resolve_devices

    devices, default = resolve_devices(["CPU"]), lib.llama_model_default_params

    def params() -> object:
        p = default()
        p.devices = ctypes.cast(devices, ctypes.c_void_p)
        return p

    lib.llama_model_default_params = params
    try:
        return llama_cpp.Llama(path, **kw)
    finally:
        lib.llama_model_default_params = default


def logit_gap(llm: object, prompt: list[int], a: list[int], b: list[int]) -> float:
    """0 where two greedy answers to ``prompt`` are equal, else how far the worse of the two
    tokens where they part is from llama.cpp's own best there (one sequence, unsplit, ``llm``
    made with ``logits_all``): under ``NEAR_TIE``, each is llama.cpp's pick up to rounding."""
    import numpy as np

    k = first_difference(a, b)
    if k is None:
        return 0.0
    if k >= min(len(a), len(b)):  # one ended where the other went on: no token to weigh
        return float("inf")
    llm.reset()
    llm.eval(prompt + a[:k])
    row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    best = float(row.max())
    return float(max(best - row[a[k]], best - row[b[k]]))


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
