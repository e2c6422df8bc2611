"""What ``GET /workers`` (and the dashboard) shows: per engine rank, its role, its
stream, its index holdings, its load and gauges, and the online truth check (and, in
``roles``, the truth check summed per role: a prefill engine's checks are its prefill
steps'); and the per-rank gauges
of ``GET /metrics`` refreshed on the way.

One job: the status report.  Reads the fleet, the load tracker, the engine clients'
gauges and the forwarder's per-rank stats; writes only the per-rank Prometheus gauges.
"""

from __future__ import annotations

import time
from typing import Any

from kvevents.native import core_name
from kvevents.serve.config import ServeConfig
from kvevents.serve.fleet import Fleet
from kvevents.serve.proxy import Forwarder
from kvevents.serve.routing import LoadTracker
from kvevents.serve.telemetry import ServeMetrics
from kvevents.serve.upstream import EngineClients

__all__ = ["WorkersReport"]


class WorkersReport:
    """Builds the ``GET /workers`` document; ``started`` is the service's start time
    (``time.time()`` seconds)."""

    def __init__(
        self,
        config: ServeConfig,
        fleet: Fleet,
        loads: LoadTracker,
        metrics: ServeMetrics,
        upstream: EngineClients,
        forwarder: Forwarder,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.loads = loads
        self.metrics = metrics
        self.upstream = upstream
        self.forwarder = forwarder
        self.started = time.time()
        self._summary: tuple[float, dict[Any, Any]] = (-1e9, {})
        self._summary_cost_s = 0.0

    def index_summary(self) -> dict[Any, Any]:
        """Per-worker tier holdings, recomputed at most every second, and less often as
        the index grows: the walk holds the index lock (about 0.4 µs per entry), so it
        runs at most 5 % of the time."""
        now = time.monotonic()
        at, cached = self._summary
        if now - at < max(1.0, 20 * self._summary_cost_s):
            return cached
        t0 = time.perf_counter()
        with self.fleet.lock:
            summary = self.fleet.index.summary()
        self._summary_cost_s = time.perf_counter() - t0
        self._summary = (now, summary)
        return summary

    def workers_json(self) -> dict[str, Any]:
        """What ``GET /workers`` answers (and the dashboard shows); refreshes the
        per-rank in-flight, load and engine-up gauges."""
        now_m = time.monotonic()
        now = time.time()
        summary = self.index_summary()
        out = []
        for st in self.fleet.ranks:
            ws = summary.get(st.worker)
            blocks = {
                tier: {"entries": t.entries, "tokens": t.tokens}
                for tier, t in (ws.tiers.items() if ws is not None else [])
            }
            for tier in ("GPU", "CPU", "STORAGE"):
                blocks.setdefault(tier, {"entries": 0, "tokens": 0})
            rs = self.forwarder.rank_stats[st.label]
            up = self.fleet.is_up(st.engine.name, now_m)
            out.append(
                {
                    "worker": st.label,
                    "engine": st.engine.name,
                    "rank": st.rank,
                    "index_worker": list(st.worker),
                    "role": st.engine.role,
                    "url": st.engine.http_base(),
                    "events_endpoint": st.events_endpoint,
                    "replay_endpoint": st.replay_endpoint,
                    "up": up,
                    "down_reason": self.fleet.down_reason.get(st.engine.name),
                    "scrape_failures": self.fleet.scrape_failures.get(st.engine.name, 0),
                    "state": "live" if up and st.connected and not st.stale else "stale",
                    "trusted": st.trusted,
                    "completeness": st.completeness,
                    "complete": st.completeness == "complete",
                    "resume_seq": None if st.resume is None else st.resume[0],
                    "stream": {
                        "decode_failures": dict(st.decode_failures),
                        "gaps": st.gaps,
                        "batches_missing": st.batches_missing,
                        "restarts": st.restarts,
                        "stale_periods": st.stale_periods,
                    },
                    "ready": st.ready,
                    "connected": st.connected,
                    "replay_answered": st.replay_answered,
                    "last_seq": st.last_seq,
                    "batches": st.batches,
                    "events": st.events,
                    "events_per_s": round(st.events_per_s(now_m), 2),
                    "lag_s": None
                    if st.last_event_ts is None
                    else round(max(0.0, now - st.last_event_ts), 3),
                    "anomalies": dict(st.anomalies),
                    "unexpected_batches": dict(st.unexpected),
                    "recent_anomalies": list(st.recent_anomalies),
                    "blocks": blocks,
                    "in_flight": self.loads.inflight.get(st.label, 0),
                    "load": round(self.loads.load(st.label), 1),
                    "engine_gauges": self.upstream.gauges.get(st.label, {}),
                    "routed": rs.routed,
                    "prefills": rs.prefills,
                    "predicted_cached_tokens": rs.predicted,
                    "reported_cached_tokens": rs.reported,
                    "truth": {
                        "exact": rs.exact,
                        "over": rs.over,
                        "under": rs.under,
                        "unchecked": rs.unchecked,
                    },
                    "recent_checks": [list(c) for c in rs.checks][-20:],
                    "upstream_errors": rs.errors,
                }
            )
            self.metrics.inflight.labels(st.engine.name, str(st.rank)).set(
                self.loads.inflight.get(st.label, 0)
            )
            self.metrics.load.labels(st.engine.name, str(st.rank)).set(self.loads.load(st.label))
        for spec in self.config.engines:
            self.metrics.engine_up.labels(spec.name).set(1 if self.fleet.is_up(spec.name) else 0)
        roles: dict[str, dict[str, int]] = {}
        for st in self.fleet.ranks:
            rs = self.forwarder.rank_stats[st.label]
            agg = roles.setdefault(
                st.engine.role,
                dict.fromkeys(
                    ("workers", "routed", "prefills", "predicted_cached_tokens",
                     "reported_cached_tokens", "exact", "over", "under", "unchecked"),
                    0,
                ),
            )  # fmt: skip
            agg["workers"] += 1
            agg["routed"] += rs.routed
            agg["prefills"] += rs.prefills
            agg["predicted_cached_tokens"] += rs.predicted
            agg["reported_cached_tokens"] += rs.reported
            for k in ("exact", "over", "under", "unchecked"):
                agg[k] += getattr(rs, k)
        return {
            "time": now,
            "roles": roles,
            "uptime_s": round(now - self.started, 1),
            "policy": self.config.policy,
            "core": core_name(),
            "ready": not self.fleet.not_ready()
            and (self.config.ready_when_incomplete or not self.fleet.incomplete(now_m)),
            "incomplete": self.fleet.incomplete(now_m),
            "requests": self.forwarder.requests_total,
            "consumer_error": None if self.fleet.error is None else repr(self.fleet.error),
            "unexpected_batches": dict(self.fleet.unexpected),
            "workers": out,
        }
