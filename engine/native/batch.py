"""A ``llama_batch`` whose arrays are numpy buffers, so a step fills it with slices.
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp
import numpy as np

log = logging.getLogger(__name__)


class Batch:
    """A ``llama_batch`` whose arrays are numpy buffers, so a step fills it with slices.

    Each token belongs to exactly one sequence; ``seq_id[i]`` points into one int32 array.
    With ``n_embd``, every row carries a vector beside its token too (an MTP context's input:
    the token and the hidden state that came before it).
    """

    def __init__(self, capacity: int, n_embd: int = 0, *, embeddings_only: bool = False, n_sections: int = 1) -> None:
        """``embeddings_only`` (with ``n_embd``): the rows are their vectors alone, no token
        (a medium's rows from the projector); ``n_sections``: the positions of each such row
        (4 with M-RoPE: ``set_sections``)."""
        self.capacity = capacity
        self.embd = np.zeros((capacity, n_embd), np.float32) if n_embd else None
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity * n_sections, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self._seq_ptrs = (i32p * capacity)(*[ctypes.cast(base + 4 * i, i32p) for i in range(capacity)])
        self.struct = llama_cpp.llama_batch(
            n_tokens=0,
            token=None if embeddings_only else self.token.ctypes.data_as(i32p),
            embd=self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if n_embd else None,
            pos=self.pos.ctypes.data_as(i32p),
            n_seq_id=self.n_seq_id.ctypes.data_as(i32p),
            seq_id=ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32p)),
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        self.n_tokens = 0

    def clear(self) -> None:
        self.n_tokens = 0
        self.struct.n_tokens = 0

    def add(self, tokens: list[int], pos0: int, seq_id: int, n_logits: int | bool,
            embd: np.ndarray | None = None) -> int:
        """Append tokens of one sequence, the last ``n_logits`` of them with logits (a bool:
        the last one or none), and with ``embd`` their vectors; returns the row of the first
        token."""
        n = len(tokens)
        i = self.n_tokens
        if i + n > self.capacity:
            raise ValueError("batch overflow")
        if embd is not None:
            self.embd[i : i + n] = embd
        self.token[i : i + n] = tokens
        self.pos[i : i + n] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self.seq[i : i + n] = seq_id
        self.logits[i : i + n] = 0
        if n_logits:
            self.logits[i + n - int(n_logits) : i + n] = 1
        self.n_tokens = i + n
        self.struct.n_tokens = self.n_tokens
        return i

    def set_sections(self, pos: np.ndarray) -> None:
        """The rows' positions in every M-RoPE section (``pos``: (sections, n_tokens)), laid
        out as llama.cpp reads an embeddings batch's: section by section, ``n_tokens`` apart."""
        k, n = pos.shape
        if n != self.n_tokens or k * n > len(self.pos):
            raise ValueError("the sections must give every row of the batch its positions")
        self.pos[: k * n] = pos.reshape(-1)

    @property
    def free(self) -> int:
        return self.capacity - self.n_tokens
