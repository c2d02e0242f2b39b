"""Prometheus metrics (prometheus_client), one registry per application."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, state: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("octo_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("octo_request_duration_seconds", "HTTP request latency by endpoint and status",
                                 ["endpoint", "status"], buckets=_BUCKETS, registry=self.registry)
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}
        self.registry.register(_StateCollector(state))

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        key = (endpoint, status)
        pair = self._children.get(key)
        if pair is None:
            labels = (endpoint, str(status))
            pair = self._children[key] = (self.requests.labels(*labels), self.latency.labels(*labels))
        pair[0].inc()
        pair[1].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Scheduler and cache numbers, read at scrape time (no per-token bookkeeping on the hot path)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def describe(self):
        return []

    def collect(self):
        handle = self.state.handle
        sched = handle.scheduler
        if sched is None:
            return
        q = sched.stats()
        yield CounterMetricFamily("octo_generated_tokens", "Tokens generated", value=sched.generated_tokens)
        yield GaugeMetricFamily("octo_queue_depth", "Requests waiting for admission", value=q["pending"])
        yield GaugeMetricFamily("octo_active_sequences", "Sequences in the running batch", value=q["active"])
        yield CounterMetricFamily("octo_queue_rejected", "Requests refused with 503", value=q["total_rejected"])
        yield CounterMetricFamily("octo_queue_timeouts", "Requests that timed out in the queue (504)",
                                  value=q["total_timeouts"])
        yield CounterMetricFamily("octo_processed", "Requests processed by the engine",
                                  value=q["total_processed"])
        if handle.cache is not None:
            c = handle.cache.stats()
            yield CounterMetricFamily("octo_cache_hits", "Prefix-cache hits", value=c["hits"])
            yield CounterMetricFamily("octo_cache_misses", "Prefix-cache misses", value=c["misses"])
            yield CounterMetricFamily("octo_cache_tokens_reused", "Prompt tokens restored from the prefix cache",
                                      value=c["tokens_reused"])
            yield GaugeMetricFamily("octo_cache_bytes", "Bytes held by the prefix cache", value=c["bytes"])
            yield GaugeMetricFamily("octo_cache_entries", "Entries in the prefix cache", value=c["entries"])
