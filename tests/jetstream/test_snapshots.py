"""Index snapshots in a JetStream object store: a late router loads the newest snapshot,
replays only what followed, and ends with the index a full replay gives."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from kvevents.consumers import BlockIndex
from kvevents.consumers.index import snapshot as index_snapshot
from kvevents.jetstream import LocalNatsServer
from kvevents.jetstream.snapshots import (
    RestoredRouterState,
    SnapshotStore,
    Snapshotter,
    apply_item,
    restore_latest,
)

from .helpers import (
    Engine,
    follow,
    holdings,
    run_relay_thread,
    wait_until,
)


def _relay_with_snapshots(
    url: str, engine: Engine, rounds: list[int], before_round: Callable[[int], None]
) -> int:
    """Relay ``engine`` and snapshot every 10 batches; round ``i`` publishes ``rounds[i]``
    batches (a multiple of 10) after ``before_round(i)`` and waits for its snapshots.
    Returns the batches published."""
    from kvevents.jetstream import JetStreamRelay

    relay = JetStreamRelay(url, [engine.spec()])
    stop, t = run_relay_thread(relay)
    snap_stop = threading.Event()
    snapper = Snapshotter(url, every=10, keep=10)
    st = threading.Thread(target=snapper.run, args=(snap_stop,), daemon=True)
    st.start()
    total = 0
    try:
        for i, n in enumerate(rounds):
            before_round(i)
            engine.publish(n)
            total += n
            assert relay.wait_appended(total, 20)
            want = total // 10
            assert wait_until(lambda want=want: snapper.taken >= want, 20)
    finally:
        snap_stop.set()
        stop.set()
        t.join(10)
        relay.close()
    st.join(10)
    return total


def _catch_up(state: RestoredRouterState, total: int) -> int:
    """Apply what follows the restored state's position up to ``total``; returns how
    many batches that was."""
    replayed = 0
    with state.subscriber as sub:
        deadline = time.monotonic() + 20
        while state.subscriber.position.stream_seq < total and time.monotonic() < deadline:
            item = sub.receive(timeout=0.2)
            if item is not None:
                apply_item(state.index, item)
                replayed += 1
    return replayed


def test_late_router_restores_the_newest_snapshot_and_catches_up(
    nats_server: LocalNatsServer, engine: Engine
) -> None:
    from kvevents.jetstream import JetStreamRelay

    relay = JetStreamRelay(nats_server.url, [engine.spec()])
    stop, t = run_relay_thread(relay)
    snap_stop = threading.Event()
    try:
        engine.publish(60)
        assert relay.wait_appended(60, 20)
        snapper = Snapshotter(nats_server.url, every=25, keep=2)
        st = threading.Thread(target=snapper.run, args=(snap_stop,), daemon=True)
        st.start()
        assert wait_until(lambda: snapper.taken >= 2, 20)
        engine.publish(30)  # after the snapshots: a late router must replay these
        assert relay.wait_appended(90, 20)
    finally:
        snap_stop.set()
        stop.set()
        t.join(10)
        relay.close()
    st.join(10)
    with SnapshotStore(nats_server.url) as store:
        names = store.names()
        assert len(names) == 2  # pruned to `keep`
        env = store.latest()
        assert env is not None and env.stream_seq >= 50

    state = restore_latest(nats_server.url)
    assert state.snapshot == names[-1]
    replayed = _catch_up(state, 90)
    assert replayed == 90 - env.stream_seq  # only what followed the snapshot
    full, anomalies = follow(nats_server.url, 90)
    assert holdings(state.index) == holdings(full) == holdings(engine.truth())
    assert anomalies == []


def test_no_snapshot_means_a_full_replay(nats_server: LocalNatsServer, engine: Engine) -> None:
    from kvevents.jetstream import JetStreamRelay

    relay = JetStreamRelay(nats_server.url, [engine.spec()])
    stop, t = run_relay_thread(relay)
    try:
        engine.publish(5)
        assert relay.wait_appended(5, 20)
    finally:
        stop.set()
        t.join(10)
        relay.close()
    state = restore_latest(nats_server.url)
    assert state.snapshot is None and isinstance(state.index, BlockIndex)
    state.subscriber.close()


def test_an_unreadable_newest_snapshot_falls_back_to_an_older_one(
    nats_server: LocalNatsServer, engine: Engine, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The newest snapshot was written by a kvevents with another index format (as after
    an upgrade): it is skipped with a warning, the older one is restored, and the
    router ends where a full replay does."""

    def second_round_writes_another_format(i: int) -> None:
        if i == 1:
            monkeypatch.setattr(
                index_snapshot, "SNAPSHOT_FORMAT", index_snapshot.SNAPSHOT_FORMAT - 1
            )

    total = _relay_with_snapshots(
        nats_server.url, engine, [10, 10], second_round_writes_another_format
    )
    monkeypatch.undo()
    with SnapshotStore(nats_server.url) as store:
        names = store.names()
    assert len(names) == 2
    with caplog.at_level(logging.WARNING, logger="kvevents.jetstream.snapshots"):
        state = restore_latest(nats_server.url)
    assert state.snapshot == names[0]
    assert any(names[1] in r.getMessage() and "format" in r.getMessage() for r in caplog.records)
    assert _catch_up(state, total) == 10
    assert holdings(state.index) == holdings(engine.truth())


def test_no_readable_snapshot_means_a_full_replay(
    nats_server: LocalNatsServer, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index_snapshot, "SNAPSHOT_FORMAT", index_snapshot.SNAPSHOT_FORMAT - 1)
    total = _relay_with_snapshots(nats_server.url, engine, [20], lambda i: None)
    monkeypatch.undo()
    state = restore_latest(nats_server.url)
    assert state.snapshot is None and len(state.index) == 0
    assert _catch_up(state, total) == total
    assert holdings(state.index) == holdings(engine.truth())
