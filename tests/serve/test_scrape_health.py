"""The metrics scrape and engine health, with real processes: ``kvevents sim serve``
engines and ``kvevents serve`` as subprocesses, a TCP proxy in front of one engine's HTTP
front.  One failed scrape leaves an engine routable; an engine killed is marked down by
the scrape alone within ``scrape_failures`` x ``scrape_interval_s`` (and some slack for
a loaded machine)."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from _tcp_proxy import CutProxy

from serve._procs import Proc, serve, sim_engines, spec_parts, wait_until

INTERVAL = 0.3
FAILURES = 3


def _scrape_errors(url: str, engine: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(
        r'kvevents_serve_upstream_errors_total\{engine="' + engine + r'",kind="scrape"\} (\S+)',
        text,
    )
    return float(m.group(1)) if m else 0.0


def _worker(url: str, engine: str) -> dict[str, object]:
    ws = httpx.get(url + "/workers", timeout=10).json()["workers"]
    w: dict[str, object] = next(x for x in ws if x["engine"] == engine)
    return w


def _ready(url: str) -> bool:
    return httpx.get(url + "/readyz", timeout=10).status_code == 200


def _serve_scraped(procs: list[Proc], specs: list[str], engine: str) -> str:
    """The service over ``specs`` with this file's scrape interval and failure count,
    ready, after a first good scrape of ``engine``; its URL."""
    service, url = serve(
        specs, "--scrape-interval", str(INTERVAL), "--scrape-failures", str(FAILURES)
    )
    procs.append(service)
    wait_until(lambda: _ready(url), what="/readyz")
    wait_until(lambda: _worker(url, engine)["scrape_failures"] == 0, what="a first scrape")
    return url


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    out: list[Proc] = []
    yield out
    for p in reversed(out):
        p.stop()


def test_one_failed_scrape_leaves_the_engine_routable(procs: list[Proc]) -> None:
    sim, specs = sim_engines(2)
    procs.append(sim)
    name, http, events, replay = spec_parts(specs[0])
    proxy = CutProxy(http.replace("http://", "tcp://"))
    try:
        front = proxy.endpoint.replace("tcp://", "http://")
        url = _serve_scraped(procs, [f"{name}={front},{events},{replay}", specs[1]], name)
        errors = _scrape_errors(url, name)
        forwarded = proxy.forwarded
        proxy.refuse_once()
        wait_until(lambda: _worker(url, name)["scrape_failures"] == 1, 30.0, "the failed scrape")
        # right after the failure: still up, still ranked, still answering
        w = _worker(url, name)
        assert w["up"] is True and w["down_reason"] is None, w
        assert httpx.get(url + "/readyz", timeout=10).json()["down"] == []
        ranked = httpx.post(url + "/route", json={"prompt": "hello there"}, timeout=30)
        assert name in {x["engine"] for x in ranked.json()["ranked"]}
        assert _scrape_errors(url, name) == errors + 1
        # the next scrape goes through the proxy again and resets the count
        wait_until(lambda: proxy.forwarded > forwarded, 30.0, "a scrape after the refusal")
        wait_until(lambda: _worker(url, name)["scrape_failures"] == 0, 30.0, "the count reset")
        assert proxy.refused == 1
        w = _worker(url, name)
        assert w["up"] is True and w["down_reason"] is None, w
    finally:
        proxy.close()


def test_a_killed_engine_is_marked_down_within_the_bound(procs: list[Proc]) -> None:
    sim, specs = sim_engines(1)
    procs.append(sim)
    victim = Proc("sim", "serve", "--engines", "1")
    procs.append(victim)
    (vline,) = victim.read_lines(1, 30.0)
    vspec = vline.removeprefix("--engine ").replace("sim-0=", "victim=", 1)
    url = _serve_scraped(procs, [specs[0], vspec], "victim")
    victim.stop(signal.SIGKILL)
    t0 = time.monotonic()
    seen: list[int] = []

    def down() -> bool:
        w = _worker(url, "victim")
        seen.append(int(str(w["scrape_failures"])))
        return w["up"] is False

    # no request is sent: the scrape alone finds the engine gone
    wait_until(down, 30.0, "the victim marked down")
    took = time.monotonic() - t0
    w = _worker(url, "victim")
    assert "failed scrapes in a row" in str(w["down_reason"]), w
    assert int(str(w["scrape_failures"])) >= FAILURES
    # up while it had fewer than FAILURES failures in a row, down at the FAILURES-th
    assert all(n < FAILURES for n in seen[:-1]), seen
    # the documented bound, FAILURES x INTERVAL, plus one interval and a margin for
    # the polling and a loaded machine (each scrape of a refused port is immediate)
    assert took < (FAILURES + 1) * INTERVAL + 2.0, took
    assert httpx.get(url + "/readyz", timeout=10).json()["down"] == ["victim"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and not r.headers["x-kvevents-worker"].startswith("victim")
