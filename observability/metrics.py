"""Prometheus metrics of one engine replica.

Each replica keeps its own registry; the ingress concatenates the replicas' expositions on
``GET /metrics``. Every series carries ``model`` and ``replica``; per-group series carry
``group``. Request figures are counted once, from the final output of each request, on the
engine actor's event loop; per-group figures come from the profiler snapshots that each
group publishes, so a group only ever counts its own slots.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from observability.profiler import PHASES

prometheus_client.disable_created_metrics()

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
FINISH_REASONS = ("stop", "length", "cancelled", "error")
CACHE_LOST_CAUSES = ("stage_restart", "stage_frozen", "engine_failed")  # prompt_cache_lost_entries' causes
P = "pgroups_"


class EngineMetrics:
    def __init__(self, model: str, replica: str = "0") -> None:
        self.model = model
        self.replica = replica
        self.n_tokens_max = 0  # the most tokens one request's slot held (llama-server's n_tokens_max)
        self.recent_ttft: deque[tuple[float, float]] = deque(maxlen=4096)  # (finished at, TTFT s): the page's minute
        r = self.registry = CollectorRegistry(auto_describe=True)
        base = ["model", "replica"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time from arrival to the first generated token.", base, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Mean time between generated tokens of a request.", base, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Time from arrival to the last output of a request.", base, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Time a request waited for a slot.", base, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests.", base, registry=r)
        self.prompt_tokens_cached = Counter(P + "prompt_tokens_cached", "Prompt tokens reused from a slot's cache.", base, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens.", base, registry=r)
        self.prompt_seconds = Counter(P + "prompt_seconds", "Seconds from slot start to first token, summed over requests.", base, registry=r)
        self.generation_seconds = Counter(P + "generation_seconds", "Seconds from first token to last, summed over requests.", base, registry=r)
        self.requests = Counter(P + "requests", "Finished requests by finish reason.", [*base, "finished_reason"], registry=r)
        self.rejected_total = Counter(P + "requests_rejected", "Requests refused because the wait queue was full (HTTP 429).", base, registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests holding a slot.", base, registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting for a slot.", base, registry=r)
        self.stage_busy = Gauge(P + "stage_busy_ratio", "Fraction of the stage's compute capacity in use since the last scrape (CPU time over wall time and threads).", [*base, "stage"], registry=r)
        self.gpu_busy = Gauge(P + "stage_gpu_busy_ratio", "Share of NVML's last sample period in which a kernel ran "
                              "on each NVIDIA GPU of the stage's node (absent on a node without one).",
                              [*base, "stage", "gpu"], registry=r)
        self.topology = Gauge(P + "topology", "1 on the topology the application runs in: replicas, layer_split or single.",
                              [*base, "topology"], registry=r)
        self.cache_lost = Counter(P + "prompt_cache_lost_entries", "Prompt cache entries this replica held when it "
                                  "failed, dropped with its KV (never restored), by cause: stage_restart (the stage's "
                                  "server is another process), stage_frozen (the watchdog), engine_failed (a group's "
                                  "compute failed).", [*base, "cause"], registry=r)
        self.stage_up = Gauge(P + "rpc_stage_up", "1 while the engine is connected to its RPC stage (or has none).", base, registry=r)
        self.stage_rss = Gauge(P + "stage_resident_memory_bytes", "Resident memory of a stage's process (engine or RPC server).", [*base, "stage"], registry=r)
        self.load_seconds = Gauge(P + "model_load_seconds", "Seconds the engine took to load the model (both halves, the peer's over the link).", base, registry=r)
        self.released_bytes = Gauge(P + "model_pages_released_bytes", "Bytes of the GGUF's pages dropped from the local node after the load: the layers held by the peer or a GPU.", base, registry=r)
        self._groups = _GroupCollector(model, replica)
        r.register(self._groups)
        self._media = _MediaCollector(model, replica)
        r.register(self._media)
        r.register(_LlamaServerNames(self))
        self._t0 = time.monotonic()
        b = self._b = {"model": model, "replica": replica}
        for reason in FINISH_REASONS:
            self.requests.labels(**b, finished_reason=reason)
        for cause in CACHE_LOST_CAUSES:  # exported from the start, at 0
            self.cache_lost.labels(**b, cause=cause)
        self._generated = self.generation_tokens.labels(**b)
        for c in (self.prompt_tokens, self.generation_tokens, self.prompt_seconds,
                  self.generation_seconds, self.rejected_total, self.prompt_tokens_cached):
            c.labels(**b)

    def observe(self, o: Any) -> None:
        """Count one output; the request figures only on its final output."""
        b = self._b
        if o.n_tokens:
            self._generated.inc(o.n_tokens)  # per token: the labelled child is bound once
        if o.finish_reason is None:
            return
        self.requests.labels(**b, finished_reason=o.finish_reason).inc()
        self.n_tokens_max = max(self.n_tokens_max, o.prompt_tokens + o.completion_tokens)
        self.prompt_tokens.labels(**b).inc(o.prompt_tokens)
        self.prompt_tokens_cached.labels(**b).inc(o.cached_tokens)
        self.queue_time.labels(**b).observe(o.t_queue)
        e2e = o.t_end
        self.e2e.labels(**b).observe(e2e)
        if o.t_first_token > 0:
            self.ttft.labels(**b).observe(o.t_first_token)
            self.recent_ttft.append((time.monotonic(), o.t_first_token))
            self.prompt_seconds.labels(**b).inc(max(0.0, o.t_first_token - o.t_queue))
            gen = max(0.0, e2e - o.t_first_token)
            self.generation_seconds.labels(**b).inc(gen)
            if o.completion_tokens > 1:
                self.tpot.labels(**b).observe(gen / (o.completion_tokens - 1))

    def generated_total(self) -> float:
        return self._generated._value.get()

    def rejected(self) -> None:
        self.rejected_total.labels(**self._b).inc()

    def set_stage_busy(self, stage: str, ratio: float) -> None:
        self.stage_busy.labels(**self._b, stage=stage).set(max(0.0, min(1.0, ratio)))

    def set_gpu_busy(self, stage: str, busy: dict[str, float] | None) -> None:
        for gpu, ratio in (busy or {}).items():
            self.gpu_busy.labels(**self._b, stage=stage, gpu=gpu).set(ratio)

    def set_stage_rss(self, stage: str, rss: int) -> None:
        self.stage_rss.labels(**self._b, stage=stage).set(rss)

    def set_load(self, seconds: float, released: int) -> None:
        self.load_seconds.labels(**self._b).set(seconds)
        self.released_bytes.labels(**self._b).set(released)

    def set_topology(self, topology: str) -> None:
        """The application's shape (deployments/topology.py): 1 on its label."""
        self.topology.labels(**self._b, topology=topology).set(1)

    def set_media(self, stats: dict | None) -> None:
        """The projector's counters (None: no projector, no media series)."""
        self._media.stats = stats

    def count_cache_lost(self, cause: str, n: int) -> None:
        self.cache_lost.labels(**self._b, cause=cause).inc(n)

    def set_stage_up(self, up: bool) -> None:
        self.stage_up.labels(**self._b).set(1 if up else 0)

    def collect_engine(self, engine: Any, running: int, waiting: int) -> None:
        """Refresh the gauges from the engine's snapshots (at scrape time)."""
        b = self._b
        self.running.labels(**b).set(running)
        self.waiting.labels(**b).set(waiting)
        projector = getattr(engine, "projector", None)
        self.set_media(dict(projector.stats) if projector is not None else None)
        sched = engine.scheduler
        self._groups.update(engine.profiles(), engine.slot_views(), time.monotonic() - self._t0,
                            (sched.n_elsewhere, sched.n_elsewhere_tokens), engine.kv_bytes_per_token())

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LlamaServerNames:
    """llama-server's ``llamacpp:*`` series, for dashboards made for it: the same counts as the
    series above (read from them at scrape time, never counted twice), under its names."""

    def __init__(self, m: EngineMetrics) -> None:
        self.m = m

    def describe(self):
        return []

    def collect(self):
        m, b = self.m, self.m._b
        lab = ["model", "replica"]
        v = [b["model"], b["replica"]]

        def value(metric: Any) -> float:
            return metric.labels(**b)._value.get()

        prompt_n = value(m.prompt_tokens) - value(m.prompt_tokens_cached)  # evaluated, as llama-server counts
        prompt_s, gen_n, gen_s = value(m.prompt_seconds), value(m.generation_tokens), value(m.generation_seconds)
        snaps = m._groups.snaps
        steps = sum(s.steps for s in snaps)
        rows = [
            (CounterMetricFamily, "prompt_tokens", "Number of prompt tokens processed.", prompt_n),
            (CounterMetricFamily, "prompt_seconds", "Prompt process time.", prompt_s),
            (CounterMetricFamily, "tokens_predicted", "Number of generation tokens processed.", gen_n),
            (CounterMetricFamily, "tokens_predicted_seconds", "Predict process time.", gen_s),
            (CounterMetricFamily, "n_decode", "Number of llama_decode() calls.", steps),
            (GaugeMetricFamily, "n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call.",
             sum(s.busy_slots_sum for s in snaps) / max(steps, 1)),
            (GaugeMetricFamily, "prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
             prompt_n / prompt_s if prompt_s else 0.0),
            (GaugeMetricFamily, "predicted_tokens_seconds", "Average generation throughput in tokens/s.",
             gen_n / gen_s if gen_s else 0.0),
            (GaugeMetricFamily, "requests_processing", "Number of requests processing.", value(m.running)),
            (GaugeMetricFamily, "requests_deferred", "Number of requests deferred.", value(m.waiting)),
            (CounterMetricFamily, "spec_decode_num_draft_tokens", "Speculative: Total draft tokens generated",
             sum(s.drafted for s in snaps)),
            (CounterMetricFamily, "spec_decode_num_accepted_tokens",
             "Speculative: Total draft tokens accepted by the target model", sum(s.accepted for s in snaps)),
            (CounterMetricFamily, "spec_decode_num_drafts", "Speculative: Total speculative decoding verification steps",
             sum(s.drafts for s in snaps)),
            # llama-server's name exactly (a counter family would add _total)
            (GaugeMetricFamily, "n_tokens_max", "Largest observed n_tokens.", m.n_tokens_max),
        ]
        for kind, name, doc, x in rows:
            f = kind("llamacpp:" + name, doc, labels=lab)
            f.add_metric(v, x)
            yield f


# (kind, name, the ProfileSnapshot field, help) of each group's prompt cache series
PROMPT_CACHE_SERIES = (
    (GaugeMetricFamily, "prompt_cache_capacity_entries", "cache_capacity",
     "Entries of the group's prompt cache (KV sequences of a slot's size kept beyond the slots)."),
    (GaugeMetricFamily, "prompt_cache_entries", "cache_entries", "Entries of the group's prompt cache holding a prompt."),
    (GaugeMetricFamily, "prompt_cache_tokens", "cache_tokens", "Tokens the group's prompt cache entries hold."),
    (CounterMetricFamily, "prompt_cache_saves", "cache_saves",
     "Slots' KV saved into the group's prompt cache (before another request took the slot, and checkpoints)."),
    (CounterMetricFamily, "prompt_cache_hits", "cache_hits", "Prompts that took a prefix from the group's prompt cache."),
    (CounterMetricFamily, "prompt_cache_reused_tokens", "cache_reused",
     "Prompt tokens taken from the group's prompt cache instead of being evaluated."),
    (CounterMetricFamily, "prompt_cache_evictions", "cache_evictions",
     "Prompt cache entries overwritten (least recently used) while holding a conversation of their own."),
    (CounterMetricFamily, "prompt_cache_superseded", "cache_superseded",
     "Prompt cache entries overwritten by a later state of their own conversation (or one a slot holds)."),
    (CounterMetricFamily, "prompt_cache_misses", "cache_misses",
     "Prompts (cache_prompt on) that found nothing to reuse in the group's slots or prompt cache."),
    (CounterMetricFamily, "prompt_cache_moved_in_requests", "moved_in",
     "Requests that took their history's KV from another group's context instead of evaluating it."),
    (CounterMetricFamily, "prompt_cache_moved_in_tokens", "moved_tokens", "Prompt tokens those requests took."),
    (CounterMetricFamily, "prompt_cache_moved_in_bytes", "moved_bytes",
     "Bytes of the states those requests took: read from every stage there, written to every stage here "
     "(a remote stage's part crosses its link both ways)."),
    (CounterMetricFamily, "prompt_cache_moved_out_requests", "moved_out",
     "Histories' states the group read for a request another group served."),
)


MEDIA_SERIES = (  # the projector's counters (engine/native/projector.py Projector.stats): name, key, help
    ("media_encoded", "encoded", "Images (and audio clips) the projector encoded."),
    ("media_encode_seconds", "encode_seconds", "Seconds the projector spent decoding and encoding media."),
    ("media_rows", "rows", "Embedding rows (prompt positions) the projector made."),
    ("media_cache_hits", "cache_hits", "Media whose embeddings were kept from an earlier request (not encoded again)."),
)


class _MediaCollector:
    """The projector's counters, where the model is served with one (absent otherwise)."""

    def __init__(self, model: str, replica: str) -> None:
        self.model, self.replica = model, replica
        self.stats: dict | None = None

    def describe(self):
        return []

    def collect(self):
        if self.stats is None:
            return
        for name, key, doc in MEDIA_SERIES:
            fam = CounterMetricFamily(P + name, doc, labels=["model", "replica"])
            fam.add_metric([self.model, self.replica], float(self.stats.get(key, 0)))
            yield fam


class _GroupCollector:
    """Per-group series from the groups' published profiler snapshots."""

    def __init__(self, model: str, replica: str) -> None:
        self.model, self.replica = model, replica
        self.snaps: list = []
        self.busy: dict[int, tuple[int, int]] = {}
        self.wall = 0.0
        self.elsewhere = (0, 0)  # requests (and their prompt tokens) another group held more of
        self.kv_per_token: dict[str, int] = {}  # device -> KV bytes a token takes on it

    def update(self, snaps: list, views: list, wall: float, elsewhere: tuple[int, int] = (0, 0),
               kv_per_token: dict[str, int] | None = None) -> None:
        busy: dict[int, tuple[int, int]] = {}
        for v in views:
            n_busy, n = busy.get(v.group, (0, 0))
            busy[v.group] = (n_busy + (v.state != "idle"), n + 1)
        self.snaps, self.busy, self.wall = list(snaps), busy, max(wall, 1e-9)
        self.elsewhere, self.kv_per_token = elsewhere, kv_per_token or {}

    def describe(self):
        return []

    def collect(self):
        lab = ["model", "replica", "group"]

        def fam(kind, name, doc, extra=()):
            return kind(P + name, doc, labels=[*lab, *extra])

        slots_busy = fam(GaugeMetricFamily, "group_slots_busy", "Slots of the group holding a request.")
        slots = fam(GaugeMetricFamily, "group_slots", "Slots of the group.")
        kv = fam(GaugeMetricFamily, "group_kv_used_ratio", "KV cells in use over the cells of the group's context.")
        steps = fam(CounterMetricFamily, "group_decode_steps", "Decode calls of the group.")
        rows = fam(CounterMetricFamily, "group_sampled_rows", "Rows sampled by the group (generated tokens).")
        toks = fam(CounterMetricFamily, "group_batch_tokens", "Tokens decoded by the group (prompt and generated).")
        ubs = fam(CounterMetricFamily, "group_ubatches", "Micro-batches llama.cpp cut the group's steps into; each reads every weight.")
        dcpu = fam(CounterMetricFamily, "group_decode_cpu_seconds", "CPU seconds of the group's thread inside llama_decode (the local stage's compute on a CPU device).")
        bps = fam(GaugeMetricFamily, "group_busy_slots_per_decode", "Mean busy slots per decode step since start.")
        phase = fam(CounterMetricFamily, "group_phase_seconds", "Seconds the group's thread spent in each host-path phase.", ["phase"])
        dev = fam(GaugeMetricFamily, "group_device_busy_ratio", "Fraction of wall time since start the group spent in decode and synchronise.")
        drafted = fam(CounterMetricFamily, "group_spec_drafted_tokens", "Speculative decoding: draft tokens the group verified.")
        accepted = fam(CounterMetricFamily, "group_spec_accepted_tokens", "Speculative decoding: draft tokens the group accepted.")
        copied = fam(CounterMetricFamily, "group_prefix_copied_tokens", "Prompt tokens the group copied from another slot's KV instead of evaluating them (shared prefixes).")
        rate = fam(GaugeMetricFamily, "group_spec_acceptance_ratio", "Speculative decoding: accepted over drafted tokens since start (0 before any draft).")
        c_bytes = fam(GaugeMetricFamily, "prompt_cache_bytes", "KV bytes of the tokens the group's prompt cache holds, on each device (stage) that keeps its layers' part.", ["device"])
        # the prompt cache's series: the snapshot's field each one reads
        cache = [(fam(kind, name, doc), field) for kind, name, field, doc in PROMPT_CACHE_SERIES]
        for s in self.snaps:
            v = [self.model, self.replica, str(s.group)]
            n_busy, n = self.busy.get(s.group, (0, 0))
            slots_busy.add_metric(v, n_busy)
            slots.add_metric(v, n)
            kv.add_metric(v, s.kv_used / max(s.kv_total, 1))
            steps.add_metric(v, s.steps)
            rows.add_metric(v, s.rows)
            toks.add_metric(v, s.batch_tokens)
            ubs.add_metric(v, s.ubatches)
            dcpu.add_metric(v, s.decode_cpu)
            bps.add_metric(v, s.busy_slots_sum / max(s.steps, 1))
            for ph in PHASES:
                phase.add_metric([*v, ph], getattr(s, ph))
            dev.add_metric(v, min(1.0, (s.decode + s.sync) / self.wall))
            drafted.add_metric(v, s.drafted)
            accepted.add_metric(v, s.accepted)
            copied.add_metric(v, s.prefix_copied)
            rate.add_metric(v, s.accepted / s.drafted if s.drafted else 0.0)
            for series, field in cache:
                series.add_metric(v, getattr(s, field))
            for device, per in self.kv_per_token.items():
                c_bytes.add_metric([*v, device], s.cache_tokens * per)
        base = [self.model, self.replica]
        away = CounterMetricFamily(P + "prompt_cache_elsewhere_requests", "Requests sent to a group while another "
                                   "group held clearly more of their prompt (in a slot or its prompt cache): that part "
                                   "was evaluated again unless its KV was moved (prompt_cache_moved_in_*).", labels=["model", "replica"])
        away.add_metric(base, self.elsewhere[0])
        away_t = CounterMetricFamily(P + "prompt_cache_elsewhere_tokens", "Prompt tokens another group held of "
                                     "requests sent elsewhere (evaluated again unless moved).", labels=["model", "replica"])
        away_t.add_metric(base, self.elsewhere[1])
        yield from (slots_busy, slots, kv, steps, rows, toks, ubs, dcpu, bps, phase, dev, drafted, accepted, rate, copied,
                    c_bytes, *(series for series, _ in cache), away, away_t)


def merge_exposition(texts: list[bytes]) -> bytes:
    """Several replicas' Prometheus text as one exposition: each metric family once (its
    HELP and TYPE lines from the first text that has it), with every replica's samples."""
    families: dict[str, tuple[list[bytes], list[bytes]]] = {}
    for text in texts:
        current = None
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith((b"# HELP ", b"# TYPE ")):
                name = line.split(b" ", 3)[2].decode()
                meta, _ = families.setdefault(name, ([], []))
                current = name
                if not any(m.split(b" ", 3)[:3] == line.split(b" ", 3)[:3] for m in meta):
                    meta.append(line)
            elif line.startswith(b"#"):
                continue
            else:
                if current is None:  # a sample before any family line: its own family
                    current = line.split(b"{", 1)[0].split(b" ", 1)[0].decode()
                families.setdefault(current, ([], []))[1].append(line)
    out = []
    for meta, samples in families.values():
        out.extend(meta)
        out.extend(samples)
    return b"\n".join(out) + b"\n"
