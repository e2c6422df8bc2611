"""Index snapshots in a JetStream object store: a late router loads the newest snapshot,
replays only what followed, and ends with the index a full replay gives."""

from __future__ import annotations

import threading
import time

from kvevents.consumers import BlockIndex
from kvevents.jetstream import LocalNatsServer
from kvevents.jetstream.snapshots import SnapshotStore, Snapshotter, apply_item, restore_latest

from .helpers import (
    Engine,
    follow,
    holdings,
    run_relay_thread,
    wait_until,
)


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
    replayed = 0
    with state.subscriber as sub:
        deadline = time.monotonic() + 20
        while state.subscriber.position.stream_seq < 90 and time.monotonic() < deadline:
            item = sub.receive(timeout=0.2)
            if item is not None:
                apply_item(state.index, item)
                replayed += 1
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
