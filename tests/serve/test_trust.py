"""Stream trust, with real processes: an engine whose HTTP front answers while its event
stream is cut (a proxy between its publisher and the service closes every link) is
untrusted within ``--stale-after``: its KV credit is not used (it is routed by load
alone), one line says so, ``/workers`` and the metrics show it; it is trusted again once
its events return.  And the consumer thread looks ranks up without deprecated names (with
warnings as errors, one killed the thread)."""

from __future__ import annotations

import time
import warnings
from dataclasses import replace

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
import httpx
from _tcp_proxy import CutProxy

from serve._procs import Proc, serve, sim_engines, spec_parts, wait_until

STALE_AFTER_S = 2.0
PROMPT = "an old conversation that only the first engine holds in its cache. " * 8


def worker(url: str, name: str) -> dict:
    return next(w for w in httpx.get(url + "/workers").json()["workers"] if w["worker"] == name)


def credit(url: str, name: str) -> int:
    ranked = httpx.post(url + "/route", json={"prompt": PROMPT + "and more"}, timeout=30).json()
    return next(r["gpu"] for r in ranked["ranked"] if f"{r['engine']}:{r['rank']}" == name)


def test_a_silent_stream_is_untrusted_routed_by_load_and_trusted_again() -> None:
    sims, specs = sim_engines(2)
    procs: list[Proc] = [sims]
    name, http, events, replay = spec_parts(specs[0])
    ev, rep = CutProxy(events), CutProxy(replay)
    try:
        service, url = serve(
            [f"{name}={http},{ev.endpoint},{rep.endpoint}", specs[1]],
            "--stale-after", str(STALE_AFTER_S),
        )  # fmt: skip
        procs.append(service)
        wait_until(lambda: httpx.get(url + "/readyz").status_code == 200, what="/readyz")
        # The first engine holds the prompt: KV credit for it.
        r = httpx.post(
            http + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60
        )
        assert r.status_code == 200
        wait_until(lambda: credit(url, "sim-0:0") > 0, what="sim-0's KV credit")
        assert worker(url, "sim-0:0")["trusted"] is True

        # Its stream is cut; its HTTP front still answers.
        cut_at = time.monotonic()
        ev.cut()
        rep.cut()
        wait_until(lambda: worker(url, "sim-0:0")["trusted"] is False,
                   timeout=STALE_AFTER_S + 20, what="sim-0 untrusted")  # fmt: skip
        untrusted_after = time.monotonic() - cut_at
        # (the bound: stale_after_s; plus one liveness scan and a /workers poll, loaded box)
        assert untrusted_after < STALE_AFTER_S + 5, untrusted_after
        w = worker(url, "sim-0:0")
        assert w["up"] is True and w["state"] == "stale"
        assert w["stream"]["stale_periods"] == 1
        assert credit(url, "sim-0:0") == 0  # no KV credit: routed by load alone
        ranked = httpx.post(url + "/route", json={"prompt": PROMPT}, timeout=30).json()["ranked"]
        assert {f"{r['engine']}:{r['rank']}" for r in ranked} == {"sim-0:0", "sim-1:0"}
        metrics = httpx.get(url + "/metrics").text
        assert 'kvevents_stream_trusted{engine="sim-0",rank="0"} 0.0' in metrics
        assert 'kvevents_stream_trusted{engine="sim-1",rank="0"} 1.0' in metrics
        assert 'kvevents_stream_stale_periods_total{engine="sim-0",rank="0"} 1.0' in metrics
        lines = [x for x in service.errors if "untrusted" in x]
        assert len(lines) == 1 and "sim-0:0" in lines[0], service.errors[-10:]
        # Served meanwhile: a request still goes through (to whichever rank costs less).
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello " * 20, "max_tokens": 2})
        assert r.status_code == 200

        # The links come back: trusted again, with its credit.
        restored_at = time.monotonic()
        ev.restore()
        rep.restore()
        wait_until(lambda: worker(url, "sim-0:0")["trusted"] is True,
                   timeout=60, what="sim-0 trusted again")  # fmt: skip
        trusted_after = time.monotonic() - restored_at
        assert credit(url, "sim-0:0") > 0
        assert service.stderr_has("sim-0:0: trusted again")
        assert (
            'kvevents_stream_trusted{engine="sim-0",rank="0"} 1.0'
            in httpx.get(url + "/metrics").text
        )
        print(
            f"untrusted {untrusted_after:.2f} s after the cut (stale_after_s {STALE_AFTER_S}), "
            f"trusted again {trusted_after:.2f} s after the links came back"
        )
    finally:
        ev.close()
        rep.close()
        for p in reversed(procs):
            p.stop()


def test_rank_lookup_is_by_the_worker_derived_from_the_spec() -> None:
    from kvevents.serve.config import ServeConfig, parse_engine_spec
    from kvevents.serve.fleet import Fleet

    spec = parse_engine_spec(
        "x=http://127.0.0.1:9,tcp://127.0.0.1:9,tcp://127.0.0.1:10;dp=2;topic=kv"
    )
    fleet = Fleet(replace(ServeConfig(), engines=(spec,)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert [st.worker for st in fleet.ranks] == [("x#kv", 0), ("x@dp1#kv", 1)]
            assert fleet.rank_for("x@dp1#kv", 1) is fleet.ranks[1]
            # a rank-1 batch on rank 0's stream, or another topic: no rank's worker
            assert fleet.rank_for("x#kv", 1) is None
            assert fleet.rank_for("x#kv@b", 0) is None
            assert fleet.rank_for("x", 0) is None
            # an anomaly of a stream (no rank): the rank reading that stream
            assert fleet.rank_for("x@dp1#kv", None) is fleet.ranks[1]
            assert fleet.rank_for("x#other", None) is fleet.ranks[0]
    finally:
        fleet.close()


def test_trust_and_bootstrap_options_are_checked() -> None:
    from kvevents.errors import ConfigError
    from kvevents.serve.config import load_config

    engine = ["a=http://127.0.0.1:9,tcp://127.0.0.1:9,tcp://127.0.0.1:10"]
    cfg = load_config(
        engines=engine,
        environ={"KVEVENTS_SERVE_ADMIN_TOKEN": "t0k"},
        options={"stale_after_s": "5", "ready_when_incomplete": "false"},
    )
    assert (cfg.stale_after_s, cfg.ready_when_incomplete, cfg.admin_token) == (5.0, False, "t0k")
    assert load_config(
        engines=engine, options={"ready_when_incomplete": True}
    ).ready_when_incomplete
    for bad, why in [
        ({"stale_after_s": 0}, "stale_after_s must be > 0"),
        ({"ready_when_incomplete": "maybe"}, "is not a boolean"),
        ({"bootstrap_from": "http://127.0.0.1:9", "nats_url": "nats://127.0.0.1:9"}, "--nats"),
    ]:
        with pytest.raises(ConfigError, match=why):
            load_config(engines=engine, options=bad)


def test_an_unreachable_peer_stops_the_service_with_one_line() -> None:
    proc = Proc(
        "serve", "--engine", "a=http://127.0.0.1:9,tcp://127.0.0.1:9,tcp://127.0.0.1:10",
        "--port", "0", "--bootstrap-from", "http://127.0.0.1:9",
    )  # fmt: skip
    assert proc.p.wait(timeout=60) == 2
    wait_until(lambda: proc.stderr_has("cannot bootstrap from http://127.0.0.1:9/snapshot"),
               what="the error line")  # fmt: skip
    proc.stop()  # the process has exited: this closes its pipes
