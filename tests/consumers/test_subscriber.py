"""Subscriber against real ZMQ sockets that behave like vLLM's publisher, with faults."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest
import zmq

sys.path.insert(0, os.path.dirname(__file__))
from _zmq_helpers import FaultyPublisher, drain, make_batch, summarize

from kvevents.codec import decode_batch, encode_batch, pack_live
from kvevents.consumers import (
    ANOMALY_KINDS,
    Anomaly,
    ReceivedBatch,
    Subscriber,
    SubscriberOptions,
    ZmqSource,
)
from kvevents.errors import ConfigError

pytestmark = pytest.mark.timeout(30)


def batches_of(items: list[object]) -> list[ReceivedBatch]:
    return [i for i in items if isinstance(i, ReceivedBatch)]


def anomalies_of(items: list[object], kind: str | None = None) -> list[Anomaly]:
    return [i for i in items if isinstance(i, Anomaly) and (kind is None or i.kind == kind)]


def got_seq(seq: int, source: str | None = None):
    def pred(items: list[object]) -> bool:
        return any(
            isinstance(i, ReceivedBatch) and i.seq == seq and (source is None or i.source == source)
            for i in items
        )

    return pred


def replays_done(sub: Subscriber) -> bool:
    """Every replay requested so far has seen its end marker."""
    return sub.stats.replays["completed"] == sub.stats.replays["requested"]


def connect(pub: FaultyPublisher, **options: Any) -> Subscriber:
    sub = Subscriber(
        [pub.endpoint],
        topic=b"kv",
        replay_endpoints=[pub.replay_endpoint],
        options=SubscriberOptions(**options),
    )
    pub.wait_for_subscribers()
    return sub


def test_follows_live_stream_with_raw_bytes_kept():
    with FaultyPublisher() as pub, connect(pub) as sub:
        sent = pub.publish_many(make_batch(i, rank=2) for i in range(30))
        items = drain(sub, got_seq(29))
    got = batches_of(items)
    assert [(b.seq, b.payload) for b in got] == sent
    assert all(b.source == pub.source and b.dp_rank == 2 and b.topic == b"kv@test" for b in got)
    assert all(not b.replayed for b in got)
    assert got[5].batch == make_batch(5, rank=2)
    assert anomalies_of(items) == []
    assert sub.stats.batches == 30
    assert sub.stats.events == sum(len(make_batch(i).events) for i in range(30))


@pytest.mark.parametrize("legacy", [False, True], ids=["0.26+", "pre-0.26"])
def test_dropped_frames_are_replayed_and_stream_is_exact(legacy: bool):
    skip = {3, 7, 8, 9, 15, 39}
    sent: list[tuple[int, bytes]] = []
    items: list[object] = []
    with FaultyPublisher(legacy_replay=legacy) as pub, connect(pub) as sub:
        # Each chunk ends with a batch that is sent, so each gap is seen on its own.
        for lo, hi in ((0, 5), (5, 13), (13, 21), (21, 41)):
            sent += pub.publish_many((make_batch(i) for i in range(lo, hi)), skip=skip)
            items += drain(sub, lambda it, hi=hi: got_seq(hi - 1)(it) and replays_done(sub))
    got = batches_of(items)
    assert [(b.seq, b.payload) for b in got] == sent, summarize(items)
    assert {b.seq for b in got if b.replayed} == skip
    # Replayed batches carry the live topic even when the reply had no topic frame.
    assert all(b.topic == b"kv@test" for b in got)
    gaps = anomalies_of(items, "gap")
    assert sorted((a.first_seq, a.last_seq) for a in gaps) == [
        (3, 3),
        (7, 9),
        (15, 15),
        (39, 39),
    ]
    assert anomalies_of(items, "unrecoverable_loss") == []
    assert sub.stats.lost_batches == 0
    # The start-up catch-up, then one replay per gap from the last applied seq.
    assert sub.stats.replays["completed"] == 5
    assert pub.requests == [0, 2, 6, 14, 38]


def test_live_traffic_during_a_replay_is_merged_in_order():
    with FaultyPublisher(hold_replay=True) as pub, connect(pub, catch_up=False) as sub:
        sent = pub.publish_many((make_batch(i) for i in range(10)), skip={2})
        items = drain(sub, lambda it: len(pub.requests) == 1 and len(it) >= 3)
        # While the replay is held, more live traffic arrives and must be buffered.
        sent += pub.publish_many(make_batch(i) for i in range(10, 20))
        items += drain(sub, lambda it: sub._table.streams[(pub.source, 0)].tracker.pending == 17, 5)
        assert batches_of(items)[-1].seq == 1
        pub.release.set()
        items += drain(sub, lambda it: got_seq(19)(it) and sub.stats.replays["completed"] == 1)
    assert [(b.seq, b.payload) for b in batches_of(items)] == sent
    assert sub.stats.dropped["replay_overlap"] >= 17  # the replay resent what live had


def test_publisher_restart_is_reported_and_new_stream_followed():
    with FaultyPublisher() as pub, connect(pub) as sub:
        pub.publish_many(make_batch(i) for i in range(10))
        items = drain(sub, got_seq(9))
        pub.restart()
        new = pub.publish_many(make_batch(i, tag=1) for i in range(5))
        items += drain(sub, lambda it: len(batches_of(it)) == 5)
    restarts = anomalies_of(items, "publisher_restart")
    assert len(restarts) == 1 and restarts[0].needs_reset
    # Seq 0 contradicted the applied one; the replay from seq 9 held nothing: new process.
    assert (restarts[0].first_seq, restarts[0].last_seq) == (None, 9)
    after = batches_of(items[items.index(restarts[0]) :])
    assert [(b.seq, b.payload) for b in after] == new


def test_restart_with_missed_start_replays_the_new_stream_start():
    with FaultyPublisher() as pub, connect(pub) as sub:
        pub.publish_many(make_batch(i) for i in range(10))
        items = drain(sub, got_seq(9))
        pub.restart()
        new = pub.publish_many((make_batch(i, tag=1) for i in range(6)), skip={0, 1})
        items += drain(sub, lambda it: len(batches_of(it)) == 6)
    restart = anomalies_of(items, "publisher_restart")
    assert [(a.first_seq, a.last_seq) for a in restart] == [(None, 9)]
    after = batches_of(items[items.index(restart[0]) :])
    assert [(b.seq, b.payload) for b in after] == new
    assert [b.replayed for b in after[:2]] == [True, True]
    assert pub.requests == [0, 9, 0]  # catch-up, identity check, resync


def test_replay_buffer_too_small_reports_unrecoverable_loss():
    with FaultyPublisher(buffer_steps=3) as pub, connect(pub) as sub:
        sent = pub.publish_many((make_batch(i) for i in range(9)), skip=range(2, 8))
        items = drain(sub, got_seq(8))
    losses = anomalies_of(items, "unrecoverable_loss")
    assert [(a.first_seq, a.last_seq) for a in losses] == [(2, 5)]
    assert losses[0].needs_reset and losses[0].seq_count == 4
    got = batches_of(items)
    assert [(b.seq, b.payload) for b in got] == [sent[i] for i in (0, 1, 6, 7, 8)]
    # The loss is reported before anything after it is applied.
    assert items.index(losses[0]) < items.index(got[2])
    assert sub.stats.lost_batches == 4


def test_late_joiner_catches_up_before_any_new_traffic():
    with FaultyPublisher(buffer_steps=8) as pub:
        early = pub.publish_many(make_batch(i) for i in range(20))  # nobody listening
        with Subscriber(pub.endpoint, replay_endpoints=[pub.replay_endpoint]) as sub:
            items = drain(sub, got_seq(19))
    # Only the last 8 were still buffered: the rest is reported, never silently skipped.
    assert summarize(items) == ["history_missed(0..11)"] + [f"B{i}r" for i in range(12, 20)]
    assert [b.payload for b in batches_of(items)] == [p for _, p in early[12:]]
    assert pub.requests == [0] and sub.stats.replays["catch_up"] == 1


def test_late_joiner_without_catch_up_follows_from_first_seen_and_says_so():
    with FaultyPublisher() as pub:
        pub.publish_many(make_batch(i) for i in range(5))
        with connect(pub, catch_up=False) as sub:
            pub.publish_many(make_batch(i) for i in range(5, 8))
            items = drain(sub, got_seq(7))
    assert summarize(items) == ["history_missed(0..4)", "B5", "B6", "B7"]
    assert pub.requests == []
    assert sub.stats.missed_batches == 5


def test_late_joiner_catches_up_by_default():
    with FaultyPublisher() as pub:
        sent = pub.publish_many(make_batch(i) for i in range(5))
        with connect(pub) as sub:
            sent += pub.publish_many(make_batch(i) for i in range(5, 8))
            items = drain(sub, got_seq(7))
    assert [(b.seq, b.payload) for b in batches_of(items)] == sent
    assert anomalies_of(items) == []


def test_dead_replay_endpoint_never_stalls_the_live_stream():
    with (
        FaultyPublisher(dead_replay=True) as dead,
        FaultyPublisher(topic=b"kv@other") as healthy,
        Subscriber(
            [dead.endpoint, healthy.endpoint],
            topic=b"kv",
            replay_endpoints=[dead.replay_endpoint, healthy.replay_endpoint],
            options=SubscriberOptions(replay_timeout_s=1.5, replay_cooldown_s=60, catch_up=False),
        ) as sub,
    ):
        dead.wait_for_subscribers()
        healthy.wait_for_subscribers()
        dead.publish_many((make_batch(i) for i in range(6)), skip={2})
        items = drain(sub, lambda it: len(dead.requests) == 1)
        # The other publisher keeps flowing while the dead endpoint is being waited on.
        healthy.publish_many(make_batch(i) for i in range(5))
        t0 = time.monotonic()
        items += drain(sub, got_seq(4, healthy.source))
        assert anomalies_of(items, "replay_timeout") == []
        assert time.monotonic() - t0 < 1.5
        items += drain(sub, got_seq(5, dead.source))
        # A second gap inside the cooldown is reported lost at once, no new request.
        dead.publish_many((make_batch(i) for i in range(6, 10)), skip={7})
        items += drain(sub, got_seq(9, dead.source))
    timeouts = anomalies_of(items, "replay_timeout")
    assert len(timeouts) == 1 and timeouts[0].source == dead.source
    losses = anomalies_of(items, "unrecoverable_loss")
    assert [(a.first_seq, a.last_seq) for a in losses] == [(2, 2), (7, 7)]
    assert [b.seq for b in batches_of(items) if b.source == dead.source] == [
        0,
        1,
        3,
        4,
        5,
        6,
        8,
        9,
    ]
    assert dead.requests == [1]  # from the last applied seq
    assert sub.stats.replays["timed_out"] == 1 and sub.stats.replays["cooldown"] == 1


def test_a_long_replay_that_keeps_arriving_is_not_timed_out():
    """replay_timeout bounds a replay that makes no progress, not a long one that does:
    an application slower than the replay must not lose batches that are already
    sitting in the replay socket."""
    n = 30
    with FaultyPublisher() as pub, connect(pub, replay_timeout_s=0.3, receive_batch=1) as sub:
        sent = pub.publish_many((make_batch(i) for i in range(n + 1)), skip=range(1, n))
        items: list[object] = []
        deadline = time.monotonic() + 20
        while not got_seq(n)(items):
            assert time.monotonic() < deadline, summarize(items)
            item = sub.receive(0.5)
            if item is None:
                continue
            items.append(item)
            if isinstance(item, ReceivedBatch) and item.replayed:
                time.sleep(0.03)  # the application's own work on each batch
    assert [(b.seq, b.payload) for b in batches_of(items)] == sent, summarize(items)
    assert anomalies_of(items, "replay_timeout") == []
    assert anomalies_of(items, "unrecoverable_loss") == []


def test_without_replay_endpoint_a_gap_is_reported_lost():
    with FaultyPublisher(replay=False) as pub, Subscriber(pub.endpoint) as sub:
        pub.wait_for_subscribers()
        pub.publish_many((make_batch(i) for i in range(5)), skip={1, 2})
        items = drain(sub, got_seq(4))
    assert summarize(items) == ["B0", "gap(1..2)", "unrecoverable_loss(1..2)", "B3", "B4"]
    assert sub.stats.replays["requested"] == 0


def test_replays_are_bounded_in_concurrency():
    with (
        FaultyPublisher(hold_replay=True) as a,
        FaultyPublisher(hold_replay=True) as b,
        Subscriber(
            [a.endpoint, b.endpoint],
            replay_endpoints=[a.replay_endpoint, b.replay_endpoint],
            options=SubscriberOptions(max_concurrent_replays=1, replay_timeout_s=20),
        ) as sub,
    ):
        a.wait_for_subscribers()
        b.wait_for_subscribers()
        sent_a = a.publish_many((make_batch(i) for i in range(4)), skip={1})
        sent_b = b.publish_many((make_batch(i) for i in range(4)), skip={1})
        items = drain(sub, lambda it: len(a.requests) + len(b.requests) == 1 and len(it) >= 4)
        deadline = time.monotonic() + 0.3  # give a second request every chance to leak out
        while time.monotonic() < deadline:
            item = sub.receive(0.05)
            if item is not None:
                items.append(item)
        assert len(a.requests) + len(b.requests) == 1
        first, second = (a, b) if a.requests else (b, a)
        first.release.set()
        items += drain(sub, lambda it: len(second.requests) == 1)
        second.release.set()
        items += drain(
            sub,
            lambda it: sum(isinstance(i, ReceivedBatch) and i.seq == 3 for i in items + it) == 2,
        )
    for pub, sent in ((a, sent_a), (b, sent_b)):
        got = [x for x in batches_of(items) if x.source == pub.source]
        assert [(x.seq, x.payload) for x in got] == sent


def test_bad_frames_and_undecodable_payloads_are_counted_and_skipped():
    with FaultyPublisher(replay=False) as pub, Subscriber(pub.endpoint) as sub:
        pub.wait_for_subscribers()
        pub.publish(make_batch(0))
        pub.send_frames([b"kv@test", b"\x00" * 8])  # two frames
        pub.send_frames([b"kv@test", b"\x00\x01", encode_batch(make_batch(1))])  # short seq
        pub.publish_raw(b"\xc1 not msgpack")  # seq 1, undecodable
        pub.publish(make_batch(2))
        items = drain(sub, got_seq(2))
    assert summarize(items) == [
        "B0",
        "bad_frame(None..None)",
        "bad_frame(None..None)",
        "undecodable(1..1)",
        "gap(1..1)",
        "unrecoverable_loss(1..1)",
        "B2",
    ]
    assert sub.stats.dropped["bad_frame"] == 2 and sub.stats.dropped["undecodable"] == 1
    assert {a.kind for a in anomalies_of(items)} <= ANOMALY_KINDS


def test_undecodable_payload_with_replay_is_reported_as_loss_once_replay_confirms():
    with FaultyPublisher() as pub, connect(pub, catch_up=False) as sub:
        pub.publish(make_batch(0))
        pub.publish_raw(b"\xc1")
        pub.publish(make_batch(2))
        items = drain(sub, got_seq(2))
    assert [a.kind for a in anomalies_of(items)] == [
        "undecodable",
        "gap",
        "undecodable",
        "unrecoverable_loss",
    ]
    assert [b.seq for b in batches_of(items)] == [0, 2]


def test_ranks_on_one_endpoint_are_tracked_separately():
    with FaultyPublisher(replay=False) as pub, Subscriber(pub.endpoint) as sub:
        pub.wait_for_subscribers()
        for i in range(5):
            for rank in (0, 1):
                pub.send_frames(pack_live(b"kv@test", i, encode_batch(make_batch(i, rank=rank))))
        items = drain(sub, lambda it: len(it) == 10)
    assert anomalies_of(items) == []
    for rank in (0, 1):
        assert [b.seq for b in batches_of(items) if b.dp_rank == rank] == list(range(5))


def test_rank_none_on_the_wire_reads_as_rank_zero():
    with FaultyPublisher(replay=False) as pub, Subscriber(pub.endpoint) as sub:
        pub.wait_for_subscribers()
        pub.publish(make_batch(0, rank=None))
        (item,) = drain(sub, lambda it: len(it) == 1)
    assert isinstance(item, ReceivedBatch) and item.dp_rank == 0 and item.worker == (pub.source, 0)


def test_publisher_process_replaced_on_same_endpoint_is_followed():
    first = FaultyPublisher()
    path, rpath = first.endpoint, first.replay_endpoint
    assert rpath is not None
    sub = Subscriber(path, replay_endpoints=[rpath])
    try:
        first.wait_for_subscribers()
        first.publish_many(make_batch(i) for i in range(8))
        items = drain(sub, got_seq(7))
        first.close()
        # A new process binds the same endpoints; ZMQ reconnects on its own.
        with FaultyPublisher(endpoint=path, replay_endpoint=rpath) as second:
            stray: list[object] = []
            second.wait_for_subscribers(pump=lambda: stray.append(sub.receive(0.01)))
            # The reconnect alone is checked: the new ring holds nothing from seq 7 on.
            items += [x for x in stray if x is not None]
            items += drain(sub, lambda it: anomalies_of(items + it, "publisher_restart"))
            assert batches_of(items)[-1].seq == 7
            new = second.publish_many(make_batch(i, tag=2) for i in range(4))
            items += drain(sub, lambda it: len(batches_of(it)) == 4)
    finally:
        sub.close()
    assert sub.stats.connections["disconnected"] >= 1
    (restart,) = anomalies_of(items, "publisher_restart")
    assert (restart.first_seq, restart.last_seq) == (None, 7)
    after = batches_of(items[items.index(restart) :])
    assert [(b.seq, b.payload) for b in after] == new


def test_receive_timeout_returns_none_and_close_is_idempotent():
    with FaultyPublisher() as pub:
        sub = connect(pub)
        t0 = time.monotonic()
        assert sub.receive(0.05) is None
        assert 0.04 <= time.monotonic() - t0 < 1.0
        sub.close()
        sub.close()
        assert sub.receive(0.01) is None
        assert list(sub) == []


def test_configuration_errors_are_clear():
    with pytest.raises(ConfigError, match="not a ZMQ endpoint"):
        Subscriber("localhost:5557")
    with pytest.raises(ConfigError, match="replay_endpoints has 1 entries for 2"):
        Subscriber(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], replay_endpoints=["tcp://x:1"])
    with pytest.raises(ConfigError, match="at least one"):
        Subscriber([])
    with pytest.raises(ConfigError, match="replay_timeout"):
        Subscriber("tcp://127.0.0.1:1", options=SubscriberOptions(replay_timeout_s=0))


def test_an_unknown_option_name_is_a_type_error():
    """Only the unit-suffixed names exist: a unit-less or misspelt one is refused at once."""
    for name in ("replay_timout", "replay_timeout", "max_message_size", "replay_from_start"):
        with pytest.raises(TypeError, match=name):
            SubscriberOptions(**{name: 1})
    with pytest.raises(TypeError, match="max_message_size"):
        ZmqSource("tcp://127.0.0.1:1", max_message_size=0)  # type: ignore[call-arg]


def test_the_settings_are_declared_once_in_subscriber_options():
    """Every setting is a field of ``SubscriberOptions`` with its own docstring; the
    subscribers' signatures name ``options`` and the objects they use, all typed, with
    no catch-all keyword arguments, and they are the same signature."""
    import ast
    import dataclasses
    import inspect

    from kvevents.consumers import AsyncSubscriber
    from kvevents.consumers.subscriber import SubscriberCore, options

    tree = ast.parse(inspect.getsource(options))
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SubscriberOptions"
    )
    documented = {
        field.target.id
        for field, after in zip(cls.body, cls.body[1:])
        if isinstance(field, ast.AnnAssign)
        and isinstance(field.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }
    assert documented == {f.name for f in dataclasses.fields(SubscriberOptions)}
    signatures = [
        inspect.signature(cls.__init__) for cls in (SubscriberCore, Subscriber, AsyncSubscriber)
    ]
    assert signatures[0] == signatures[1] == signatures[2]
    params = list(signatures[0].parameters.values())[1:]
    assert [p.name for p in params] == [
        "endpoints",
        "topic",
        "replay_endpoints",
        "options",
        "decoder",
        "context",
        "curve",
    ]
    assert all(p.kind is not p.VAR_KEYWORD and p.annotation is not p.empty for p in params)
    assert not {p.name for p in params} & {f.name for f in dataclasses.fields(SubscriberOptions)}


def test_source_objects_and_topic_filtering():
    ctx = zmq.Context.instance()
    with FaultyPublisher(topic=b"other") as other, FaultyPublisher() as pub:
        src = ZmqSource(pub.endpoint, b"kv@", pub.replay_endpoint, name="engine-a", context=ctx)
        with Subscriber([src, ZmqSource(other.endpoint, b"kv@", name="b")]) as sub:
            pub.wait_for_subscribers()
            other.wait_for_subscribers()
            other.publish_many(make_batch(i) for i in range(3))
            pub.publish_many((make_batch(i) for i in range(3)), skip={1})
            items = drain(sub, got_seq(2))
    assert [(b.source, b.seq) for b in batches_of(items)] == [
        ("engine-a#kv@test", i) for i in range(3)
    ]
    assert decode_batch(batches_of(items)[1].payload) == make_batch(1)


def test_received_batch_builds_the_same_frozen_value_as_the_dataclass() -> None:
    import dataclasses

    from kvevents.consumers.subscriber.items import ReceivedBatch, received_batch
    from kvevents.events import KVEventBatch

    args = ("tcp://h:1", 2, 7, KVEventBatch(1.0, []), True, b"t", b"payload", 3.5)
    fast, slow = received_batch(*args), ReceivedBatch(*args)
    assert type(fast) is ReceivedBatch
    assert fast == slow and repr(fast) == repr(slow)
    assert dataclasses.astuple(fast) == args
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.seq = 8  # type: ignore[misc]
