"""Prometheus metrics of an ingress replica's resumes (``deployments.resume``): resumes by the
fault that caused them, how long a resumed choice paused, and requests failed because a fault
came past their last resume."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

P = "pgroups_"
PAUSE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 90.0, 120.0, 240.0, 480.0)
CAUSES = ("replica_lost", "stage_frozen", "engine_failed")
REASONS = ("limit", "replicas", "wait", "unresumable")


class ResumeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.resumes = Counter(P + "resumes", "Choices of requests resumed on a replica after a fault, by cause "
                               "(replica_lost: its output stream ended; stage_frozen: the watchdog fired; "
                               "engine_failed: the engine failed it with a 503).", ["cause"], registry=r)
        self.pause = Histogram(P + "resume_pause_seconds", "Seconds a resumed choice waited between its fault and its "
                               "next output.", buckets=PAUSE_BUCKETS, registry=r)
        self.failed_total = Counter(P + "resume_failed", "Requests failed by a fault they were not resumed from, by "
                                    "reason (limit: resume_limit reached; replicas: two replicas failed it; wait: no "
                                    "replica took it within resume_wait_s; unresumable).", ["reason"], registry=r)
        for c in CAUSES:
            self.resumes.labels(cause=c)
        for x in REASONS:
            self.failed_total.labels(reason=x)

    def resumed(self, cause: str) -> None:
        self.resumes.labels(cause=cause).inc()

    def paused(self, seconds: float) -> None:
        self.pause.observe(seconds)

    def failed(self, reason: str) -> None:
        self.failed_total.labels(reason=reason).inc()

    def count(self, metric: Counter, **labels: str) -> float:
        return metric.labels(**labels)._value.get()  # noqa: SLF001 - a test's and the soak's read

    def render(self) -> bytes:
        return generate_latest(self.registry)
