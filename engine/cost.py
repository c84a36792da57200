"""What a step costs: a model of a decode step's seconds, fitted online from the steps that ran.

    seconds(rows, k) ~ base(rows) + k * u(k)

``base(rows) = a + b * rows`` is a step of ``rows`` generating rows and no prompt tokens, an
exponentially weighted least-squares line through the steps without prompt tokens (the recent
ones weigh most). ``u(k)`` is what one prompt token adds to a step when ``k`` of them go
together: a table by chunk size, one bucket per power of two, each an exponentially weighted
mean of ``(seconds - base(rows)) / k`` over the steps whose chunk fell in it. A chunk's cost
per token falls with its size (8 tokens read the weights once as 256 do), so the cost of one
size says little about another's: between two sizes it has seen, ``u`` is interpolated on
``log2(k)``; below the smallest it is the smallest's; above the largest it follows the line
through the sizes seen (a chunk's cost ~ d + c * k: a part per chunk and one per token), never
more a token than the largest seen. Without that line a chunk larger than any seen would cost
the largest's per token, and a budget that compares a chunk with the whole batch would never
learn that the whole batch is cheaper a token (engine/budget.py).

Nothing here knows the device: the figures are the steps' own, on a CPU (a prompt token costs a
fair share of a row) as on a GPU (a chunk of hundreds costs little more than a decode step).
The groups of an engine share one model (same weights, same stages); each group's thread writes
it after its steps and reads it before them, always under the prefill budget's lock
(engine/budget.py): a write reads the sums it replaces.
"""

from __future__ import annotations

import math

DECAY = 0.95  # weight of the earlier decode steps in the line, per step (about 20 steps' memory)
EMA = 0.2  # weight of the newest step in a chunk bucket's mean
N_BUCKETS = 16  # chunks of 1 to 65,535 tokens


class StepCost:
    def __init__(self) -> None:
        # the line's weighted sums over decode steps: weight, rows, seconds, rows^2, rows*seconds
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0)
        self._line: tuple[float, float] | None = None  # (a, b)
        self._u: list[float | None] = [None] * N_BUCKETS  # seconds per prompt token, by bucket
        self._size: list[float] = [0.0] * N_BUCKETS  # the mean chunk size each bucket has seen
        self._seen: list[tuple[float, float]] = []  # (log2 size, u) of the buckets seen, by size
        self._chunk_line: tuple[float, float] | None = None  # (d, c) through the sizes seen

    # ---- learning ---------------------------------------------------------------------------

    def observe(self, rows: int, k: int, seconds: float) -> None:
        """A step of ``rows`` generating rows and ``k`` prompt tokens ran for ``seconds``."""
        if k <= 0:
            if rows > 0:
                self._fit(rows, seconds)
            return
        base = self.base(rows) if rows > 0 else self.fixed()
        per = max(seconds - (base or 0.0), 0.0) / k
        i = _bucket(k)
        old = self._u[i]
        self._u[i] = per if old is None else old + EMA * (per - old)
        self._size[i] = k if old is None else self._size[i] + EMA * (k - self._size[i])
        self._seen = [(math.log2(self._size[j]), u) for j, u in enumerate(self._u) if u is not None]
        self._chunk_line = _chunk_line([(self._size[j], self._size[j] * u) for j, u in enumerate(self._u)
                                        if u is not None])

    def _fit(self, rows: int, seconds: float) -> None:
        w, sx, sy, sxx, sxy = (DECAY * v for v in self._sums)
        w, sx, sy, sxx, sxy = w + 1, sx + rows, sy + seconds, sxx + rows * rows, sxy + rows * seconds
        self._sums = (w, sx, sy, sxx, sxy)
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var > 0.1:  # the rows have varied enough for a slope
            b = (sxy / w - mx * my) / var
            a = my - b * mx
            if b < 0:
                a, b = my, 0.0  # more rows never cost less: flat
            elif a < 0:
                a, b = 0.0, my / mx  # through the origin
        else:  # one row count: the line through the origin and the mean
            a, b = 0.0, my / mx
        self._line = (a, b)

    # ---- predicting -------------------------------------------------------------------------

    def base(self, rows: int) -> float | None:
        """Seconds of a step of ``rows`` generating rows without prompt tokens (None: no step seen)."""
        if self._line is None:
            return None
        a, b = self._line
        return a + b * rows

    def fixed(self) -> float | None:
        """A step's part that does not grow with rows (the line's intercept)."""
        return None if self._line is None else self._line[0]

    def per_token(self, k: int) -> float | None:
        """Seconds one prompt token adds to a step when ``k`` go together (None: no chunk seen)."""
        seen = self._seen
        if not seen:
            return None
        x = math.log2(max(k, 1))
        if x <= seen[0][0]:
            return seen[0][1]
        for (x0, u0), (x1, u1) in zip(seen, seen[1:], strict=False):
            if x <= x1:
                return u0 + (u1 - u0) * (x - x0) / (x1 - x0) if x1 > x0 else u1
        last = seen[-1][1]
        if self._chunk_line is None:
            return last
        d, c = self._chunk_line
        return min(last, c + d / k)

    def step(self, rows: int, k: int) -> float | None:
        """Seconds of a step of ``rows`` generating rows and ``k`` prompt tokens."""
        base = self.base(rows) if rows > 0 else (self.fixed() or 0.0)
        if base is None:
            return None
        if k <= 0:
            return base
        u = self.per_token(k)
        return None if u is None else base + k * u

    def buckets(self) -> list[tuple[int, float]]:
        """The table: (mean chunk size, seconds per token) of every bucket seen (for logs and tests)."""
        return [(round(self._size[i]), u) for i, u in enumerate(self._u) if u is not None]


def _chunk_line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """The least-squares line ``cost = d + c * size`` through (chunk size, chunk cost) points, with
    ``c`` and ``d`` at least 0; None with fewer than two sizes."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if var <= 0:
        return None
    c = max(sum((x - mx) * (y - my) for x, y in points) / var, 0.0)
    return max(my - c * mx, 0.0), c


def _bucket(k: int) -> int:
    return min(N_BUCKETS - 1, k.bit_length() - 1)
