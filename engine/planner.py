"""The first part of a step: what a group computes next, as a typed plan. No native write.

A plan holds, in batch order, the tokens each slot contributes (``Entry``: a generating
slot's last token and its draft, then prompt chunks up to the batch's capacity, claimed
shortest first: see ``prompt_order``), the rows sampled after the decode (``Row``: where a
slot's logits are in the batch and in the logits read back) and the KV copies the decode makes due
(``Copy``: a waiting slot takes its leader's prefix once the leader's KV holds it; an n > 1
follower then samples its first token from the leader's row). The runner fills the
``llama_batch``, decodes and makes the copies; ``Plan.advance`` then moves every slot's prompt
on by what was computed or copied, and the output processor samples the rows.

A prompt's medium (an image's embedding rows: engine/media.py) is a ``MediaEntry`` of its own:
llama.cpp takes no batch of tokens and embeddings mixed, so the runner decodes each medium whole,
before the step's batch of tokens; a prompt chunk stops where a medium begins.

How a request starts is planned here too (``plan_start``: what of the KV it reuses, or whose
prefix it waits for); the runner carries it out (``Runner.begin``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.batching import Entry, count_ubatches, order_entries
from engine.cache.prefix import Reuse
from engine.media import MediaSpan, is_media
from engine.slots import Slot, SlotState

if TYPE_CHECKING:
    from engine.cache.prefix import PrefixCache
    from engine.config import SpeculativeConfig
    from engine.types import Request


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
class Copy:
    """After the decode, ``dst`` (waiting for ``src``) takes the first ``n`` tokens of ``src``'s
    KV; ``row`` is the follower's row on its leader's logits, sampled only when the copy was
    made (``done``, set by the runner)."""

    src: Slot
    dst: Slot
    n: int
    row: Row | None
    done: bool = False


@dataclass(slots=True)
class MediaEntry:
    """A medium of a slot's prompt, decoded whole as its own batch of embedding rows."""

    slot: Slot
    span: MediaSpan

    @property
    def tokens(self) -> list[int]:
        """Its rows' ids in the prompt (what the slot's KV then holds)."""
        return self.slot.req.prompt_tokens[self.span.start : self.span.start + self.span.n]


@dataclass(slots=True)
class Plan:
    entries: list[Entry]  # batch order
    rows: list[Row]  # logits order, then the followers' rows on their leaders' logits
    n_tokens: int
    n_logits: int
    n_ubatches: int  # how llama.cpp will cut the batch (for the profiler)
    copies: list[Copy]
    # the prompts that could take tokens, each with whether others held it back this step
    turns: list[tuple[Slot, bool]] = field(default_factory=list)
    media: list[MediaEntry] = field(default_factory=list)  # decoded before the batch, in this order

    @property
    def n_prompt(self) -> int:
        """The prompt positions this step evaluates (media rows among them)."""
        return sum(len(e.tokens) for e in self.entries if e.slot.state is SlotState.PROMPT) + \
            sum(m.span.n for m in self.media)

    def advance(self) -> None:
        """The decode ran: each prompt is on by its chunk, each waiting slot has what its copy
        gave (nothing when it failed: it evaluates its prompt itself, without a row now); a
        prompt held back counts one more step in a row, one that got its due counts none."""
        for m in self.media:
            m.slot.n_prompt_done += m.span.n
        for e in self.entries:
            if e.slot.state is SlotState.PROMPT:
                e.slot.n_prompt_done += len(e.tokens)
        for s, held in self.turns:
            s.n_passed = s.n_passed + 1 if held else 0
        for c in self.copies:
            c.dst.got_prefix(c.n if c.done else 0)
            if c.row is not None and not c.done:
                self.rows.remove(c.row)


@dataclass(frozen=True, slots=True)
class Start:
    """How a request starts on its slot: what it reuses of the KV (``reuse``), or, an n > 1
    follower, the ``leader`` whose prompt it takes whole."""

    slot: Slot
    request: Request
    reuse: Reuse
    leader: Slot | None = None


def plan_start(slot: Slot, r: Request, slots: list[Slot], prefix: PrefixCache, cache_prompt: bool,
               leader: Slot | None = None) -> Start:
    """The start of ``r`` on ``slot`` among the group's ``slots``; a follower reuses nothing
    of its own (its leader's prompt comes as a copy)."""
    assert slot.state is SlotState.IDLE, f"slot {slot.id} is busy"
    if leader is not None:
        return Start(slot, r, Reuse(), leader)
    ok = cache_prompt and r.cache_prompt
    return Start(slot, r, prefix.plan(slot, r.prompt_tokens, slots, own=ok, share=ok, salt=r.cache_salt))


def generating(active: list[Slot]) -> list[Slot]:
    return [s for s in active if s.state is SlotState.GENERATING]


def prompting(active: list[Slot]) -> list[Slot]:
    """The slots with prompt tokens left to evaluate (those waiting for another's prefix too)."""
    return [s for s in active if s.state is SlotState.PROMPT]


def prompt_to_compute(s: Slot) -> int:
    """The prompt tokens a slot's request evaluates itself: its prompt less what it reused."""
    return len(s.req.prompt_tokens) - s.n_reused


def n_short(active: list[Slot], long_prompt: int) -> int:
    """The short prompts (at most ``long_prompt`` tokens to evaluate) waiting for their first
    token that the step can serve (not those waiting for another slot's prefix)."""
    return sum(1 for s in prompting(active) if not s.waiting and prompt_to_compute(s) <= long_prompt)


def prompt_order(prompts: list[Slot], aging: int) -> list[Slot]:
    """The order in which prompts claim a step's prompt tokens: those held back ``aging`` steps
    in a row first, then the fewest tokens left to evaluate first; among equals, the order in
    which the slots became busy. ``aging`` 0: that order alone (first come, first served)."""
    if aging <= 0:
        return prompts
    return sorted(prompts, key=lambda s: (s.n_passed < aging, len(s.req.prompt_tokens) - s.n_prompt_done))


def draft_requests(gen: list[Slot], spec: SpeculativeConfig, n_ctx_slot: int) -> list[tuple[Slot, list[int], int]]:
    """The generating slots that draft this step: (slot, its history, most draft tokens).
    None when more slots generate than the speculation's ``max_rows``."""
    if not gen or len(gen) > spec.max_rows:
        return []
    rows = []
    for s in gen:
        if not s.req.params.speculative or (s.req.media and spec.type != "ngram"):
            continue  # a draft model, or MTP layers, never saw a medium's rows
        # the last verified row is the request's last token: never draft past n_predict
        limit = min(spec.n_max, s.req.n_predict - s.n_generated - 1, n_ctx_slot - len(s.cache_tokens) - 1)
        if limit >= spec.n_min and (s.spec.wants() or not spec.backoff):
            rows.append((s, [*s.cache_tokens, s.last_token], limit))
    return rows


def plan_step(active: list[Slot], drafts: dict[int, list[int]], capacity: int, n_ubatch: int,
              unified: bool, prompt_budget: int | None = None, long_prompt: int = 0,
              beside_short: int | None = None, aging: int = 0, checkpoint_every: int = 0) -> Plan:
    """This step's work for the group's ``active`` slots (in the order they became busy);
    ``drafts`` maps a slot id to its draft tokens; ``capacity`` is the batch's size.
    ``prompt_budget`` (chunked prefill, engine/budget.py): the most tokens the step takes of
    prompts with more than ``long_prompt`` tokens to evaluate; shorter ones go whole.
    Prompts claim tokens in ``prompt_order`` (``aging``); ``beside_short`` (a short prompt
    waits in some group): the most tokens of long prompts, but for those held back ``aging``
    steps in a row. ``checkpoint_every``: a prompt's chunk ends at each multiple of it (where
    the group keeps a checkpoint of a state that cannot be cut back)."""
    gen = generating(active)
    entries: list[Entry] = []
    free = capacity - len(gen)
    for s in gen:
        draft = drafts.get(s.id, ())[:free]
        free -= len(draft)
        entries.append(Entry(s, s.seq_id, len(s.cache_tokens), [s.last_token, *draft], True, list(draft)))
    first = free  # what a prompt claiming first may take
    budget = free if prompt_budget is None else prompt_budget
    cut = beside_short
    turns: list[tuple[Slot, bool]] = []
    media: list[MediaEntry] = []
    for s in prompt_order([s for s in prompting(active) if not s.waiting], aging):
        p = s.req.prompt_tokens
        if s.req.media and is_media(p[s.n_prompt_done]):
            # a medium next: decoded whole, on its own, before the batch; its text follows next step
            span = next(m for m in s.req.media if m.start == s.n_prompt_done)
            media.append(MediaEntry(s, span))
            if prompt_budget is not None:
                budget -= span.n
            turns.append((s, False))
            continue
        left = len(p) - s.n_prompt_done
        long = prompt_to_compute(s) > long_prompt
        due = min(left, first)  # what it would take first
        n = min(left, free)
        if long:
            if prompt_budget is not None:
                due = min(due, prompt_budget)
            n = min(n, budget)
            if cut is not None and not (aging > 0 and s.n_passed >= aging):
                n = min(n, cut)
        n = max(n, 0)
        turns.append((s, n < due))
        if n == 0:
            continue
        if s.req.media:  # a chunk stops where the next medium begins
            nxt = next((m.start for m in s.req.media if m.start > s.n_prompt_done), None)
            if nxt is not None:
                n = min(n, nxt - s.n_prompt_done)
        if checkpoint_every:
            mark = (s.n_prompt_done // checkpoint_every + 1) * checkpoint_every
            if mark < len(p):
                n = min(n, mark - s.n_prompt_done)
        chunk = p[s.n_prompt_done : s.n_prompt_done + n]
        free -= n
        if long:
            budget -= n
            if cut is not None:
                cut -= n
        entries.append(Entry(s, s.seq_id, s.n_prompt_done, chunk, s.n_prompt_done + n == len(p)))
    entries = order_entries(entries)
    rows: list[Row] = []
    n_tokens = n_logits = 0
    for e in entries:
        if e.out:
            rows.append(Row(e.slot, n_tokens + len(e.tokens) - 1 - len(e.draft), n_logits, e.draft, e.pos0))
            n_logits += 1 + len(e.draft)
        n_tokens += len(e.tokens)
    copies = _copies(entries, rows)
    return Plan(entries, rows, n_tokens, n_logits, count_ubatches(entries, n_ubatch, unified), copies, turns,
                media)


def _copies(entries: list[Entry], rows: list[Row]) -> list[Copy]:
    """The slots waiting for a leader of this step whose prefix the leader's KV holds after
    it; an n > 1 follower gets a row on its leader's (appended to ``rows``)."""
    copies: list[Copy] = []
    by_slot: dict[int, Row] | None = None  # made only in a step that has a due copy
    for e in entries:
        s = e.slot
        held = len(s.cache_tokens) + len(e.tokens)
        for w in s.waiters:
            if held < w.n_from_leader:
                continue
            row = None
            if w.on_leader_row:
                if by_slot is None:
                    by_slot = {r.slot.id: r for r in rows}
                if (lr := by_slot.get(s.id)) is not None:
                    row = Row(w, lr.batch_idx, lr.logits_idx, [], lr.pos0)
                    rows.append(row)
            copies.append(Copy(s, w, w.n_from_leader, row))
    return copies
