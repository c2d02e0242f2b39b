"""Prometheus metrics (prometheus_client text format), one registry per application.

Request counts and the latency histogram are plain counters updated on the event loop (no locks on the hot
path) and turned into metric families at scrape time, like the scheduler and cache numbers.
"""

from __future__ import annotations

import bisect
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, state: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # (endpoint, status) -> [count, sum of seconds, per-bucket counts (last one: +Inf)]
        self.requests: dict[tuple[str, int], list] = {}
        self.registry.register(_Collector(state, self))

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        entry = self.requests.get((endpoint, status))
        if entry is None:
            entry = self.requests[(endpoint, status)] = [0, 0.0, [0] * (len(BUCKETS) + 1)]
        entry[0] += 1
        entry[1] += seconds
        entry[2][bisect.bisect_left(BUCKETS, seconds)] += 1

    def render(self, snapshot: dict[str, Any] | None = None) -> bytes:
        """The text exposition; ``snapshot`` is the model's ``stats()`` read just before (a worker's numbers
        come over IPC, so they are fetched by the handler, not inside the collector)."""
        self.snapshot = snapshot or {}
        return generate_latest(self.registry)


class _Collector:
    """Everything is read at scrape time: request stats, scheduler and cache numbers."""

    def __init__(self, state: Any, metrics: Metrics) -> None:
        self.state = state
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        requests = CounterMetricFamily("octo_requests", "HTTP requests by endpoint and status",
                                       labels=["endpoint", "status"])
        latency = HistogramMetricFamily("octo_request_duration_seconds",
                                        "HTTP request latency by endpoint and status", labels=["endpoint", "status"])
        for (endpoint, status), (count, total, buckets) in list(self.metrics.requests.items()):
            labels = [endpoint, str(status)]
            requests.add_metric(labels, count)
            cumulative, acc = [], 0
            for bound, n in zip([*map(str, BUCKETS), "+Inf"], buckets, strict=True):
                acc += n
                cumulative.append((bound, acc))
            latency.add_metric(labels, cumulative, total)
        yield requests
        yield latency
        handle = self.state.handle
        crashes = CounterMetricFamily("octo_worker_crashes", "Engine worker processes that died",
                                      labels=["model", "engine"])
        crashes.add_metric([handle.name, handle.engine_name], getattr(handle, "crashes", 0))
        yield crashes
        up = GaugeMetricFamily("octo_model_ready", "1 when the model can serve now", labels=["model", "state"])
        up.add_metric([handle.name, handle.state], 1 if handle.state == "ready" else 0)
        yield up
        snap = getattr(self.metrics, "snapshot", None) or {}
        q = snap.get("queue")
        if q is None:
            return
        yield CounterMetricFamily("octo_generated_tokens", "Tokens generated", value=q["generated_tokens"])
        yield GaugeMetricFamily("octo_queue_depth", "Requests waiting for admission", value=q["pending"])
        yield GaugeMetricFamily("octo_active_sequences", "Sequences in the running batch", value=q["active"])
        yield CounterMetricFamily("octo_queue_rejected", "Requests refused with 503", value=q["total_rejected"])
        yield CounterMetricFamily("octo_queue_timeouts", "Requests that timed out in the queue (504)",
                                  value=q["total_timeouts"])
        yield CounterMetricFamily("octo_processed", "Requests processed by the engine", value=q["total_processed"])
        c = snap.get("cache")
        if c is not None:
            yield CounterMetricFamily("octo_cache_hits", "Prefix-cache hits", value=c["hits"])
            yield CounterMetricFamily("octo_cache_misses", "Prefix-cache misses", value=c["misses"])
            yield CounterMetricFamily("octo_cache_tokens_reused", "Prompt tokens restored from the prefix cache",
                                      value=c["tokens_reused"])
            yield GaugeMetricFamily("octo_cache_bytes", "Bytes held by the prefix cache", value=c["bytes"])
            yield GaugeMetricFamily("octo_cache_entries", "Entries in the prefix cache", value=c["entries"])
