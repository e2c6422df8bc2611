"""End to end with real processes: ``kvevents sim serve`` engines, ``kvevents serve`` in
front, real HTTP and ZMQ between them.  Conditions are waited on, never slept on."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
import httpx

from ._procs import Proc, wait_until

SYSTEM = "You answer questions about caches, briefly and kindly. " * 8


def _free_run(n: int) -> int:
    """A base port with ``n`` consecutive free ports."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65000:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("0.0.0.0", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise AssertionError("no free port range")


@dataclass
class Fleet:
    url: str
    engines: dict[str, str]  # name -> HTTP URL
    lines: list[str]
    bases: tuple[int, int]
    victim: Proc
    procs: list[Proc]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    http_base, events_base = _free_run(3), _free_run(6)
    sims = Proc(
        "sim", "serve", "--engines", "3", "--http-port", str(http_base),
        "--events-port", str(events_base),
    )  # fmt: skip
    procs = [sims]
    try:
        lines = sims.read_lines(3, 30.0)
        victim = Proc("sim", "serve", "--engines", "1")
        procs.append(victim)
        (vline,) = victim.read_lines(1, 30.0)
        vspec = vline.removeprefix("--engine ").replace("sim-0=", "victim=", 1)
        args = [a for line in lines for a in line.split(" ", 1)]
        service = Proc("serve", *args, "--engine", vspec, "--port", "0", "--scrape-interval", "0.2")
        procs.append(service)
        (listening,) = service.read_lines(1, 30.0)
        m = re.search(r"http://127\.0\.0\.1:\d+", listening)
        assert m, listening
        url = m.group(0)
        wait_until(lambda: httpx.get(url + "/readyz").status_code == 200, 30.0, what="/readyz")
        engines = {
            spec.split("=")[0]: spec.split("=")[1].split(",")[0]
            for spec in [line.removeprefix("--engine ") for line in lines] + [vspec]
        }
        yield Fleet(url, engines, lines, (http_base, events_base), victim, procs)
    finally:
        for p in reversed(procs):
            p.stop()


def caught_up(f: Fleet) -> Callable[[], bool]:
    """The service's index has every batch the engines published (their /metrics are
    not enough: use the seq each answer implies by asking /workers until it is stable)."""
    last: list[object] = []

    def check() -> bool:
        w = httpx.get(f.url + "/workers").json()["workers"]
        seqs = [x["last_seq"] for x in w]
        busy = any(x["in_flight"] for x in w)
        last.append(seqs)
        return not busy and len(last) >= 3 and last[-1] == last[-2] == last[-3]

    return check


def test_sim_serve_prints_engine_lines(fleet: Fleet) -> None:
    hb, eb = fleet.bases
    for i, line in enumerate(fleet.lines):
        assert line == (
            f"--engine sim-{i}=http://127.0.0.1:{hb + i},"
            f"tcp://127.0.0.1:{eb + 2 * i},tcp://127.0.0.1:{eb + 2 * i + 1}"
        )


def _digest_ok(f: Fleet, r: httpx.Response, stream: bool) -> None:
    first = r.text.split("\n")[0].removeprefix("data: ") if stream else r.text
    rid = json.loads(first)["id"]
    engine = r.headers["x-kvevents-worker"].rsplit(":", 1)[0]
    sent = httpx.get(f.engines[engine] + "/sim/response-digest", params={"id": rid}).json()
    assert sent["sha256"] == hashlib.sha256(r.content).hexdigest(), "response changed in transit"


def _usage(r: httpx.Response, stream: bool) -> dict:
    if not stream:
        return r.json()["usage"]
    events = [json.loads(x[6:]) for x in r.text.split("\n") if x.startswith("data: {")]
    return events[-1]["usage"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_requests_reach_the_predicted_engine_unchanged(
    fleet: Fleet, path: str, stream: bool
) -> None:
    chat = path.endswith("chat/completions")
    tag = f"{path}-{stream}"

    def body(turn: int) -> dict:
        extra: dict = {"max_tokens": 16, "stream": stream}
        if stream:
            extra["stream_options"] = {"include_usage": True}
        if chat:
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": tag}]
            msgs += [{"role": "user", "content": f"turn {t}"} for t in range(turn)]
            return {"messages": msgs, **extra}
        return {"prompt": SYSTEM + tag + " turn" * turn * 5, **extra}

    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        r1 = c.post(path, json=body(0))
        assert r1.status_code == 200
        _digest_ok(fleet, r1, stream)
        wait_until(caught_up(fleet), 30.0, what="the index to settle")
        route_body = {k: v for k, v in body(1).items() if k in ("messages", "prompt")}
        ranked = c.post("/route", json=route_body).json()["ranked"]
        best = ranked[0]
        assert best["gpu"] + best["cpu"] > 0
        r2 = c.post(path, json=body(1))
        assert r2.status_code == 200
        assert r2.headers["x-kvevents-worker"] == f"{best['engine']}:{best['rank']}"
        assert r2.headers["x-kvevents-worker"] == r1.headers["x-kvevents-worker"]
        _digest_ok(fleet, r2, stream)
        usage = _usage(r2, stream)
        assert (
            usage["prompt_tokens_details"]["cached_tokens"]
            == best["gpu"] + best["cpu"] + best["storage"]
        )


def test_service_endpoints_answer_as_documented(fleet: Fleet) -> None:
    with httpx.Client(base_url=fleet.url, timeout=30) as c:
        assert c.get("/readyz").json()["ready"] is True
        assert c.get("/healthz").json() == {"status": "ok"}
        workers = c.get("/workers").json()["workers"]
        assert [w["worker"] for w in workers] == ["sim-0:0", "sim-1:0", "sim-2:0", "victim:0"]
        for w in workers:
            assert {"blocks", "state", "last_seq", "lag_s", "anomalies", "ready"} <= set(w)
            assert set(w["blocks"]) == {"GPU", "CPU", "STORAGE"}
        # One request of its own: the request metrics exist once one was served (this
        # test may run alone).
        r = c.post("/v1/completions", json={"prompt": SYSTEM + "metrics", "max_tokens": 2})
        assert r.status_code == 200
        metrics = c.get("/metrics").text
        for name in (
            "kvevents_subscriber_batches_total",
            "kvevents_index_applied_total",
            "kvevents_decoder_",
            "kvevents_serve_routing_decisions_total",
            "kvevents_serve_prediction_error_tokens_bucket",
            "kvevents_serve_predictions_total",
            "kvevents_serve_request_latency_seconds_bucket",
            "kvevents_serve_engine_up",
        ):
            assert name in metrics, name
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["sim-model"]
        assert c.get("/").headers["content-type"].startswith("text/html")
        bad = c.post("/v1/chat/completions", content=b"{")
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_engine_killed_mid_run_is_marked_and_skipped(fleet: Fleet) -> None:
    victim_url = fleet.engines["victim"]
    prompt = SYSTEM + " the victim's own conversation"
    # the victim holds this prompt's prefix: the index sends its follow-ups there
    httpx.post(victim_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=30)
    wait_until(caught_up(fleet), 30.0, what="the index to settle")
    ranked = httpx.post(fleet.url + "/route", json={"prompt": prompt + " more"}).json()["ranked"]
    assert ranked[0]["engine"] == "victim"

    health: list[int] = []
    stop = threading.Event()

    def poll_health() -> None:
        with httpx.Client(base_url=fleet.url, timeout=10) as c:
            while not stop.is_set():
                health.append(c.get("/healthz").status_code)

    t = threading.Thread(target=poll_health)
    t.start()
    try:
        fleet.victim.stop(signal.SIGKILL)
        # whether the metrics scrape or this request finds the victim gone first, the
        # request is answered by another engine (a refused connection is re-sent)
        with httpx.Client(base_url=fleet.url, timeout=60) as c:
            for stream in (False, True):
                r = c.post(
                    "/v1/completions",
                    json={"prompt": prompt + " more", "max_tokens": 8, "stream": stream},
                )
                assert r.status_code == 200
                assert not r.headers["x-kvevents-worker"].startswith("victim")
            w = {x["engine"]: x for x in c.get("/workers").json()["workers"]}
            assert w["victim"]["up"] is False and w["victim"]["state"] == "stale"
            assert w["victim"]["down_reason"]
            assert c.get("/readyz").json()["down"] == ["victim"]
            ranked = c.post("/route", json={"prompt": prompt + " more"}).json()["ranked"]
            assert "victim" not in {x["engine"] for x in ranked}
            for i in range(10):
                r = c.post("/v1/completions", json={"prompt": f"after {i}", "max_tokens": 2})
                assert r.status_code == 200
            metrics = c.get("/metrics").text
            assert 'kvevents_serve_engine_up{engine="victim"} 0.0' in metrics
            assert re.search(r'kvevents_serve_upstream_errors_total\{engine="victim"', metrics)
    finally:
        stop.set()
        t.join()
    assert health and set(health) == {200}


def test_sim_serve_and_serve_stop_cleanly_on_sigterm() -> None:
    sims = Proc("sim", "serve", "--engines", "1")
    try:
        (line,) = sims.read_lines(1, 30.0)
        service = Proc("serve", *line.split(" ", 1), "--port", "0")
        try:
            (listening,) = service.read_lines(1, 30.0)
            url = re.search(r"http://127\.0\.0\.1:\d+", listening).group(0)  # type: ignore[union-attr]
            wait_until(
                lambda: httpx.get(url + "/healthz").status_code == 200, 30.0, what="/healthz"
            )
        finally:
            # uvicorn shuts down gracefully, then re-raises the signal (as vLLM's server)
            assert service.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    finally:
        assert sims.stop(signal.SIGTERM) == 0
