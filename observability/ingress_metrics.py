"""An ingress replica's own Prometheus series, through prometheus-client: request fields it
ignored (by name, a bounded table), requests the HTTP layer refused before their route (by
status, counted by the guard and the direct server), and answers that were the server's own
fault."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class IngressMetrics(Collector):
    def __init__(self, ignored: Callable[[], dict[str, int]], refused: Callable[[], dict[str, int]],
                 internal_errors: Callable[[], int]) -> None:
        self.ignored, self.refused, self.internal_errors = ignored, refused, internal_errors
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterator[CounterMetricFamily]:
        fields = CounterMetricFamily("pgroups_ignored_request_fields", "Requests that carried a field this server "
                                     "does not know (ignored; strict_request_fields refuses them).", labels=["field"])
        for name, n in sorted(self.ignored().items()):
            fields.add_metric([name], n)
        refused = CounterMetricFamily("pgroups_http_refused", "Requests and connections the HTTP layer refused "
                                      "before their route, by status (403 host or origin, 408 head or body too "
                                      "slow, 413 body too large, 415 not JSON, 429 per-client bound, 431 head "
                                      "too large, 503 in all).", labels=["status"])
        for status, n in sorted(self.refused().items()):
            refused.add_metric([status], n)
        yield fields
        yield refused
        yield CounterMetricFamily("pgroups_http_internal_errors", "Answers that were the server's own fault (500; "
                                  "each logged with its traceback).", value=self.internal_errors())

    def render(self) -> bytes:
        return generate_latest(self.registry)
