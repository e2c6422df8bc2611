"""Two ``kvevents serve`` replicas share their reservations over a real nats-server: a
sibling routed by one replica is pending on the other's ``/route`` before the engine's
events arrive, the engine's events then take over, and expired or confirmed
reservations leave no pending credit.  Real processes: simulated engines, two services,
nats-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")

from kvevents.jetstream import LocalNatsServer

from .helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = " ".join(f"ctx{i}" for i in range(900))  # about 900 tokens: 2 s of prefill


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _post(url: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[int, Any, str]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read()), r.headers.get("x-kvevents-worker", "")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _connected(url: str) -> bool:
    try:
        return "kvevents_pending_exchange_connected 1.0" in _get(url + "/metrics")
    except OSError:
        return False


def _chat(question: str) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": CONTEXT},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
    }


def _top(url: str, question: str) -> dict[str, Any]:
    _, body, _ = _post(url + "/route", _chat(question))
    return dict(body["ranked"][0])


@pytest.fixture
def fleet(
    nats_server: LocalNatsServer,
) -> Iterator[tuple[list[str], LocalNatsServer, Callable[[int], None]]]:
    """Two engines, two replicas on one nats-server; yields their URLs, the server, and
    ``restart(i)``: stop replica i and start it again (same port and name)."""
    sim = subprocess.Popen(
        [sys.executable, "-m", "kvevents", "sim", "serve", "--engines", "2",
         "--prefill-us-per-token", "2500"],
        env=_env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    procs: list[subprocess.Popen[Any]] = [sim]
    try:
        assert sim.stdout is not None
        engines = [sim.stdout.readline().split(" ", 1)[1].strip() for _ in range(2)]
        urls = []
        cmds = []
        for i in range(2):
            port = free_port()
            cmd = [sys.executable, "-m", "kvevents", "serve", "--port", str(port),
                   "--pending-nats", nats_server.url, "--replica", f"r{i}",
                   "--pending-ttl", "20"]  # fmt: skip
            for e in engines:
                cmd += ["--engine", e]
            procs.append(subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
            cmds.append(cmd)

        def connected() -> bool:
            return all(_connected(u) for u in urls)

        def restart(i: int) -> None:
            procs[1 + i].terminate()
            procs[1 + i].wait(timeout=10)
            procs[1 + i] = subprocess.Popen(cmds[i], env=_env(), stdout=subprocess.DEVNULL)
            assert wait_until(lambda: _ready(urls[i]) and connected(), 60)

        assert wait_until(lambda: all(_ready(u) for u in urls), 60)
        assert wait_until(connected, 30)  # both replicas' exchanges are connected
        yield urls, nats_server, restart
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if sim.stdout is not None:
            sim.stdout.close()


def test_a_sibling_routed_by_one_replica_is_pending_on_the_other(
    fleet: tuple[list[str], LocalNatsServer, Callable[[int], None]],
) -> None:
    (a, b), nats, _ = fleet
    # nothing is pending anywhere yet
    assert _top(b, "second question")["pending"] == 0
    first: dict[str, Any] = {}

    def send_first() -> None:
        first["answer"] = _post(a + "/v1/chat/completions", _chat("first question"))

    t = threading.Thread(target=send_first)
    t.start()
    try:
        # while the first sibling prefills, replica B credits its engine with the context
        assert wait_until(lambda: _top(b, "second question")["pending"] > 800, 20)
        top_b = _top(b, "second question")
        top_a = _top(a, "second question")
        assert top_a["pending"] > 800
        assert (top_b["engine"], top_b["rank"]) == (top_a["engine"], top_a["rank"])
        assert top_b["gpu"] == 0  # never as GPU truth
        # the second sibling, sent to replica B, lands on the same engine and reuses it
        status, body, worker = _post(b + "/v1/chat/completions", _chat("second question"))
        assert status == 200 and worker == f"{top_b['engine']}:{top_b['rank']}"
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 800
    finally:
        t.join(60)
    status, _, first_worker = first["answer"]
    assert status == 200 and first_worker == worker
    # the engine's events confirm: confirmed state, no pending credit left
    assert wait_until(lambda: _top(b, "third question")["gpu"] > 800, 20)
    top = _top(b, "third question")
    assert top["pending"] == 0
    metrics = _get(b + "/metrics")
    assert "kvevents_pending_exchange_folded_total 1.0" in metrics
    # NATS gone: both replicas keep routing (they lose nothing but the overlay)
    nats.close()
    status, _, _ = _post(a + "/v1/chat/completions", _chat("fourth question"))
    assert status == 200
    assert _ready(a) and _ready(b)


def test_a_request_that_ends_unstored_ends_on_the_other_replica_too(
    fleet: tuple[list[str], LocalNatsServer, Callable[[int], None]],
) -> None:
    """The engine refuses the request (its context is too long for the answer asked):
    its reservation, taken before sending, is contradicted at its origin and the end
    travels, so the other replica stops crediting it long before its 20 s TTL."""
    (a, b), _, _ = fleet
    body = _chat("too long an answer")
    body["max_tokens"] = 1_000_000
    req = urllib.request.Request(
        a + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    err.value.close()  # the error holds the response's socket
    assert err.value.code == 400
    # B heard of it; then of its end: no pending credit left well within the TTL
    assert wait_until(
        lambda: "kvevents_pending_exchange_ends_folded_total 1.0" in _get(b + "/metrics"), 10
    )
    assert wait_until(lambda: _top(b, "another")["pending"] == 0, 5)
    metrics = _get(b + "/metrics")
    assert "kvevents_pending_contradicted_total 1.0" in metrics
    assert "kvevents_pending_entries 0.0" in metrics


def test_a_restarted_replica_loses_only_its_overlay(
    fleet: tuple[list[str], LocalNatsServer, Callable[[int], None]],
) -> None:
    """Replica B restarts while A's request is in flight: B comes back ready with the
    engines' state from their events (replayed), an empty overlay, and hears A's next
    reservation."""
    (a, b), _, restart = fleet
    status, _, worker = _post(a + "/v1/chat/completions", _chat("before the restart"))
    assert status == 200
    restart(1)
    # the engines' state came back from their events: the context is confirmed on GPU
    assert wait_until(lambda: _top(b, "after")["gpu"] > 800, 20)
    top = _top(b, "after")
    assert f"{top['engine']}:{top['rank']}" == worker and top["pending"] == 0
    assert "kvevents_pending_entries 0.0" in _get(b + "/metrics")
    # and the exchange works again: a new context routed by A is pending on B
    other = {"messages": [{"role": "system", "content": "new " + CONTEXT}], "max_tokens": 4}
    t = threading.Thread(target=lambda: _post(a + "/v1/chat/completions", other))
    t.start()
    try:
        assert wait_until(lambda: _post(b + "/route", other)[1]["ranked"][0]["pending"] > 800, 20)
    finally:
        t.join(60)
