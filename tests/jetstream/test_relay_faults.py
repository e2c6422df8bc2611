"""The relay under faults: killed and restarted, nats-server restarted, publisher restarted.

Each run ends with the stream holding every batch exactly once (message count and seqs),
and an index fed from JetStream equal to one fed straight from the engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvevents.jetstream import HISTORY_MISSED, JetStreamRelay, LocalNatsServer

from .helpers import (
    Engine,
    follow,
    holdings,
    run_relay_thread,
    stream_seqs,
    stream_seqs_or_empty,
    wait_until,
)

REPO = Path(__file__).resolve().parents[2]


def test_relay_killed_and_restarted_appends_each_batch_once(
    nats_server: LocalNatsServer, engine: Engine
) -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvevents.cli",
        "relay",
        "--nats",
        nats_server.url,
        "--engine",
        f"e0={engine.spec().events_endpoint},{engine.spec().replay_endpoint}",
        "-q",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    try:
        # the relay catches up from seq 0, so batches published before it joined count too
        engine.publish(30)
        assert wait_until(lambda: len(stream_seqs_or_empty(nats_server.url)) >= 30)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    engine.publish(40)  # published while no relay runs
    second = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: len(stream_seqs_or_empty(nats_server.url)) >= 70)
        engine.publish(10)
        assert wait_until(lambda: len(stream_seqs_or_empty(nats_server.url)) >= 80)
    finally:
        second.terminate()
        second.wait(10)
    assert stream_seqs(nats_server.url) == [(0, s) for s in range(80)]
    index, anomalies = follow(nats_server.url, 80)
    assert holdings(index) == holdings(engine.truth())
    assert anomalies == []


def test_nats_server_restart_mid_stream_loses_and_duplicates_nothing(
    nats_server: LocalNatsServer, engine: Engine
) -> None:
    relay = JetStreamRelay(nats_server.url, [engine.spec()], ack_timeout_s=1.0)
    stop, t = run_relay_thread(relay)
    try:
        engine.publish(20)
        assert relay.wait_appended(20, 20)
        nats_server.stop()
        engine.publish(20)  # the relay receives these while the server is down
        nats_server.start()
        engine.publish(10)
        assert relay.wait_appended(50, 30), relay.stats
    finally:
        stop.set()
        t.join(10)
        relay.close()
    assert stream_seqs(nats_server.url) == [(0, s) for s in range(50)]
    index, anomalies = follow(nats_server.url, 50)
    assert holdings(index) == holdings(engine.truth())
    assert anomalies == []


def test_publisher_restart_bumps_the_epoch_and_resets_the_worker(
    nats_server: LocalNatsServer, engine: Engine
) -> None:
    relay = JetStreamRelay(nats_server.url, [engine.spec()])
    stop, t = run_relay_thread(relay)
    try:
        engine.publish(25)
        assert relay.wait_appended(25, 20)
        engine.stop()
        engine.start()  # a new process: seq starts at 0 again, with new content
        # a live engine keeps publishing; the relay must see the new life for what it is
        assert wait_until(lambda: engine.publish(1) or relay.stats.epochs >= 1, 20), relay.stats
        engine.publish(40 - len(engine.sent))
        assert relay.wait_appended(25 + len(engine.sent), 20), relay.stats
    finally:
        stop.set()
        t.join(10)
        relay.close()
    seqs = stream_seqs(nats_server.url)
    assert [s for s in seqs if s[0] == 0] == [(0, s) for s in range(25)]
    assert [s for s in seqs if s[0] == 1] == [(1, s) for s in range(len(engine.sent))]
    index, anomalies = follow(nats_server.url, 25 + len(engine.sent))
    assert [a.kind for a in anomalies] == ["publisher_restart"]
    # the index holds the new life only: what the restarted engine holds
    assert holdings(index) == holdings(engine.truth())
    assert HISTORY_MISSED not in [a.kind for a in anomalies]
