"""Which request runs on which slot: the wait queues and the choice over all groups' slots.

The scheduler never touches a context. It knows each slot only through the ``SlotView``
its group published when the slot last went idle, chooses by longest common prefix (else
least recently used) over the idle slots of every group, and hands the request to the
owning group as a message. Its lock is held only for bookkeeping, never across a native
call or a wait on a group.

Two kinds of request wait. One that any slot can take waits in the one queue, bounded by
``max_queued``; when a slot frees, the waiting request with the fewest prompt tokens to
evaluate (after an idle slot's cached prefix) starts first, and one passed over ``aging``
times by later arrivals starts next. One pinned to a slot (``id_slot``) waits for that slot
alone, in the slot's own queue, bounded by ``max_queued_per_slot``: it takes the slot before
anyone else when the slot frees, and never holds back, nor counts against, the others.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice

import numpy as np

from engine.cache.prefix import group_prefixes
from engine.cache.tokens import common_prefix
from engine.slots import SlotView
from engine.types import Finish, FinishReason, Output, QueueFullError, Request

# A prefix this close to the longest one counts as equal, so that the less busy group wins.
NEAR_PREFIX = 0.9
# A held prefix counts one busy slot fewer for its group, and one more for each this many tokens
# of it (at least; prefill_long_tokens where larger).
HELD_UNIT = 256
# The waiting requests weighed for a free slot (the oldest ones; aging moves the rest up).
ADMIT_WINDOW = 64


def choose_slot(
    idle: list[SlotView],
    prompt: np.ndarray,
    last_used: dict[int, float],
    similarity: float,
    busy: dict[int, set[int]] | None = None,
    held: dict[int, int] | None = None,
    min_shared: int = 1,
    decoding: dict[int, int] | None = None,
    long_prompt: int = 0,
    kept: dict[int, int] | None = None,
    salt: str = "",
) -> SlotView:
    """The slot for a new prompt.

    Longest common prefix with the slot's own cached tokens when it covers at least
    ``similarity`` of the prompt; among near-equal prefixes (and when no prefix is good
    enough) the group with the least load (below), so that the groups share it at any
    concurrency; then the slot that keeps the group's busy sequence ids consecutive (one
    micro-batch per step, see engine/batching.py); then least recently used.
    ``busy`` maps a group to the sequence ids of its busy slots.

    ``held`` (groups that share prefixes between their slots) maps a group to the longest
    prefix of the prompt that any of its slots holds or is computing (``group_prefixes``).
    When that is at least ``min_shared`` tokens and clearly longer than any idle slot's own, it is weighed against balance: a
    group holding it counts one busy slot fewer, and one more per ``HELD_UNIT`` (or
    ``long_prompt``) tokens of it, so it takes the request unless it is already that much
    busier than another group (a conversation's long history outweighs balance).

    A group's load is its busy slots; for a prompt with more than ``long_prompt`` tokens to
    evaluate on the slot (after what it reuses there), its streams decoding (``decoding``
    maps a group to them) count once more, so that a long prompt goes where its chunks stall
    the fewest streams (a prefix that saves work still wins first).
    """
    if not idle:
        raise ValueError("no idle slot")
    busy = busy or {}
    decoding = decoding or {}
    n = len(prompt)

    def load(v: SlotView, reused: int | None = None) -> int:
        k = len(busy.get(v.group, ()))
        if n - (lcp[v.id] if reused is None else reused) > long_prompt:
            k += decoding.get(v.group, 0)
        return k

    def new_runs(v: SlotView) -> int:
        seqs = busy.get(v.group, set())
        return 1 - (v.seq_id - 1 in seqs) - (v.seq_id + 1 in seqs)

    def rest(v: SlotView) -> tuple:
        return (new_runs(v), last_used.get(v.id, 0.0), v.id)

    def enough(k: int) -> bool:
        return k > 0 and n > 0 and k / n >= similarity

    def lost(v: SlotView) -> int:
        # what the slot holds past the prompt's prefix: saved into the prompt cache or dropped
        return v.n_cached - lcp[v.id]

    lcp = {v.id: common_prefix(v.cached_tokens, prompt) if v.cache_salt == salt else 0 for v in idle}
    best = max(lcp.values())
    in_group = {v.group: h if (h := (held or {}).get(v.group, 0)) >= min_shared else 0 for v in idle}
    best_held = max(in_group.values())
    if enough(best) and best >= NEAR_PREFIX * best_held:
        # a slot of a group that shares its slots' KV starts from what its group holds, as a copy;
        # what a slot costs is what it evaluates and what of its own KV it displaces (into the
        # prompt cache, or dropped): of the slots that cost near the least, the least loaded
        def start(v: SlotView) -> int:
            return max(lcp[v.id], in_group[v.group])

        def cost(v: SlotView) -> int:
            return n - start(v) + (lost(v) if lost(v) > min_shared else 0)

        least = min(cost(v) for v in idle)
        near = [v for v in idle if cost(v) <= least + (1 - NEAR_PREFIX) * n]
        return min(near, key=lambda v: (load(v, start(v)), cost(v), (kept or {}).get(v.group, 0), -lcp[v.id],
                                        *rest(v)))
    if enough(best_held):
        unit = max(long_prompt, HELD_UNIT)

        def weighed(v: SlotView) -> tuple:
            # the group holding the prefix counts one busy slot fewer, and one more for every
            # ``unit`` tokens of it: a long history outweighs a busier group
            h = in_group[v.group]
            bonus = (1 + h // unit) if h >= NEAR_PREFIX * best_held else 0
            return (load(v, max(h, lcp[v.id])) - bonus, -h, lost(v), -lcp[v.id], *rest(v))

        return min(idle, key=weighed)
    return min(idle, key=lambda v: (load(v), *rest(v)))


class Scheduler:
    def __init__(
        self,
        views: list[SlotView],
        dispatch: Callable[[int, Request], None],
        cancel_running: Callable[[int, str], None],
        sink: Callable[[list[Output]], None],
        max_queued: int,
        similarity: float,
        share_prefix: bool = False,
        share_min: int = 1,
        max_queued_per_slot: int | None = None,
        long_prompt: int = 0,
        aging: int = 0,
        move: Callable[[int, int, Request], None] | None = None,
        move_min: int = 0,
    ) -> None:
        """``move(source, group, r)``: start ``r`` on ``group`` with the state of its history
        read from group ``source``, used when ``source`` holds at least ``move_min`` more of its
        prompt than ``group`` (engine/cache/move.py); 0: never."""
        self._lock = threading.Lock()
        self._views = {v.id: v for v in views}
        self._idle: set[int] = {v.id for v in views}
        self._last_used: dict[int, float] = {}
        self._waiting: OrderedDict[str, Request] = OrderedDict()  # for any slot
        self._pinned: dict[int, OrderedDict[str, Request]] = {}  # slot -> the requests waiting for it
        self._passed: dict[str, int] = {}  # a waiting request -> later arrivals started before it
        # a waiting request held in another group -> events a free slot elsewhere waited for it
        self._deferred: dict[str, int] = {}
        self._running: dict[str, Request] = {}
        self._slot_request: dict[int, str] = {}
        self._slot_prompt: dict[int, tuple[str, np.ndarray]] = {}  # a busy slot's salt and prompt: its KV will hold it
        self._kept: dict[int, list[tuple[str, np.ndarray]]] = {}  # group -> its prompt cache's entries' salts, tokens
        self.share_prefix = share_prefix  # groups share prefixes between their slots
        self.share_min = share_min  # ... of at least this many tokens
        self._dispatch = dispatch
        self._move = move if move_min > 0 else None
        self.move_min = move_min
        self._cancel_running = cancel_running
        self._sink = sink
        self.max_queued = max_queued
        self.max_queued_per_slot = max_queued if max_queued_per_slot is None else max_queued_per_slot
        self.similarity = similarity
        self.long_prompt = long_prompt  # a prompt with more tokens to evaluate weighs decoding streams
        self.aging = aging  # 0: first come, first served
        self.n_deferred_total = 0
        # requests sent to a group while another held clearly more of their prompt (a slot's or
        # its prompt cache's), and the prompt tokens that other group held beyond it
        self.n_elsewhere = 0
        self.n_deferred_away = 0  # ... of them sent once they had waited ``aging`` events
        self.n_elsewhere_tokens = 0

    def submit(self, r: Request) -> None:
        """Start ``r`` now or queue it; raises ``QueueFullError`` (HTTP 429) when its queue is
        full: the one for any slot, or, pinned (``id_slot``), its slot's own."""
        with self._lock:
            if r.id_slot >= 0:
                q = self._pinned.get(r.id_slot)
                if not q and r.id_slot in self._idle:
                    self._assign(r)
                    return
                n = len(q or ())
                if n >= self.max_queued_per_slot:
                    raise QueueFullError(f"slot {r.id_slot} is busy and {n} requests wait for it")
                self._pinned.setdefault(r.id_slot, OrderedDict())[r.id] = r
            else:
                if not self._waiting and self._fits(r):
                    self._assign(r)
                    return
                if len(self._waiting) >= self.max_queued:
                    raise QueueFullError(
                        f"all {len(self._views)} slots are busy and {len(self._waiting)} requests wait"
                    )
                self._waiting[r.id] = r
            self.n_deferred_total += 1
            self._start_waiting()  # slots may be idle that the requests ahead cannot use

    def _idle_by_group(self) -> dict[int, list[SlotView]]:
        out: dict[int, list[SlotView]] = {}
        for i in self._idle:
            v = self._views[i]
            out.setdefault(v.group, []).append(v)
        return out

    def _fits(self, r: Request) -> bool:
        """Whether the request (with its followers, all in one group) can start now."""
        n = len(r.followers) + 1
        return any(len(vs) >= n for vs in self._idle_by_group().values())

    def _assign(self, r: Request) -> None:
        n = len(r.followers) + 1
        idle = [v for vs in self._idle_by_group().values() if len(vs) >= n for v in vs]
        busy: dict[int, set[int]] = {}
        decoding: dict[int, int] = {}
        for sid in self._slot_request:
            b = self._views[sid]
            busy.setdefault(b.group, set()).add(b.seq_id)
            if b.state == "generating":
                decoding[b.group] = decoding.get(b.group, 0) + 1
        prompt = np.asarray(r.prompt_tokens, dtype=np.int32)
        held = None
        if self.share_prefix and r.cache_prompt:
            salt = r.cache_salt  # a prefix of another salt's is nobody's to route by
            held = group_prefixes([(w.group, w.cached_tokens) for w in self._views.values() if w.cache_salt == salt]
                                  + [(self._views[sid].group, p) for sid, (s, p) in self._slot_prompt.items() if s == salt]
                                  + [(g, t) for g, ts in self._kept.items() for s, t in ts if s == salt], prompt)
        if r.id_slot >= 0:
            v = self._views[r.id_slot]
        else:
            v = choose_slot(idle, prompt, self._last_used, self.similarity, busy, held, self.share_min,
                            decoding, self.long_prompt, {g: len(ts) for g, ts in self._kept.items()}, r.cache_salt)
        source = None  # the group whose KV is moved to ``v``'s for the request
        if held:
            here = max(held.get(v.group, 0), common_prefix(v.cached_tokens, prompt) if v.cache_salt == r.cache_salt else 0)
            elsewhere = max(held.values()) - here
            if elsewhere >= self.share_min:
                self.n_elsewhere += 1
                self.n_elsewhere_tokens += elsewhere
            if self._move is not None and elsewhere >= self.move_min:
                source = max(held, key=held.get)
        # followers: the group's other idle slots nearest in sequence id (one micro-batch)
        others = sorted((w for w in idle if w.group == v.group and w.id != v.id), key=lambda w: abs(w.seq_id - v.seq_id))
        for member, slot in zip(r.family, [v, *others], strict=False):
            self._idle.discard(slot.id)
            member.slot_id = slot.id
            self._running[member.id] = member
            self._slot_request[slot.id] = member.id
            self._slot_prompt[slot.id] = (r.cache_salt, prompt)
        if source is not None:
            self._move(source, v.group, r)
        else:
            self._dispatch(v.group, r)

    def kept(self, group: int, tokens: list[tuple[str, np.ndarray]]) -> None:
        """A group's prompt cache holds ``tokens`` (one salt and array an entry) now."""
        with self._lock:
            self._kept[group] = tokens

    def publish(self, view: SlotView, freed: bool) -> None:
        """A group publishes a slot's view (``freed``: idle again after a request or a slot action)."""
        with self._lock:
            self._views[view.id] = view
            if not freed:
                return
            self._slot_prompt.pop(view.id, None)
            rid = self._slot_request.pop(view.id, None)
            if rid is not None:
                self._running.pop(rid, None)
            self._idle.add(view.id)
            self._last_used[view.id] = time.monotonic()
            self._start_waiting()

    def _start_waiting(self) -> None:
        """Each idle slot that requests are pinned to goes to the oldest of them; the other idle
        slots to the requests for any slot, by ``_next_waiting``."""
        for sid in [sid for sid in self._pinned if sid in self._idle]:
            q = self._pinned[sid]
            _, r = q.popitem(last=False)
            if not q:
                del self._pinned[sid]
            self._assign(r)
        while self._idle and self._waiting:
            r = self._next_waiting()
            if r is None:
                return
            del self._waiting[r.id]
            self._passed.pop(r.id, None)
            self._deferred.pop(r.id, None)
            self._assign(r)

    def _next_waiting(self) -> Request | None:
        """The waiting request to start now, of those that fit (a request waiting for several
        slots of one group holds back the ones behind it until they are free): one passed over
        ``aging`` times, the oldest first; else the one with the fewest prompt tokens to
        evaluate, the oldest among equals. Those before it are passed over once more, but for
        those whose prompt another group holds clearly more of (in a slot or its prompt cache):
        they wait for that group's slots."""
        fit: list[Request] = []
        for r in islice(self._waiting.values(), ADMIT_WINDOW):
            if not self._fits(r):
                break
            fit.append(r)
        if not fit or self.aging <= 0:
            return fit[0] if fit else None
        here, away = self._prompt_costs(fit)
        chosen = next((r for r in fit if self._passed.get(r.id, 0) >= self.aging), None)
        if chosen is None:
            mine = [r for r in fit if r.id not in away]
            if not mine:
                # every waiting request's history is in another group: the free slot waits for a
                # request of its own (each event a request is passed so counts once), rather than
                # evaluate a history again, until one has waited ``aging`` events
                r = min(fit, key=lambda r: here[r.id])
                self._deferred[r.id] = self._deferred.get(r.id, 0) + 1
                if self._deferred[r.id] <= self.aging:
                    return None
                self.n_deferred_away += 1
                return r
            chosen = min(mine, key=lambda r: here[r.id])
        for r in fit:
            if r is chosen:
                break
            if r.id not in away:  # one that waits for its own group's slots is not passed over
                self._passed[r.id] = self._passed.get(r.id, 0) + 1
        return chosen

    def _prompt_costs(self, fit: list[Request]) -> tuple[dict[str, int], set[str]]:
        """For each waiting request, the prompt tokens it would evaluate on a free slot (after
        the free slots' own KV and their groups' prompt caches), and the requests whose prompt
        another group holds clearly more of (in a slot or its prompt cache): one pass over what
        every slot and entry holds."""
        groups = {self._views[i].group for i in self._idle}
        held = [(i in self._idle, v.cache_salt, v.cached_tokens) for i, v in self._views.items()] + [
            (g in groups, s, t) for g, ts in self._kept.items() for s, t in ts]
        here: dict[str, int] = {}
        away: set[str] = set()
        for r in fit:
            p = np.asarray(r.prompt_tokens, dtype=np.int32)
            on_free = anywhere = 0
            for free, salt, t in held:
                n = common_prefix(t, p) if salt == r.cache_salt else 0
                anywhere = max(anywhere, n)
                if free:
                    on_free = max(on_free, n)
            here[r.id] = len(p) - on_free
            if self.share_prefix and anywhere - on_free >= self.share_min:
                away.add(r.id)
        return here, away

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            r = self._waiting.pop(request_id, None)
            self._passed.pop(request_id, None)
            self._deferred.pop(request_id, None)
            if r is None:
                for sid, q in self._pinned.items():
                    if (r := q.pop(request_id, None)) is not None:
                        if not q:
                            del self._pinned[sid]
                        break
            if r is None:
                running = self._running.get(request_id)
                if running is None:
                    return False
                group = self._views[running.slot_id].group
        if r is not None:
            self._sink([Finish(m.id, "", 0, FinishReason.CANCELLED, len(m.prompt_tokens)) for m in r.family])
            return True
        self._cancel_running(group, request_id)
        return True

    def views(self) -> list[SlotView]:
        with self._lock:
            return [self._views[i] for i in sorted(self._views)]

    def counts(self) -> tuple[int, int]:
        """(running, waiting): waiting for any slot or for a pinned one."""
        with self._lock:
            return len(self._running), len(self._waiting) + sum(len(q) for q in self._pinned.values())
