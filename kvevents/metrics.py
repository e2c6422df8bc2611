"""Prometheus exposure of every component's ``.stats``.

Each kvevents component (publisher, subscriber, index, decoder, ...) keeps its counters in
a ``.stats`` dataclass whose fields are ints or ``Counter[str]`` (counts by reason).  This
module turns any number of them into Prometheus metrics without the components knowing
about Prometheus:

* an int field ``x`` of a component registered as ``subsystem`` becomes the counter
  ``kvevents_<subsystem>_<x>_total`` (or the gauge ``kvevents_<subsystem>_<x>`` when the
  stats class lists ``x`` in a ``GAUGES`` class attribute);
* a ``Counter[str]`` field becomes the same, with one sample per key under the label
  ``reason``.

``prometheus-client`` is installed with kvevents; without it (a trimmed install) the
collector raises :class:`~kvevents.errors.MissingDependencyError` naming the extra, and
:func:`stats_snapshot` still works.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from kvevents.errors import require_module

__all__ = ["StatsCollector", "start_metrics_server", "stats_snapshot"]

log = logging.getLogger(__name__)


def stats_snapshot(stats: Any) -> dict[str, Any]:
    """A JSON-ready copy of a stats dataclass (``Counter`` fields become dicts)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(stats):
        value = getattr(stats, f.name)
        if isinstance(value, Mapping):
            out[f.name] = dict(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f.name] = value
    return out


class StatsCollector:
    """A ``prometheus_client`` collector over registered components' ``.stats``.

    ``labels`` given at registration (for example ``endpoint=...``) are attached to every
    sample of that component.
    """

    def __init__(self, namespace: str = "kvevents") -> None:
        self.namespace = namespace
        self._components: list[tuple[str, dict[str, str], Any]] = []

    def register(self, subsystem: str, component: Any, **labels: str) -> None:
        """Expose ``component.stats`` (read at every scrape) under ``subsystem``."""
        if not dataclasses.is_dataclass(getattr(component, "stats", None)):
            raise TypeError(f"{component!r} has no dataclass .stats to expose")
        self._components.append((subsystem, dict(labels), component))

    def collect(self) -> Iterator[Any]:
        require_module("prometheus_client", "metrics", "kvevents.metrics.StatsCollector")
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, Any] = {}
        for subsystem, labels, component in self._components:
            stats = component.stats
            gauges: frozenset[str] = getattr(type(stats), "GAUGES", frozenset())
            for f in dataclasses.fields(stats):
                value = getattr(stats, f.name)
                name = f"{self.namespace}_{subsystem}_{f.name}"
                is_counter_map = isinstance(value, Mapping)
                if not is_counter_map and (
                    not isinstance(value, (int, float)) or isinstance(value, bool)
                ):
                    continue
                label_names = sorted(labels) + (["reason"] if is_counter_map else [])
                if name not in families:
                    kind = GaugeMetricFamily if f.name in gauges else CounterMetricFamily
                    families[name] = kind(
                        name, f"{subsystem} {f.name.replace('_', ' ')}", labels=label_names
                    )
                fam = families[name]
                base = [labels[k] for k in sorted(labels)]
                if is_counter_map:
                    for reason, n in value.items():
                        fam.add_metric([*base, str(reason)], n)
                else:
                    fam.add_metric(base, value)
        yield from families.values()


def start_metrics_server(port: int, collector: StatsCollector, addr: str = "127.0.0.1") -> None:
    """Serve ``collector`` on ``http://addr:port/metrics`` from a daemon thread.

    Raises :class:`~kvevents.errors.MissingDependencyError` without ``prometheus-client``.
    """
    require_module("prometheus_client", "metrics", "kvevents.metrics.start_metrics_server")
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(collector)
    start_http_server(port, addr=addr, registry=registry)
    log.info("serving kvevents metrics on http://%s:%d/metrics", addr, port)
