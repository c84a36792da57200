"""A history moved between groups: the KV another group's context holds, taken instead of
evaluated again.

Each group is its own llama_context, so the prompt cache and the slots' shared prefixes serve a
returning conversation only in the group that last held it. When the scheduler sends a request
to one group while another holds clearly more of its prompt (``EngineConfig.move_min_tokens``
more: the holder's slots were all busy), the holder reads the state of the sequence holding it
between two of its steps (``llama_state_seq_get_data``: the positions of its cells and each
stage's K and V for them, a recurrent state whole) and the serving group writes it into the
request's slot (``llama_state_seq_set_data``) before the request starts, which then reuses it
as its slot's own prefix. What the slot held before is saved into the prompt cache first, as
before any restore.

What it costs: the state's bytes are read from every stage and written back to every stage; a
remote stage's part crosses its link twice (its layers' K and V for the history), where
evaluating the history again sends only the activations between the stages, a token at a time
per layer boundary, but computes every layer. Both stages' compute is what the move saves, and
on a real link the bytes are a small part of it (figures in docs/engine.md).

The serving group never waits on the holder's thread: its request is parked and the group
steps its other slots meanwhile; a holder that does not answer within ``MOVE_WAIT_S`` (a long
step, or a group that died) leaves the request to evaluate its history itself. A moved
state is taken only where it still beats what the serving group holds, under the request's
salt, and never into a slot a queued copy is about to read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.cache.tokens import reusable

if TYPE_CHECKING:
    from engine.cache.prefix import PrefixCache
    from engine.native.context import Context
    from engine.slots import Slot
    from engine.types import Request

MOVE_WAIT_S = 10.0  # how long a parked request waits for the holding group's state


@dataclass(frozen=True)
class Moved:
    """A sequence's state read from the holding group: the tokens its KV holds, their salt, the
    target's state and the MTP head's (None without one), and their positions."""

    tokens: tuple[int, ...]
    salt: str
    data: bytes
    mtp: bytes | None = None
    shifts: tuple[tuple[int, int], ...] = ()  # where the tokens sit (engine/cache/positions.py)

    @property
    def n_bytes(self) -> int:
        return len(self.data) + len(self.mtp or b"")


def export_history(prefix: PrefixCache, ctx: Context, mtp_ctx: Context | None, slots: list[Slot],
                   prompt: list[int], salt: str, min_n: int) -> Moved | None:
    """The state of the holding group's sequence with the longest prefix of ``prompt`` (at least
    ``min_n`` tokens, under ``salt``), read on that group's thread between its steps."""
    src = prefix.best_held(prompt, salt, slots, min_n)
    if src is None:
        return None
    moved = Moved(tuple(src.cache_tokens), src.cache_salt, ctx.seq_state(src.seq_id),
                  mtp_ctx.seq_state(src.seq_id) if mtp_ctx is not None else None, tuple(src.cache_shifts))
    prefix.n_moved_out += 1
    return moved


def take_history(prefix: PrefixCache, ctx: Context, mtp_ctx: Context | None, slot: Slot, r: Request,
                 moved: Moved, slots: list[Slot]) -> int:
    """Write ``moved`` into ``slot`` for ``r`` when it gives clearly more than the serving group
    holds already (``share_min`` tokens); returns the prompt tokens it gives (0: not taken, the
    slot as it was)."""
    prompt = np.asarray(r.prompt_tokens, np.int32)
    if moved.salt != r.cache_salt or prefix.copying_from(slot):
        return 0
    n = reusable(moved.tokens, prompt, len(prompt) - 1)
    if prefix.whole_only and n != len(moved.tokens):
        return 0
    here = prefix.plan(slot, r.prompt_tokens, slots, own=True, share=True, salt=r.cache_salt).n
    if n < here + prefix.share_min:
        return 0
    prefix.save(slot, 0, None, slots)  # what the slot held goes into the prompt cache first
    prefix.drop(slot)
    ok = ctx.set_seq_state(moved.data, slot.seq_id)
    if ok and mtp_ctx is not None:  # the MTP head's KV follows the target's, position for position
        ok = moved.mtp is not None and mtp_ctx.set_seq_state(moved.mtp, slot.seq_id)
    if not ok:
        prefix.drop(slot)
        return 0
    prefix.load(slot, list(moved.tokens), list(moved.shifts))
    slot.cache_salt = moved.salt
    prefix.n_moved_in += 1
    prefix.n_moved_tokens += n
    prefix.n_moved_bytes += moved.n_bytes
    return n
