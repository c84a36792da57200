"""The first part of a step: what a group computes next, as a typed plan. No native call.

A plan holds, in batch order, the tokens each slot contributes (``Entry``: a generating
slot's last token and its draft, then prompt chunks up to the batch's capacity, in the order
the slots became busy) and the rows sampled after the decode (``Row``: where a slot's logits
are in the batch and in the logits read back). The runner fills the ``llama_batch`` from it;
the output processor samples its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.batching import Entry, count_ubatches, order_entries
from engine.slots import Slot, SlotState

if TYPE_CHECKING:
    from engine.config import SpeculativeConfig


@dataclass(slots=True)
class Row:
    """A slot sampled this step: the batch index and the logits row of its first output, and
    the draft verified on the rows after it (empty without speculation)."""

    slot: Slot
    batch_idx: int
    logits_idx: int
    draft: list[int]
    pos0: int


@dataclass(slots=True)
class Plan:
    entries: list[Entry]  # batch order
    rows: list[Row]  # logits order
    n_tokens: int
    n_logits: int
    n_ubatches: int  # how llama.cpp will cut the batch (for the profiler)


def generating(active: list[Slot]) -> list[Slot]:
    return [s for s in active if s.state is SlotState.GENERATING]


def draft_requests(gen: list[Slot], spec: SpeculativeConfig, n_ctx_slot: int) -> list[tuple[Slot, list[int], int]]:
    """The generating slots that draft this step: (slot, its history, most draft tokens).
    None when more slots generate than the speculation's ``max_rows``."""
    if not gen or len(gen) > spec.max_rows:
        return []
    rows = []
    for s in gen:
        if not s.req.params.speculative:
            continue
        # the last verified row is the request's last token: never draft past n_predict
        limit = min(spec.n_max, s.req.n_predict - s.n_generated - 1, n_ctx_slot - len(s.cache_tokens) - 1)
        if limit >= spec.n_min and s.spec.wants():
            rows.append((s, [*s.cache_tokens, s.last_token], limit))
    return rows


def plan_step(active: list[Slot], drafts: dict[int, list[int]], capacity: int, n_ubatch: int,
              unified: bool) -> Plan:
    """This step's work for the group's ``active`` slots (in the order they became busy);
    ``drafts`` maps a slot id to its draft tokens; ``capacity`` is the batch's size."""
    gen = generating(active)
    entries: list[Entry] = []
    free = capacity - len(gen)
    for s in gen:
        draft = drafts.get(s.id, ())[:free]
        free -= len(draft)
        entries.append(Entry(s, s.seq_id, len(s.cache_tokens), [s.last_token, *draft], True, list(draft)))
    for s in active:
        if s.state is not SlotState.PROMPT or free == 0 or s.waiting:
            continue
        p = s.req.prompt_tokens
        chunk = p[s.n_prompt_done : s.n_prompt_done + free]
        free -= len(chunk)
        entries.append(Entry(s, s.seq_id, s.n_prompt_done, chunk, s.n_prompt_done + len(chunk) == len(p)))
    entries = order_entries(entries)
    rows: list[Row] = []
    n_tokens = n_logits = 0
    for e in entries:
        if e.out:
            rows.append(Row(e.slot, n_tokens + len(e.tokens) - 1 - len(e.draft), n_logits, e.draft, e.pos0))
            n_logits += 1 + len(e.draft)
        n_tokens += len(e.tokens)
    return Plan(entries, rows, n_tokens, n_logits, count_ubatches(entries, n_ubatch, unified))
