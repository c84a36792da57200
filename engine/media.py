"""Images (and audio) in a prompt: how a prompt carries media through the engine.

A prompt with media stays one list of ints. The ingress puts ``MEDIA_SLOT`` where each image
goes; the projector (``engine.native.projector``) replaces each by what mtmd makes of it: its
own text tokens around it, if any, and one position per embedding row, whose id is negative
(``media_ids``): derived from a keyed hash of the image's bytes and the row's place, never a
token of the vocabulary. So a prompt's length is its positions, the scheduler counts an image
as the positions it takes, and the prefix and prompt caches compare prompts as before: the same
image at the same place is the same ids, and its KV is reused; another image differs at its
first row. A reuse never stops inside an image (``media_boundary``), as llama-server's never
does. The embedding rows themselves travel beside the ids (``MediaSpan``), evaluated as their
own decode (a batch of embeddings, llama.cpp takes no mix of tokens and embeddings).

The hash is keyed with a secret of this process: nobody can make two images whose ids agree
(31 bits per image; a chance collision between two different images at the same place of a
prompt is one in two billion)."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

MEDIA_SLOT = -1  # in an ingress's prompt: the next of the request's media goes here
_SPAN = 2**31 - 3  # media ids are -2 .. -(2**31 - 2)
_KEY = os.urandom(16)


def media_key(data: bytes) -> bytes:
    """A medium's identity in this process: a keyed 128-bit hash of its bytes."""
    return hashlib.blake2b(data, key=_KEY, digest_size=16).digest()


def media_hash(data: bytes, key: bytes | None = None) -> int:
    """Where a medium's ids start (from its ``media_key``, when known)."""
    return int.from_bytes((key or media_key(data))[:8], "little") % _SPAN


def media_ids(h: int, n: int) -> list[int]:
    """The ids of ``n`` rows of the medium of hash ``h``: consecutive, descending."""
    return [-2 - ((h + k) % _SPAN) for k in range(n)]


def is_media(t: int) -> bool:
    return t < MEDIA_SLOT


def media_boundary(tokens: list[int] | np.ndarray, n: int) -> int:
    """``n`` (a reusable prefix of ``tokens``), moved back to the start of the medium it would
    cut through: a medium's rows are evaluated whole or not at all."""
    if n <= 0 or n >= len(tokens) or not is_media(int(tokens[n])):
        return n
    while n > 0 and is_media(int(tokens[n - 1])) and _next_row(int(tokens[n - 1])) == int(tokens[n]):
        n -= 1
    return n


def _next_row(t: int) -> int:
    return -2 - ((-2 - t + 1) % _SPAN)


@dataclass(frozen=True)
class MediaSpan:
    """One medium in a request's prompt: its first index and its embedding rows, and where a
    projector with M-RoPE places them (``engine/cache/positions.py``)."""

    start: int
    embd: np.ndarray  # (n_rows, n_embd) float32
    causal: bool = True  # False: its rows attend to each other (decoded in one micro-batch)
    # M-RoPE: each row's positions in the four sections (time, row, column, and a fourth), as
    # mtmd places them for a medium at position 0 (int32, shape (4, n_rows)); ``moves``: 1
    # where a position moves with the medium's first position, 0 where it is absolute
    sections: np.ndarray | None = None
    moves: np.ndarray | None = None
    n_positions: int | None = None  # the positions the medium takes in all (None: one a row)

    @property
    def n(self) -> int:
        return len(self.embd)

    def sections_at(self, p0: int, rows: slice) -> np.ndarray:
        """The M-RoPE positions of ``rows`` of the medium when it starts at position ``p0``."""
        return self.sections[:, rows] + p0 * self.moves[:, rows]

    @property
    def n_pos(self) -> int:
        """The positions the medium takes: one a row, or as its projector places them."""
        return self.n if self.n_positions is None else self.n_positions
