"""NATS failures as an operator meets them, through the real command line: a closed port,
a server without JetStream, a server stopped under a running command.  Each says one line,
exits with the documented status, and prints no traceback or asyncio noise."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvevents.errors import ConfigError
from kvevents.jetstream import LocalNatsServer

from .helpers import Engine, free_port, wait_until

REPO = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def kvevents(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m kvevents ARGS`` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kvevents", *args],
        capture_output=True,
        text=True,
        env=env(),
        timeout=timeout,
        cwd=REPO,
    )


NOISE = ("Traceback", "Task was destroyed", "Event loop is closed", "nats: encountered error")


def assert_quiet(stderr: str) -> None:
    for word in NOISE:
        assert word not in stderr, stderr


@pytest.fixture
def plain_nats() -> Iterator[LocalNatsServer]:
    """A nats-server started without -js."""
    try:
        server = LocalNatsServer(jetstream=False).start()
    except ConfigError as exc:
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.close()


def commands(url: str, tmp_path: Path) -> dict[str, list[str]]:
    engine = f"e=tcp://127.0.0.1:{free_port()}"
    return {
        "record": ["record", url, "-o", str(tmp_path / "x.kvcap"), "--duration", "2"],
        "relay": ["relay", "--nats", url, "--engine", engine, "--duration", "2"],
        "serve": ["serve", "--nats", url, "--engine", "e=http://127.0.0.1:1", "--port", "0"],
        "replay": ["replay", str(REPO / "examples" / "sample.kvcap"), "--publish", url],
        "snapshots": [
            "relay",
            "--nats",
            url,
            "--engine",
            engine,
            "--snapshot-every",
            "10",
            "--duration",
            "2",
        ],
    }


ALL = ["record", "relay", "serve", "replay", "snapshots"]


@pytest.mark.parametrize("command", ALL)
def test_closed_port_is_one_line(command: str, tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = kvevents(*commands(url, tmp_path)[command], timeout=60)
    wall = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1] == f"kvevents: error: cannot reach {url}: connection refused"
    assert_quiet(r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("relaying ")]
    assert len(lines) == 1, r.stderr
    assert wall < 20  # the connection is tried for 2 s, not retried for ever
    assert not (tmp_path / "x.kvcap").exists()  # nothing written when nothing was reached


@pytest.mark.parametrize("command", ALL)
def test_server_without_jetstream_is_one_line(
    command: str, plain_nats: LocalNatsServer, tmp_path: Path
) -> None:
    r = kvevents(*commands(plain_nats.url, tmp_path)[command], timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        f"kvevents: error: JetStream is not enabled on {plain_nats.url}: start nats-server with -js"
    ]


def popen(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvevents", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        cwd=REPO,
    )


def stream_count(url: str) -> int:
    """Batches in the stream now (-1 while it cannot be read)."""

    async def count() -> int:
        import nats

        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
        try:
            info = await nc.jetstream().stream_info("KV_EVENTS")
            return int(info.state.messages)
        finally:
            await nc.close()

    try:
        return asyncio.run(count())
    except Exception:
        return -1


def test_relay_rides_out_a_server_restart(nats_server: LocalNatsServer, engine: Engine) -> None:
    spec = f"e=tcp://127.0.0.1:{engine.port},tcp://127.0.0.1:{engine.replay_port}"
    relay = popen("relay", "--nats", nats_server.url, "--engine", spec, "-q")
    try:
        engine.publish(50)
        assert wait_until(lambda: stream_count(nats_server.url) == 50, 60)
        nats_server.stop()
        engine.publish(50)  # published while the server is away: held by the relay
        nats_server.start()
        engine.publish(50)
        assert wait_until(lambda: stream_count(nats_server.url) == 150, 60)
    finally:
        relay.send_signal(signal.SIGINT)
        _, err = relay.communicate(timeout=60)
    assert relay.returncode == 0, err
    assert_quiet(err)
    lines = err.splitlines()
    assert f"kvevents: warning: lost the connection to {nats_server.url}; reconnecting" in lines
    back = [ln for ln in lines if ln.startswith("kvevents: warning: reconnected to ")]
    assert len(back) == 1, err
    assert lines[-1].startswith("relayed 150 batches (0 already stored"), err


def test_relay_duration_holds_while_the_server_is_away(
    nats_server: LocalNatsServer, engine: Engine
) -> None:
    spec = f"e=tcp://127.0.0.1:{engine.port},tcp://127.0.0.1:{engine.replay_port}"
    relay = popen("relay", "--nats", nats_server.url, "--engine", spec, "--duration", "4", "-q")
    try:
        engine.publish(10)
        assert wait_until(lambda: stream_count(nats_server.url) == 10, 30)
        nats_server.stop()
        t0 = time.monotonic()
        engine.publish(10)  # these cannot be stored before the relay must stop
        _, err = relay.communicate(timeout=60)
        wall = time.monotonic() - t0
    finally:
        if relay.poll() is None:
            relay.kill()
    assert relay.returncode == 0, err
    assert wall < 15, wall  # --duration 4 ends it, whatever the server does
    assert_quiet(err)
    assert "lost the connection" in err
    assert "batch(es) not stored; the next relay run appends them" in err


def test_record_from_jetstream_resumes_after_a_server_restart(
    nats_server: LocalNatsServer, engine: Engine, tmp_path: Path
) -> None:
    spec = f"e=tcp://127.0.0.1:{engine.port},tcp://127.0.0.1:{engine.replay_port}"
    relay = popen("relay", "--nats", nats_server.url, "--engine", spec, "-q")
    out = tmp_path / "j.kvcap"
    rec = None
    try:
        engine.publish(30)
        assert wait_until(lambda: stream_count(nats_server.url) == 30, 60)
        rec = popen("record", nats_server.url, "-o", str(out), "--count", "60", "-q")
        assert wait_until(out.exists, 30)
        nats_server.stop()
        nats_server.start()
        engine.publish(30)
        _, err = rec.communicate(timeout=90)
    finally:
        for p in (rec, relay):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.communicate(timeout=60)
    assert rec.returncode == 0, err
    assert_quiet(err)
    assert "recorded 60 records (60 batches" in err
    summary = kvevents("inspect", str(out), "--summary", "--json")
    assert json.loads(summary.stdout)["batches"] == 60


def test_serve_rides_out_a_server_restart(nats_server: LocalNatsServer, engine: Engine) -> None:
    import urllib.request

    spec = f"e=tcp://127.0.0.1:{engine.port},tcp://127.0.0.1:{engine.replay_port}"
    relay = popen("relay", "--nats", nats_server.url, "--engine", spec, "-q")
    serve = None
    try:
        engine.publish(20)
        assert wait_until(lambda: stream_count(nats_server.url) == 20, 60)
        port = free_port()
        serve = popen("serve", "--nats", nats_server.url, "--engine", "e=http://127.0.0.1:1",
                      "--port", str(port))  # fmt: skip

        def batches() -> int:
            try:
                url = f"http://127.0.0.1:{port}/workers"
                with urllib.request.urlopen(url, timeout=2) as r:
                    body = json.loads(r.read())
            except OSError:
                return -1
            return sum(w["batches"] for w in body["workers"])

        assert wait_until(lambda: batches() == 20, 60)
        nats_server.stop()
        nats_server.start()
        engine.publish(20)
        assert wait_until(lambda: batches() == 40, 60)  # the reader came back by itself
    finally:
        for p in (serve, relay):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGINT)
        _, err = serve.communicate(timeout=60) if serve is not None else ("", "")
        relay.communicate(timeout=60)
    assert_quiet(err)
    lines = err.splitlines()
    assert f"kvevents: warning: lost the connection to {nats_server.url}; reconnecting" in lines
    assert sum(ln.startswith("kvevents: warning: reconnected to ") for ln in lines) == 1
    # nothing else repeats while the server is away (the engine's HTTP front is absent
    # in this test: that warning is about it, not about NATS)
    noise = [
        ln
        for ln in lines
        if "nats" in ln.lower() and "lost the connection" not in ln and "reconnected" not in ln
    ]
    assert not noise, err
    assert not any("reservation exchange" in ln for ln in lines), err
