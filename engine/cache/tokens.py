"""Token lists compared: how much of a prompt a sequence's tokens cover, never cutting a medium."""

from __future__ import annotations

import numpy as np

from engine.media import media_boundary


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _lcp(a: list[int] | np.ndarray, b: np.ndarray) -> int:
    return common_prefix(np.asarray(a, np.int32), b)


def reusable(a: list[int] | np.ndarray, p: np.ndarray, cap: int) -> int:
    """What ``p`` may reuse of a sequence holding ``a``: their common prefix, at most ``cap``,
    never cutting through a medium (engine/media.py)."""
    return media_boundary(p, min(_lcp(a, p), cap))
