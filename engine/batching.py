"""How one step's work is laid out in a ``llama_batch``, and how llama.cpp will cut it.

llama.cpp splits a batch into micro-batches (ubatches) before computing it, and every
ubatch reads all the weights again, so the number of ubatches per step is what a step
costs. With one KV stream (``kv_unified``) the batch is cut in order into pieces of
``n_ubatch`` tokens. With one stream per sequence (the default of llama.cpp) a ubatch may
only hold sequences whose ids are consecutive and ascending *in batch order*, and takes the
same number of tokens from each; a batch whose rows follow the order in which slots became
busy is cut into many ubatches. So the plan orders its entries by sequence id, and
``count_ubatches`` reproduces the splitter's rule for the profiler (checked against
llama.cpp's own graph computations in tests/test_batching.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Entry:
    """The tokens one slot contributes to a step; ``out`` when its last token wants logits.
    A drafting row's tokens are its last token and its ``draft``, all with logits."""

    slot: Any
    seq_id: int
    pos0: int
    tokens: list[int]
    out: bool
    draft: list[int] = field(default_factory=list)


def order_entries(entries: list[Entry]) -> list[Entry]:
    """Batch order: ascending sequence id (each sequence appears at most once per step)."""
    return sorted(entries, key=lambda e: e.seq_id)


def count_ubatches(entries: list[Entry], n_ubatch: int, unified: bool) -> int:
    """How many ubatches llama.cpp cuts these entries (in batch order) into."""
    if unified:
        n = sum(len(e.tokens) for e in entries)
        return -(-n // n_ubatch)
    left = [len(e.tokens) for e in entries]
    n_ub = 0
    while True:
        chosen: list[int] = []
        last = -1
        for i, e in enumerate(entries):
            if left[i] == 0:
                continue
            if chosen and e.seq_id != last + 1:
                continue
            chosen.append(i)
            last = e.seq_id
            if len(chosen) >= n_ubatch:
                break
        if not chosen:
            return n_ub
        rounds = min(min(left[i] for i in chosen), max(1, n_ubatch // len(chosen)))
        for i in chosen:
            left[i] -= rounds
        n_ub += 1
