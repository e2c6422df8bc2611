"""``kvevents serve``'s pending overlay, in process in front of simulated engines over
real HTTP and ZMQ: a burst's siblings land on the rank the first went to, ``/route``
shows ``pending`` beside the tiers, the truth check counts what pending credit got
right, reservations end (confirmed or expired) leaving no pending credit, and
``--pending-weight 0`` turns it all off."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
import httpx

from kvevents.demo.stack import LocalStack
from kvevents.serve import ServeConfig
from kvevents.serve.burstgen import BurstConfig, run_bursts
from kvevents.sim.http import SimHTTPConfig

from .test_service import ready, wait_until

CONTEXT = " ".join(f"doc{i}" for i in range(1500))
SLOW = SimHTTPConfig(prefill_s_per_token=4e-4)  # 1500 tokens: 0.6 s of prefill


def _stack(weight: float, ttl: float = 20.0, max_bytes: int = 32 << 20) -> LocalStack:
    """Three slow-prefill engines and the service on one event loop.  A busy machine can
    starve that loop for seconds: the engines' connect timeout is generous and a
    mark-down (a scrape or ``/tokenize`` that timed out meanwhile) is retried at once,
    since these engines never fail and a skipped one would only turn a burst into 503s."""
    cfg = ServeConfig(
        scrape_interval_s=0.2,
        connect_timeout_s=30.0,
        retry_after_s=0.0,
        pending_weight=weight,
        pending_ttl_s=ttl,
        pending_max_bytes=max_bytes,
    )
    return LocalStack(3, serve=cfg, sim=SLOW)


@pytest.fixture()
def stack() -> Iterator[LocalStack]:
    with _stack(0.5) as s:
        wait_until(lambda: ready(s.url), timeout=60, what="/readyz")
        yield s


def _chat(q: str) -> dict[str, object]:
    return {
        "messages": [{"role": "system", "content": CONTEXT}, {"role": "user", "content": q}],
        "max_tokens": 4,
    }


def _route(url: str, q: str) -> list[dict[str, object]]:
    return list(httpx.post(url + "/route", json=_chat(q), timeout=60).json()["ranked"])


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=60).text
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


def test_siblings_land_together_and_pending_is_checked(stack: LocalStack) -> None:
    url = stack.url
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda q: httpx.post(url + "/v1/chat/completions", json=_chat(q), timeout=60),
                [f"question {i}" for i in range(6)],
            )
        )
    assert all(a.status_code == 200 for a in answers)
    workers = {a.headers["x-kvevents-worker"] for a in answers}
    assert len(workers) == 1  # the burst landed on one rank
    usage = [a.json()["usage"] for a in answers]
    cached = sorted(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    prompt = min(u["prompt_tokens"] for u in usage)
    # the context computed once: every other sibling reused all of it
    assert cached[0] == 0 and all(c >= prompt - 32 for c in cached[1:]), (cached, prompt)
    # the truth check counted the pending credit of the siblings, apart
    stats = stack.service.forwarder.rank_stats[next(iter(workers))]
    assert stats.pending > 0 and stats.pending_over == 0
    assert _metric(url, "kvevents_serve_pending_predictions_total") >= 1
    # the engine's events confirmed every reservation: no pending credit remains
    wait_until(lambda: _metric(url, "kvevents_pending_entries") == 0, what="confirmations")
    assert _metric(url, "kvevents_pending_confirmed_total") >= 1
    top = _route(url, "another question")[0]
    assert top["pending"] == 0 and int(str(top["gpu"])) >= prompt - 32


def test_route_shows_pending_while_the_first_prefills(stack: LocalStack) -> None:
    url = stack.url
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(
            lambda: httpx.post(url + "/v1/chat/completions", json=_chat("first"), timeout=60)
        )
        wait_until(lambda: int(str(_route(url, "second")[0]["pending"])) > 1000, what="pending")
        ranked = _route(url, "second")
        top = ranked[0]
        assert set(top) == {"engine", "rank", "gpu", "cpu", "storage", "pending", "load", "cost"}
        assert top["gpu"] == 0 and all(r["pending"] == 0 for r in ranked[1:])
        answer = first.result()
    assert answer.headers["x-kvevents-worker"] == f"{top['engine']}:{top['rank']}"


def test_expired_reservations_leave_no_credit() -> None:
    with _stack(0.5, ttl=3.0) as s:
        wait_until(lambda: ready(s.url), timeout=60, what="/readyz")
        res = s.service.reservations
        assert res is not None
        # a reservation whose request never reaches an engine: nothing confirms it
        with s.service.fleet.lock:
            keys = s.service.policy.router.request_keys(list(range(5000, 5800)))
        st = s.service.fleet.ranks[1]
        s.call(_reserve(res, keys, st))
        top = httpx.post(
            s.url + "/route", json={"prompt": list(range(5000, 5900))}, timeout=60
        ).json()
        assert top["ranked"][0]["pending"] == 800
        wait_until(
            lambda: (
                httpx.post(
                    s.url + "/route", json={"prompt": list(range(5000, 5900))}, timeout=60
                ).json()["ranked"][0]["pending"]
                == 0
            ),
            what="expiry",
        )
        assert res.overlay.stats.expired == 1 and len(res.overlay) == 0


async def _reserve(res: object, keys: list[int], st: object) -> None:
    res.overlay.reserve(st.worker, keys)  # type: ignore[attr-defined]


def test_weight_zero_turns_it_off() -> None:
    with _stack(0.0) as s:
        wait_until(lambda: ready(s.url), timeout=60, what="/readyz")
        assert s.service.reservations is None
        answers = [
            httpx.post(s.url + "/v1/chat/completions", json=_chat(f"q{i}"), timeout=60)
            for i in range(2)
        ]
        assert all(a.status_code == 200 for a in answers)
        assert all(r["pending"] == 0 for r in _route(s.url, "q3"))
        assert "kvevents_pending_" not in httpx.get(s.url + "/metrics", timeout=60).text


def test_burst_loadgen_reports_recomputed_tokens(stack: LocalStack) -> None:
    cfg = BurstConfig(urls=(stack.url,), burst=4, bursts=2, context_words=(1000, 1200), seed=3)
    rep = asyncio.run(run_bursts(cfg)).to_json()
    assert rep["ok"] == 8 and rep["bursts"] == 2
    # each burst's context is prefilled once, on one engine
    assert rep["engines_per_burst"] == 1.0
    for b in rep["per_burst"]:
        assert b["recomputed"] < b["prompt"] / 2 and b["ttft_max_s"] > 0


def test_loadgen_burst_command_over_two_urls(stack: LocalStack) -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "kvevents", "loadgen", stack.url, stack.url, "--burst", "2",
         "--bursts", "1", "--context-words", "50", "60", "--json"],
        capture_output=True, text=True, timeout=120, cwd=root,
        env={"PYTHONPATH": str(root), "PATH": ""},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert '"recomputed_per_burst"' in out.stdout and '"urls": [' in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "kvevents", "loadgen", stack.url, stack.url],
        capture_output=True, text=True, timeout=60, cwd=root, env={"PYTHONPATH": str(root)},
    )  # fmt: skip
    assert bad.returncode != 0 and "one URL" in bad.stderr


def test_a_flood_of_unique_prompts_stays_within_the_bound() -> None:
    """Unique prompts in flight at once: the overlay evicts its oldest reservations and
    never holds more than its bound; every request is still answered."""
    bound = 1 << 16  # 64 KiB: four 1,500-token reservations
    with _stack(0.5, max_bytes=bound) as s:
        wait_until(lambda: ready(s.url), timeout=60, what="/readyz")
        res = s.service.reservations
        assert res is not None
        peak = 0

        def send(i: int) -> int:
            body = {
                "messages": [{"role": "user", "content": f"u{i} " + CONTEXT}],
                "max_tokens": 2,
            }
            return httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).status_code

        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(send, i) for i in range(12)]
            while not all(f.done() for f in futures):
                peak = max(peak, res.overlay.nbytes)
                wait(futures, timeout=0.005)  # (a sampling tick)
            assert all(f.result() == 200 for f in futures)
        assert res.overlay.stats.evicted_for_bound > 0
        assert 0 < peak <= bound and res.overlay.nbytes <= bound
        assert _metric(s.url, "kvevents_pending_bytes") <= bound
