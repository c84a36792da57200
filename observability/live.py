"""What an engine replica measures when it is asked, and nothing in between: each stage's busy
share since the last ask (for a Prometheus scrape, and separately for the page at /), and the
page's live figures (slots by group, tokens per second and TTFT over the last minute)."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from observability.gpu import node_meter
from observability.metrics import EngineMetrics
from observability.process import rss_bytes

# (when, the local stage's decode CPU seconds, the peer's CPU seconds): a busy share's last ask
Sample = tuple[float, float, float | None]


def cache_view(p: Any, kv_per_token: dict[str, int]) -> dict[str, Any]:
    """One group's prompt cache as /slots and the page show it (``p``: the group's profiler
    snapshot): its entries, the tokens and the KV bytes they hold on each stage's device, and
    its counters since start, the invalidations by cause."""
    return {"entries": p.cache_entries, "capacity": p.cache_capacity, "tokens": p.cache_tokens,
            "bytes": {device: p.cache_tokens * per for device, per in kv_per_token.items()},
            "hits": p.cache_hits, "misses": p.cache_misses, "reused_tokens": p.cache_reused, "saves": p.cache_saves,
            "invalidations": {"evicted": p.cache_evictions, "superseded": p.cache_superseded},
            "moved_in": p.moved_in, "moved_tokens": p.moved_tokens, "moved_out": p.moved_out}


class LiveFigures:
    def __init__(self, engine: Any, config: Any, metrics: EngineMetrics,
                 stage_health: Callable[[], Awaitable[dict | None]], replica: str, topology: dict) -> None:
        self.engine, self.config, self.metrics = engine, config, metrics
        self.stage_health, self.replica, self.topology = stage_health, replica, topology
        self._last_scrape: Sample | None = None
        self._last_page: Sample | None = None
        self._rate_samples: deque[tuple[float, float]] = deque(maxlen=1024)

    async def scrape(self) -> bytes:
        """The replica's metrics in Prometheus's text format, its gauges sampled now."""
        running, waiting = self.engine.scheduler.counts()
        self.metrics.collect_engine(self.engine, running, waiting)
        busy, peer, self._last_scrape = await self._stage_busy(self._last_scrape)
        self.metrics.set_stage_rss("local", rss_bytes(os.getpid()))
        if peer is not None:
            self.metrics.set_stage_up(bool(peer["accepting"]))
            self.metrics.set_stage_rss("peer", int(peer.get("rss_bytes", 0)))
        for stage, ratio in busy.items():
            self.metrics.set_stage_busy(stage, ratio)
        self.metrics.set_gpu_busy("local", node_meter().busy())
        self.metrics.set_gpu_busy("peer", (peer or {}).get("gpu_busy"))
        return self.metrics.render()

    async def _stage_busy(self, last: Sample | None) -> tuple[dict[str, float], dict | None, Sample]:
        """Each stage's busy share since ``last`` (a sample this returns), and the peer's health:
        CPU seconds over wall seconds and threads."""
        now = time.monotonic()
        local_cpu = sum(p.decode_cpu for p in self.engine.profiles())
        peer = await self.stage_health()
        busy: dict[str, float] = {}
        if last is not None:
            dt = max(now - last[0], 1e-9)
            busy["local"] = (local_cpu - last[1]) / dt / self.config.local_threads()
            if peer is not None and last[2] is not None:
                busy["peer"] = (peer["cpu_seconds"] - last[2]) / dt / peer["threads"]
        return ({k: max(0.0, min(1.0, v)) for k, v in busy.items()}, peer,
                (now, local_cpu, peer["cpu_seconds"] if peer else None))

    def caches(self) -> dict[int, dict[str, Any]]:
        """Each group's prompt cache (``cache_view``)."""
        per = self.engine.kv_bytes_per_token()
        return {p.group: cache_view(p, per) for p in self.engine.profiles()}

    async def page(self) -> dict[str, Any]:
        """The live figures the page at / shows (computed when asked: nothing is kept for a
        page that is not open): each stage's busy share since the last ask, each group's slots
        and prompt cache,
        tokens per second and TTFT over the last minute, the topology and why."""
        busy, peer, self._last_page = await self._stage_busy(self._last_page)
        now = time.monotonic()
        self._rate_samples.append((now, self.metrics.generated_total()))
        while len(self._rate_samples) > 2 and now - self._rate_samples[1][0] >= 60.0:
            self._rate_samples.popleft()
        t0, n0 = self._rate_samples[0]
        rate = (self._rate_samples[-1][1] - n0) / (now - t0) if now - t0 > 0.5 else 0.0
        ttfts = sorted(v for t, v in self.metrics.recent_ttft if now - t <= 60.0)
        groups: dict[int, list[dict[str, Any]]] = {}
        for v in self.engine.slot_views():
            groups.setdefault(v.group, []).append({"id": v.id, "state": v.state, "task": v.request_id,
                                                   "cached_tokens": v.n_cached})
        caches = self.caches()
        running, waiting = self.engine.scheduler.counts()
        # gpu_busy: each GPU of the stage's node, None on a CPU node
        stages = [{"stage": "peer", "where": ep, "busy": busy.get("peer"), "up": bool(peer and peer["accepting"]),
                   "gpu_busy": (peer or {}).get("gpu_busy")} for ep in self.config.rpc_endpoints]
        local = [d for d in self.engine.devices or [] if not d.upper().startswith("RPC")]  # None: the default device
        stages.append({"stage": "local", "where": ", ".join(local) or "local", "busy": busy.get("local"), "up": True,
                       "gpu_busy": node_meter().busy()})
        return {
            "replica": self.replica, "model": self.engine.model_name, "topology": self.topology, "stages": stages,
            "groups": [{"group": g, "slots": slots, "prompt_cache": caches.get(g)} for g, slots in sorted(groups.items())],
            "tokens_per_second": rate, "ttft_s": {"n": len(ttfts), "median": ttfts[len(ttfts) // 2] if ttfts else None,
                                                  "p99": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] if ttfts else None},
            "running": running, "waiting": waiting, "n_ctx_slot": self.engine.n_ctx_slot,
        }
