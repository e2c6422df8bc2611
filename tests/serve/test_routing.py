"""The load the router trades reuse against."""

from __future__ import annotations

from kvevents.serve.routing import LoadTracker


def test_load_counts_in_flight_prefill_and_other_requests() -> None:
    t = LoadTracker(load_tokens=100.0)
    assert t.load("a:0") == 0.0
    t.started("a:0", uncached=300)
    assert t.load("a:0") == 100.0 + 300  # one request queued, its prefill still ahead
    t.answered("a:0", uncached=300)
    assert t.load("a:0") == 100.0
    # a scrape taken while our request runs: the engine's running request is ours
    t.set_gauges("a:0", running=1, waiting=0, kv_usage=0.0)
    assert t.load("a:0") == 100.0
    t.finished("a:0")
    assert t.load("a:0") == 0.0  # the stale scrape does not keep it alive
    # requests the engine has from elsewhere count, and so does KV pressure
    t.set_gauges("a:0", running=2, waiting=1, kv_usage=0.5)
    assert t.load("a:0") == 100.0 * (3 + 0.5)
    t.started("a:0", uncached=0)
    assert t.load("a:0") == 100.0 * (4 + 0.5)
