"""Routing across engine replicas (pairs): a Ray Serve request router.

Every call to the engine deployment goes through it, in the ingress's process:

- a call that names a replica (``replica=<id>``: an output stream, a cancel, a slot
  action) goes to that replica; when it is gone, to any (which refuses it);
- a submit (``route=Route(replicas, prefix)``) goes to the replica, among those the ingress
  holds an output stream to, that last took the longest prefix of this prompt, unless it is
  busier than the least busy by more than ``imbalance`` requests; else to the less busy of
  two (the power of two choices). Busy is the replica's running and waiting requests from
  its routing stats plus what this router sent it since they came;
- anything else goes to any replica.

The prefix is the prompt's text cut in chunks, each chunk's hash chained to the ones before
(``prefix_hashes``), so a hash stands for a whole prefix. The table from prefix to replica is
this router's own (one per ingress replica), bounded, least recently used out.
"""

from __future__ import annotations

import collections
import hashlib
import importlib
import json
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


@dataclass(frozen=True)
class Route:
    """What a submit tells the router: the replicas its ingress holds a stream to, and the
    prompt's chained prefix hashes (``prefix_hashes``)."""

    replicas: tuple[str, ...]
    prefix: tuple[str, ...]


log = logging.getLogger(__name__)

STATS_PERIOD_S = 1.0  # how often engine replicas report their load (RequestRouterConfig)
# sends this recent count as load on top of the stats: a burst spreads, while one client's
# back-to-back requests (each done in a fraction of a second) do not pile up as phantom load
SEND_WINDOW_S = 0.25
CHUNK_CHARS = 256
MAX_CHUNKS = 64
TABLE_SIZE = 50_000

# replica ids each router instance of this process currently knows, by deployment name: the
# ingress opens one output stream per engine replica it learns of here
_KNOWN: dict[str, set[str]] = {}


def known_replicas(deployment: str) -> set[str]:
    return set(_KNOWN.get(deployment, ()))


def prefix_hashes(text: str | list[int], salt: str = "") -> list[str]:
    """Chained hashes of the prompt's successive chunks (characters, or token ids), keyed by the
    request's ``cache_salt``: requests of two salts never share a prefix's replica."""
    out, h = [], hashlib.blake2b(digest_size=8, key=hashlib.blake2b(salt.encode("utf-8", "surrogatepass"),
                                                                     digest_size=32).digest() if salt else b"")
    if isinstance(text, list):
        chunks = [json.dumps(text[i:i + CHUNK_CHARS // 4]) for i in range(0, len(text), CHUNK_CHARS // 4)]
    else:
        chunks = [text[i:i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)]
    for c in chunks[:MAX_CHUNKS]:
        h.update(c.encode("utf-8", "surrogatepass"))
        out.append(h.copy().hexdigest())
    return out


def routing_text(req: Any) -> str | list[int]:
    """What the prefix of a request is read from: a completion's prompt, a chat's messages."""
    prompt = getattr(req, "prompt", None)
    if prompt is not None:
        return prompt
    return json.dumps([[m.role, m.text()] for m in req.messages], ensure_ascii=False)


class PairRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, imbalance: int = 8, **_: Any) -> None:
        self.imbalance = imbalance
        self._table: OrderedDict[str, str] = OrderedDict()  # prefix hash -> replica id
        self._sent: dict[str, collections.deque] = {}  # when requests were sent to each replica

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # Serve ships this class pickled by value, with its own copy of this module's globals:
        # the registry the ingress reads is the imported module's
        known = importlib.import_module(__name__)._KNOWN
        known[self._deployment_id.name] = {r.replica_id.unique_id for r in replicas}
        log.info("pair router: replicas of %s: %s", self._deployment_id.name, sorted(known[self._deployment_id.name]))

    def _busy(self, r: RunningReplica) -> int:
        """Running and waiting requests as the replica last said, plus those sent to it in the
        last ``SEND_WINDOW_S`` (not in the stats yet; a few may count twice)."""
        rid = r.replica_id.unique_id
        stats = r.routing_stats or {}
        sent = self._sent.setdefault(rid, collections.deque())
        horizon = time.monotonic() - SEND_WINDOW_S
        while sent and sent[0] < horizon:
            sent.popleft()
        return int(stats.get("running", 0)) + int(stats.get("waiting", 0)) + len(sent)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        kw = pending_request.kwargs
        target = kw.get("replica")
        if target is not None:
            hit = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            return [hit] if hit else [candidate_replicas]
        route = kw.get("route")
        if not route:
            return [candidate_replicas]
        allowed = [r for r in candidate_replicas if r.replica_id.unique_id in route.replicas] or candidate_replicas
        busy = {r.replica_id.unique_id: self._busy(r) for r in allowed}
        least = min(busy.values())
        chosen = None
        by_id = {r.replica_id.unique_id: r for r in allowed}
        for h in reversed(route.prefix):  # the longest prefix first
            rid = self._table.get(h)
            if rid in by_id and busy[rid] - least <= self.imbalance:
                chosen = by_id[rid]
                break
        if chosen is None:
            two = random.sample(allowed, min(2, len(allowed)))
            chosen = min(two, key=lambda r: busy[r.replica_id.unique_id])
        cid = chosen.replica_id.unique_id
        self._sent.setdefault(cid, collections.deque()).append(time.monotonic())
        for h in route.prefix:
            self._table[h] = cid
            self._table.move_to_end(h)
        while len(self._table) > TABLE_SIZE:
            self._table.popitem(last=False)
        return [[chosen], [r for r in allowed if r is not chosen]]
