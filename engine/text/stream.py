"""Turning token bytes into streamable text: UTF-8 hold-back and stop strings.

A token's piece may end inside a multi-byte character, and a stop string may span several
tokens. ``TextStream`` emits only text that is complete and cannot be the start of a stop
string; the rest is held until the next token decides it.
"""

from __future__ import annotations

import codecs


def partial_stop_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class TextStream:
    """Accumulates token pieces, returns what may be sent, detects stop strings."""

    __slots__ = ("_decoder", "_held", "stops", "stopped_by")

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self.stops = tuple(s for s in stops if s)
        self.stopped_by: str | None = None

    def feed(self, piece: bytes) -> str:
        """Add a token's bytes; returns the text that is now safe to emit (maybe empty).

        After a stop string is found, ``stopped_by`` is set and the text before it is returned.
        """
        text = self._held + self._decoder.decode(piece)
        if not self.stops:
            self._held = ""
            return text
        cut = -1
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut, self.stopped_by = i, s
        if cut >= 0:
            self._held = ""
            return text[:cut]
        keep = partial_stop_suffix(text, self.stops)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held text at the end of generation (not called after a stop string)."""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return text
