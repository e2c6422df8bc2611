"""Prometheus exposure of component stats, scraped over real HTTP."""

from __future__ import annotations

import socket
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from kvevents import BatchDecoder
from kvevents.metrics import StatsCollector, start_metrics_server, stats_snapshot

pytest.importorskip("prometheus_client")


@dataclass
class _Stats:
    GAUGES: ClassVar[frozenset[str]] = frozenset({"pending"})
    applied: int = 0
    pending: int = 0
    skipped: Counter[str] = field(default_factory=Counter)


class _Component:
    def __init__(self) -> None:
        self.stats = _Stats()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_scrape_shows_counters_gauges_and_reasons() -> None:
    comp = _Component()
    dec = BatchDecoder()
    collector = StatsCollector()
    collector.register("index", comp, worker="w0")
    collector.register("decoder", dec)
    port = _free_port()
    start_metrics_server(port, collector)
    comp.stats.applied = 7
    comp.stats.pending = 3
    comp.stats.skipped["sliding_window"] += 2
    dec.decode(b"\x93\xcb" + b"\x00" * 8 + b"\x91\x81\xa4type\xa3Foo\x00")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'kvevents_index_applied_total{worker="w0"} 7.0' in body
    assert 'kvevents_index_pending{worker="w0"} 3.0' in body
    assert 'kvevents_index_skipped_total{reason="sliding_window",worker="w0"} 2.0' in body
    assert 'kvevents_decoder_skipped_events_total{reason="unknown_tag"} 1.0' in body


def test_snapshot_is_plain_data() -> None:
    comp = _Component()
    comp.stats.skipped["x"] += 1
    assert stats_snapshot(comp.stats) == {"applied": 0, "pending": 0, "skipped": {"x": 1}}


def test_register_rejects_objects_without_stats() -> None:
    with pytest.raises(TypeError):
        StatsCollector().register("x", object())
