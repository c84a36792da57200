"""Where a sequence's tokens sit among the model's positions.

For most models the token at index ``i`` of a sequence sits at position ``i``. A projector
with M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) places an image's rows otherwise: all on the
temporal position the image starts at, with their row and column in two more sections, and the
image takes ``n_pos`` positions (``max(nx, ny)``) for its ``n`` rows, so every token after it
sits ``n - n_pos`` lower than its index, as mtmd places them.

A sequence keeps that as its ``shifts``: for each such medium, the index just after it and the
total shift from there on, ascending. Empty for every other model (and every text-only
sequence), where a position is an index. The engine keeps indexes everywhere (a prompt's
tokens, a slot's cached tokens, a reuse's length) and turns one into a position only where it
meets llama.cpp: a batch's positions and a sequence's KV cut or copy. A cut never falls inside
a medium (``engine.media.media_boundary``), so a position is defined at every index cut at.
"""

from __future__ import annotations

Shifts = list[tuple[int, int]]  # (the index after a medium, the total shift from there on)


def shift_at(shifts: Shifts, i: int) -> int:
    """How far below its index the token at ``i`` sits (outside a medium)."""
    s = 0
    for end, total in shifts:
        if end > i:
            break
        s = total
    return s


def position(shifts: Shifts, i: int) -> int:
    """The position of index ``i`` (the first row's, for the index a medium starts at)."""
    return i - shift_at(shifts, i) if shifts else i


def after_medium(shifts: Shifts, end: int, n_rows: int, n_pos: int) -> None:
    """A medium of ``n_rows`` rows taking ``n_pos`` positions now ends at index ``end``."""
    if n_rows != n_pos:
        shifts.append((end, (shifts[-1][1] if shifts else 0) + n_rows - n_pos))


def cut(shifts: Shifts, n: int) -> None:
    """The sequence keeps its first ``n`` indexes."""
    while shifts and shifts[-1][0] > n:
        shifts.pop()


def kept(shifts: Shifts, n: int) -> Shifts:
    """The shifts of the first ``n`` indexes (a copy)."""
    return [e for e in shifts if e[0] <= n]
