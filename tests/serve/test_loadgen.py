"""``kvevents loadgen`` against the service in front of simulated engines."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
import httpx

from kvevents.demo.stack import LocalStack
from kvevents.errors import ConfigError
from kvevents.serve import ServeConfig
from kvevents.serve.loadgen import LoadgenConfig, format_loadgen, run_loadgen


def _ready(url: str) -> None:
    deadline = time.monotonic() + 20
    while httpx.get(url + "/readyz").status_code != 200:
        assert time.monotonic() < deadline, "service not ready"
        time.sleep(0.02)


def test_concurrency_and_rate_runs() -> None:
    with LocalStack(2, serve=ServeConfig(scrape_interval_s=0.2)) as s:
        _ready(s.url)
        cfg = LoadgenConfig(s.url, requests=30, sessions=4, tenants=2, concurrency=3, seed=1)
        seen: list[int] = []
        rep = asyncio.run(run_loadgen(cfg, progress=lambda d, t: seen.append(d)))
        assert seen == list(range(1, 31))
        j = rep.to_json()
        assert j["ok"] == 30 and j["failed"] == 0
        # conversations grow: every session's prompts get longer turn after turn
        by_session: dict[int, list[tuple[int, int]]] = {}
        for r in rep.records:
            by_session.setdefault(r.session, []).append((r.turn, r.prompt_tokens))
        for turns in by_session.values():
            lengths = [n for _, n in sorted(turns)]
            assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)
        # the server's cached_tokens are what the reuse is computed from
        assert j["cached_tokens"] == sum(r.cached_tokens or 0 for r in rep.records) > 0
        assert 0 < j["prefix_reuse"] < 1 and j["ttft_p50_s"] > 0
        assert sum(j["workers"].values()) == 30
        assert "prefix reuse" in format_loadgen(rep)
        json.dumps(j)
        rate = asyncio.run(
            run_loadgen(LoadgenConfig(s.url, requests=10, concurrency=None, rate=200.0))
        )
        assert rate.to_json()["ok"] == 10


def test_failures_are_reported_not_lost() -> None:
    # nothing listens there: every request fails and is counted
    cfg = LoadgenConfig("http://127.0.0.1:9", requests=3, concurrency=2, timeout_s=2)
    rep = asyncio.run(run_loadgen(cfg))
    assert rep.to_json()["failed"] == 3 and rep.to_json()["errors"] == {"ConnectError": 3}


@pytest.mark.parametrize(
    "kw",
    [
        {"url": "localhost:80"},
        {"requests": 0},
        {"concurrency": None},
        {"concurrency": 2, "rate": 1.0},
        {"turns": (0, 2)},
    ],
)
def test_bad_config(kw: dict) -> None:
    base = {"url": "http://h:1"}
    base.update(kw)
    with pytest.raises(ConfigError):
        LoadgenConfig(**base).validate()  # type: ignore[arg-type]
