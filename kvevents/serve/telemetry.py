"""The service's Prometheus metrics (``GET /metrics``).

Library counters (subscriber, index, decoder) come through
:class:`~kvevents.metrics.StatsCollector` as ``kvevents_<component>_*``; the service adds
``kvevents_serve_*``: requests by route and status, routing decisions by engine and
rank, request latency and time to first byte, the routing overhead, the online truth
check (prediction error histogram; over, under and exact counters; predicted and reported
cached tokens), upstream errors and retries, and per-engine gauges (up, in flight, load).

:class:`StreamCollector` adds, per engine rank, how far its event stream is to be
trusted: ``kvevents_stream_trusted`` and ``kvevents_stream_complete`` (1 or 0), and the
counters ``kvevents_stream_decode_failures_total`` (by reason),
``kvevents_stream_gaps_total``, ``kvevents_stream_batches_missing_total``,
``kvevents_stream_restarts_total``, ``kvevents_stream_stale_periods_total`` and
``kvevents_stream_unexpected_batches_total`` (by what differed from the spec), read from
the fleet at each scrape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvevents.metrics import StatsCollector

if TYPE_CHECKING:
    from kvevents.serve.fleet import Fleet

__all__ = ["ServeMetrics", "StreamCollector"]

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
        self.pending_checks = Counter(
            f"{ns}_pending_predictions",
            "Truth checks of requests credited with pending tokens, by outcome (exact, "
            "over: pending credit not reused, under)",
            ["engine", "outcome"], registry=r,
        )  # fmt: skip
        self.role_predictions = Counter(
            f"{ns}_role_predictions",
            "Truth checks by engine role (prefill steps on prefill engines) and outcome",
            ["role", "outcome"], registry=r,
        )  # fmt: skip
        self.role_predicted_tokens = Counter(
            f"{ns}_role_predicted_cached_tokens", "Cached prompt tokens predicted, by role",
            ["role"], registry=r,
        )  # fmt: skip
        self.role_reported_tokens = Counter(
            f"{ns}_role_reported_cached_tokens", "Cached prompt tokens reported, by role",
            ["role"], registry=r,
        )  # fmt: skip
        self.pd_requests = Counter(
            f"{ns}_pd_requests",
            "Requests by path: disaggregated, or served whole and why (short, no_decode, "
            "no_prefill, unsplit, prefill_failed, no_transfer_params)",
            ["path"], registry=r,
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


class StreamCollector(Collector):
    """Per engine rank, the trust and completeness of its event stream and the
    counters behind them, read from ``fleet`` at each scrape."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Any]:
        labels = ["engine", "rank"]
        trusted = GaugeMetricFamily(
            "kvevents_stream_trusted",
            "1 if the rank's event stream is trusted (not silent), 0 if it is routed by load alone",
            labels=labels,
        )
        complete = GaugeMetricFamily(
            "kvevents_stream_complete",
            "1 if the rank's index is complete (history known from seq 0 or a checked "
            "resume point)",
            labels=labels,
        )
        decode = CounterMetricFamily(
            "kvevents_stream_decode_failures", "Payloads or frames that did not decode",
            labels=[*labels, "reason"],
        )  # fmt: skip
        gaps = CounterMetricFamily(
            "kvevents_stream_gaps", "Gaps seen on the live stream", labels=labels
        )
        missing = CounterMetricFamily(
            "kvevents_stream_batches_missing",
            "Batches never applied (history before the ring, or lost for good)",
            labels=labels,
        )
        restarts = CounterMetricFamily(
            "kvevents_stream_restarts", "Publisher restarts detected", labels=labels
        )
        stale = CounterMetricFamily(
            "kvevents_stream_stale_periods", "Times the stream went silent", labels=labels
        )
        unexpected = CounterMetricFamily(
            "kvevents_stream_unexpected_batches",
            "Batches on the rank's stream naming another worker than its spec gives it "
            "(another topic or data-parallel rank): skipped",
            labels=[*labels, "reason"],
        )
        for st in list(self.fleet.ranks):
            lv = [st.engine.name, str(st.rank)]
            for reason, n in list(st.unexpected.items()):
                unexpected.add_metric([*lv, reason], float(n))
            trusted.add_metric(lv, 1.0 if st.trusted else 0.0)
            complete.add_metric(lv, 1.0 if st.completeness == "complete" else 0.0)
            for reason in ("undecodable", "bad_frame"):
                decode.add_metric([*lv, reason], float(st.decode_failures.get(reason, 0)))
            gaps.add_metric(lv, float(st.gaps))
            missing.add_metric(lv, float(st.batches_missing))
            restarts.add_metric(lv, float(st.restarts))
            stale.add_metric(lv, float(st.stale_periods))
        yield from (trusted, complete, decode, gaps, missing, restarts, stale, unexpected)
