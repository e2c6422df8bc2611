"""The service's Prometheus metrics (``GET /metrics``).

Library counters (subscriber, index, decoder) come through
:class:`~kvevents.metrics.StatsCollector` as ``kvevents_<component>_*``; the service adds
``kvevents_serve_*``: requests by route and status, routing decisions by engine and
rank, request latency and time to first byte, the routing overhead, the online truth
check (prediction error histogram; over, under and exact counters; predicted and reported
cached tokens), upstream errors and retries, and per-engine gauges (up, in flight, load).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from kvevents.metrics import StatsCollector

__all__ = ["ServeMetrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_OVERHEAD = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1)
_ERROR = (-4096, -1024, -256, -64, -16, -1, 0, 1, 16, 64, 256, 1024, 4096)


class ServeMetrics:
    """Every metric of one service instance, in its own registry."""

    def __init__(self, components: list[tuple[str, Any]]) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series: they double every family
        self.registry = CollectorRegistry()
        r = self.registry
        collector = StatsCollector()
        for subsystem, comp in components:
            collector.register(subsystem, comp)
        r.register(collector)
        ns = "kvevents_serve"
        self.requests = Counter(
            f"{ns}_requests", "Requests answered, by route and HTTP status", ["route", "status"],
            registry=r,
        )  # fmt: skip
        self.routed = Counter(
            f"{ns}_routing_decisions", "Requests sent to each engine rank", ["engine", "rank"],
            registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            f"{ns}_request_latency_seconds", "Time from request to last byte", ["route"],
            buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.ttfb = Histogram(
            f"{ns}_time_to_first_byte_seconds", "Time from request to the engine's first byte",
            ["route"], buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.overhead = Histogram(
            f"{ns}_routing_overhead_seconds",
            "Time spent choosing an engine (tokenising and scoring)",
            buckets=_OVERHEAD, registry=r,
        )  # fmt: skip
        self.pred_error = Histogram(
            f"{ns}_prediction_error_tokens",
            "Predicted minus engine-reported cached prompt tokens",
            ["engine"], buckets=_ERROR, registry=r,
        )  # fmt: skip
        self.pred_outcome = Counter(
            f"{ns}_predictions", "Truth checks by outcome (exact, over, under)",
            ["engine", "outcome"], registry=r,
        )  # fmt: skip
        self.predicted_tokens = Counter(
            f"{ns}_predicted_cached_tokens", "Cached prompt tokens predicted by the index",
            ["engine"], registry=r,
        )  # fmt: skip
        self.reported_tokens = Counter(
            f"{ns}_reported_cached_tokens", "Cached prompt tokens reported by engines",
            ["engine"], registry=r,
        )  # fmt: skip
        self.unchecked = Counter(
            f"{ns}_truth_unchecked", "Answered requests without cached_tokens in their usage",
            ["engine"], registry=r,
        )  # fmt: skip
        self.upstream_errors = Counter(
            f"{ns}_upstream_errors", "Failed upstream calls by engine and kind",
            ["engine", "kind"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            f"{ns}_retries", "Requests re-sent to another engine before any byte was answered",
            registry=r,
        )  # fmt: skip
        self.engine_up = Gauge(f"{ns}_engine_up", "1 if the engine is up", ["engine"], registry=r)
        self.inflight = Gauge(
            f"{ns}_in_flight", "Requests in flight per engine rank", ["engine", "rank"],
            registry=r,
        )  # fmt: skip
        self.load = Gauge(
            f"{ns}_engine_load_tokens", "Load per engine rank (tokens)", ["engine", "rank"],
            registry=r,
        )  # fmt: skip

    def render(self) -> bytes:
        return generate_latest(self.registry)
