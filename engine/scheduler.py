"""Which request runs on which slot: the wait queue and the choice over all groups' slots.

The scheduler never touches a context. It knows each slot only through the ``SlotView``
its group published when the slot last went idle, chooses by longest common prefix (else
least recently used) over the idle slots of every group, and hands the request to the
owning group as a message. Its lock is held only for bookkeeping, never across a native
call or a wait on a group.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from engine.prefix import group_prefixes
from engine.slots import SlotView, choose_slot
from engine.types import FinishReason, Output, QueueFullError, Request


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
    ) -> None:
        self._lock = threading.Lock()
        self._views = {v.id: v for v in views}
        self._idle: set[int] = {v.id for v in views}
        self._last_used: dict[int, float] = {}
        self._waiting: OrderedDict[str, Request] = OrderedDict()
        self._running: dict[str, Request] = {}
        self._slot_request: dict[int, str] = {}
        self._slot_prompt: dict[int, np.ndarray] = {}  # a busy slot's prompt: its KV will hold it
        self.share_prefix = share_prefix  # groups share prefixes between their slots
        self.share_min = share_min  # ... of at least this many tokens
        self._dispatch = dispatch
        self._cancel_running = cancel_running
        self._sink = sink
        self.max_queued = max_queued
        self.similarity = similarity
        self.n_deferred_total = 0

    def submit(self, r: Request) -> None:
        with self._lock:
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
        if r.id_slot >= 0:
            return r.id_slot in self._idle
        n = len(r.followers) + 1
        return any(len(vs) >= n for vs in self._idle_by_group().values())

    def _assign(self, r: Request) -> None:
        n = len(r.followers) + 1
        idle = [v for vs in self._idle_by_group().values() if len(vs) >= n for v in vs]
        busy: dict[int, set[int]] = {}
        for sid in self._slot_request:
            b = self._views[sid]
            busy.setdefault(b.group, set()).add(b.seq_id)
        prompt = np.asarray(r.prompt_tokens, dtype=np.int32)
        if r.id_slot >= 0:
            v = self._views[r.id_slot]
        else:
            held = None
            if self.share_prefix and r.cache_prompt:
                held = group_prefixes([(w.group, w.cached_tokens) for w in self._views.values()]
                                      + [(self._views[sid].group, p) for sid, p in self._slot_prompt.items()], prompt)
            v = choose_slot(idle, prompt, self._last_used, self.similarity, busy, held, self.share_min)
        # followers: the group's other idle slots nearest in sequence id (one micro-batch)
        others = sorted((w for w in idle if w.group == v.group and w.id != v.id), key=lambda w: abs(w.seq_id - v.seq_id))
        for member, slot in zip(r.family, [v, *others], strict=False):
            self._idle.discard(slot.id)
            member.slot_id = slot.id
            self._running[member.id] = member
            self._slot_request[slot.id] = member.id
            self._slot_prompt[slot.id] = prompt
        self._dispatch(v.group, r)

    def release(self, view: SlotView, finished: bool) -> None:
        """A group published a slot (idle again after a request, or after a slot action)."""
        with self._lock:
            self._views[view.id] = view
            if not finished:
                return
            self._slot_prompt.pop(view.id, None)
            rid = self._slot_request.pop(view.id, None)
            if rid is not None:
                self._running.pop(rid, None)
            self._idle.add(view.id)
            self._last_used[view.id] = time.monotonic()
            self._start_waiting()

    def _start_waiting(self) -> None:
        """First come, first served: a request waiting for several slots of one group holds
        back the ones behind it until they are free; one waiting for a given busy slot
        (``id_slot``) holds back none."""
        for rid, r in list(self._waiting.items()):
            if not self._idle:
                return
            if self._fits(r):
                del self._waiting[rid]
                self._assign(r)
            elif r.id_slot < 0:
                return

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            r = self._waiting.pop(request_id, None)
            if r is None:
                running = self._running.get(request_id)
                if running is None:
                    return False
                group = self._views[running.slot_id].group
        if r is not None:
            self._sink([Output(m.id, "", 0, FinishReason.CANCELLED, len(m.prompt_tokens)) for m in r.family])
            return True
        self._cancel_running(group, request_id)
        return True

    def views(self) -> list[SlotView]:
        with self._lock:
            return [self._views[i] for i in sorted(self._views)]

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._lock:
            return len(self._running), len(self._waiting)
