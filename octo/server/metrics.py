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
        """The text exposition; ``snapshot`` is each loaded model's ``stats()`` read just before (a worker's numbers
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
        yield from self._http()
        yield from self._models()
        yield from self._queues()

    def _http(self):
        """Requests and their latency, by endpoint and status."""
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

    def _models(self):
        """The models: loaded, ready, loading, and their workers' crashes, hangs, restarts and silence."""
        registry = self.state.registry
        crashes = CounterMetricFamily("octo_worker_crashes", "Engine worker processes that died",
                                      labels=["model", "engine"])
        ready = GaugeMetricFamily("octo_model_ready", "1 when the model can serve now", labels=["model", "state"])
        hangs = CounterMetricFamily("octo_worker_hangs", "Engine workers killed because they stopped answering "
                                    "(no heartbeat within --worker-timeout)", labels=["model", "engine"])
        restarts = CounterMetricFamily("octo_worker_restarts", "Engine workers restarted after a crash or a hang",
                                       labels=["model", "engine"])
        silence = GaugeMetricFamily("octo_worker_heartbeat_age_seconds", "Seconds since the gateway last heard "
                                    "from the model's worker", labels=["model"])
        for slot in registry.loaded():
            h, labels = slot.handle, [slot.name, slot.handle.engine_name]
            crashes.add_metric(labels, getattr(h, "crashes", 0))
            ready.add_metric([slot.name, slot.state], 1 if slot.state == "ready" else 0)
            if hasattr(h, "hangs"):  # a model in a worker process
                hangs.add_metric(labels, h.hangs)
                restarts.add_metric(labels, h.restarts)
                silence.add_metric([slot.name], h.worker_info()["heartbeat_age_s"])
        yield from (crashes, ready, hangs, restarts, silence)
        yield GaugeMetricFamily("octo_models_loading", "Models loading now (on demand, or a worker restarting)",
                                value=sum(1 for s in registry.slots if s.state == "loading"))
        yield GaugeMetricFamily("octo_models_loaded", "Models loaded now", value=len(registry.loaded()))
        yield CounterMetricFamily("octo_model_loads", "Model loads (start-up and on demand)", value=registry.loads)
        yield CounterMetricFamily("octo_model_unloads", "Model unloads (keep_alive, LRU, admin)",
                                  value=registry.unloads)

    def _queues(self):
        """Each model's queue and prefix cache, from the latest stats snapshot."""
        snap = getattr(self.metrics, "snapshot", None) or {}
        families = {
            "generated_tokens": CounterMetricFamily("octo_generated_tokens", "Tokens generated", labels=["model"]),
            "pending": GaugeMetricFamily("octo_queue_depth", "Requests waiting for admission", labels=["model"]),
            "active": GaugeMetricFamily("octo_active_sequences", "Sequences in the running batch", labels=["model"]),
            "total_rejected": CounterMetricFamily("octo_queue_rejected", "Requests refused with 503",
                                                  labels=["model"]),
            "total_timeouts": CounterMetricFamily("octo_queue_timeouts", "Requests that timed out in the queue (504)",
                                                  labels=["model"]),
            "total_processed": CounterMetricFamily("octo_processed", "Requests processed by the engine",
                                                   labels=["model"]),
        }
        cache = {
            "hits": CounterMetricFamily("octo_cache_hits", "Prefix-cache hits", labels=["model"]),
            "misses": CounterMetricFamily("octo_cache_misses", "Prefix-cache misses", labels=["model"]),
            "tokens_reused": CounterMetricFamily("octo_cache_tokens_reused",
                                                 "Prompt tokens restored from the prefix cache", labels=["model"]),
            "bytes": GaugeMetricFamily("octo_cache_bytes", "Bytes held by the prefix cache", labels=["model"]),
            "entries": GaugeMetricFamily("octo_cache_entries", "Entries in the prefix cache", labels=["model"]),
        }
        stale = GaugeMetricFamily("octo_worker_stats_stale", "1 when the model's queue and cache figures are the "
                                  "last ones its worker sent (it did not answer in time)", labels=["model"])
        for name, stats in snap.items():
            stale.add_metric([name], 1 if (stats.get("queue") or {}).get("stale") else 0)
            for key, fam in families.items():
                if stats.get("queue"):
                    fam.add_metric([name], stats["queue"].get(key) or 0)
            for key, fam in cache.items():
                if stats.get("cache"):
                    fam.add_metric([name], stats["cache"].get(key) or 0)
        yield from families.values()
        yield from cache.values()
        yield stale
