"""Prometheus exposure of every component's ``.stats``, safe to scrape at any time.

Each kvevents component (publisher, subscriber, index, decoder, ...) keeps its counters in
a ``.stats`` dataclass whose fields are ints or ``Counter[str]`` (counts by reason).  This
module turns any number of them into Prometheus metrics without the components knowing
about Prometheus:

* an int field ``x`` of a component registered as ``subsystem`` becomes the counter
  ``kvevents_<subsystem>_<x>_total`` (or the gauge ``kvevents_<subsystem>_<x>`` when the
  stats class lists ``x`` in a ``GAUGES`` class attribute);
* a ``Counter[str]`` field becomes the same, with one sample per key under the label
  ``reason``;
* a component with a ``gauges()`` method (``BlockIndex``: resident entries, pending joins,
  retained metadata; ``Subscriber``: workers, stale workers, replays in flight, replay
  lag) has each of its values exported as the gauge ``kvevents_<subsystem>_<name>``.

Scrapes run on the HTTP server's thread while the owner thread keeps changing the
counters.  Every value is read through a copy taken in one C-level step (``dict(counter)``
does not run Python code between entries, so it cannot interleave with the owner adding a
key under the GIL), retried if the copy ever raises; a component registered with a
``lock`` is read under it instead.  Scrapes never write component state.

``prometheus-client`` is installed with kvevents; without it (a trimmed install) the
collector raises :class:`~kvevents.errors.MissingDependencyError` naming the extra, and
:func:`stats_snapshot` still works.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from kvevents.errors import MetricsError, require_module

__all__ = ["StatsCollector", "start_metrics_server", "stats_snapshot"]

log = logging.getLogger(__name__)

_COPY_TRIES = 100


def _copy(mapping: Mapping[Any, Any]) -> dict[Any, Any]:
    """A consistent copy of a mapping another thread may be changing."""
    for _ in range(_COPY_TRIES):
        try:
            return dict(mapping)
        except RuntimeError:  # changed size during iteration (a non-dict mapping)
            continue
    return dict(mapping)  # pragma: no cover - let the last error through


def stats_snapshot(stats: Any) -> dict[str, Any]:
    """A JSON-ready copy of a stats dataclass (``Counter`` fields become dicts).

    Raises :class:`~kvevents.errors.MetricsError` (a ``TypeError``) if ``stats`` is not a
    dataclass instance.
    """
    if not dataclasses.is_dataclass(stats) or isinstance(stats, type):
        raise MetricsError(f"{stats!r} is not a stats dataclass instance")
    out: dict[str, Any] = {}
    for f in dataclasses.fields(stats):
        value = getattr(stats, f.name)
        if isinstance(value, Mapping):
            out[f.name] = _copy(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f.name] = value
    return out


def _gauges(component: Any) -> dict[str, float]:
    fn = getattr(component, "gauges", None)
    if fn is None or not callable(fn):
        return {}
    return _copy(fn())


class StatsCollector:
    """A ``prometheus_client`` collector over registered components' ``.stats``.

    ``labels`` given at registration (for example ``endpoint=...``) are attached to every
    sample of that component.
    """

    def __init__(self, namespace: str = "kvevents") -> None:
        self.namespace = namespace
        self._components: list[tuple[str, dict[str, str], Any, Any]] = []

    def register(
        self,
        subsystem: str,
        component: Any,
        *,
        lock: AbstractContextManager[Any] | None = None,
        **labels: str,
    ) -> None:
        """Expose ``component.stats`` (and ``component.gauges()`` if it has one), read at
        every scrape, under ``subsystem``.  ``lock``: held while reading, for components
        the owner guards with it.  Raises :class:`~kvevents.errors.MetricsError` (a
        ``TypeError``) if ``component.stats`` is not a dataclass instance."""
        if not dataclasses.is_dataclass(getattr(component, "stats", None)):
            raise MetricsError(f"{component!r} has no dataclass .stats to expose")
        self._components.append((subsystem, dict(labels), component, lock))

    def snapshot(self) -> list[tuple[str, dict[str, str], dict[str, Any], dict[str, float], Any]]:
        """Per component: subsystem, labels, :func:`stats_snapshot` of its stats, its
        gauges, and its stats class (for ``GAUGES``); copies, safe to read at leisure."""
        out = []
        for subsystem, labels, component, lock in list(self._components):
            with lock if lock is not None else nullcontext():
                stats = component.stats
                snap = stats_snapshot(stats)
                gauges = _gauges(component)
            out.append((subsystem, labels, snap, gauges, type(stats)))
        return out

    def collect(self) -> Iterator[Any]:
        require_module("prometheus_client", "metrics", "kvevents.metrics.StatsCollector")
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, Any] = {}
        for subsystem, labels, snap, gauge_values, stats_type in self.snapshot():
            gauges: frozenset[str] = getattr(stats_type, "GAUGES", frozenset())
            base = [labels[k] for k in sorted(labels)]
            for fname, value in snap.items():
                name = f"{self.namespace}_{subsystem}_{fname}"
                is_counter_map = isinstance(value, dict)
                label_names = sorted(labels) + (["reason"] if is_counter_map else [])
                if name not in families:
                    kind = GaugeMetricFamily if fname in gauges else CounterMetricFamily
                    families[name] = kind(
                        name, f"{subsystem} {fname.replace('_', ' ')}", labels=label_names
                    )
                fam = families[name]
                if is_counter_map:
                    for reason, n in value.items():
                        fam.add_metric([*base, str(reason)], n)
                else:
                    fam.add_metric(base, value)
            for gname, gvalue in gauge_values.items():
                name = f"{self.namespace}_{subsystem}_{gname}"
                if name not in families:
                    families[name] = GaugeMetricFamily(
                        name, f"{subsystem} {gname.replace('_', ' ')}", labels=sorted(labels)
                    )
                families[name].add_metric(base, float(gvalue))
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
