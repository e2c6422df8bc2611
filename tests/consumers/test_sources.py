"""Sources: capture files read through the same Subscriber API as live endpoints."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _zmq_helpers import FaultyPublisher, drain, make_batch, summarize

from kvevents.capture import CaptureWriter
from kvevents.codec import encode_batch
from kvevents.consumers import (
    Anomaly,
    CaptureSource,
    ReceivedBatch,
    Source,
    Subscriber,
    SubscriberOptions,
    ZmqSource,
)
from kvevents.errors import CaptureError, ConfigError

pytestmark = pytest.mark.timeout(30)


def view(items: list[object]) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for i in items:
        if isinstance(i, ReceivedBatch):
            out.append(("B", i.source, i.dp_rank, i.seq, i.replayed, i.topic, i.payload))
        elif isinstance(i, Anomaly):
            out.append((i.kind, i.source, i.first_seq, i.last_seq))
    return out


def test_sources_satisfy_the_protocol(tmp_path):
    path = tmp_path / "empty.kvcap"
    CaptureWriter(path).close()
    cap = CaptureSource(str(path))
    zs = ZmqSource("tcp://127.0.0.1:1")
    try:
        assert isinstance(cap, Source) and isinstance(zs, Source)
        assert cap.replay_inband and not cap.can_replay
        assert not zs.can_replay and zs.name == "tcp://127.0.0.1:1"
        with pytest.raises(ConfigError):
            zs.request_replay(0)
    finally:
        cap.close()
        zs.close()


def test_recorded_session_reads_back_as_the_same_stream(tmp_path):
    """Record what a live subscriber yields (gap repaired by replay, a loss), then read
    the capture through a Subscriber: same batches, same flags, the loss reported again."""
    path = tmp_path / "session.kvcap"
    with (
        FaultyPublisher(buffer_steps=4) as pub,
        Subscriber(pub.endpoint, replay_endpoints=[pub.replay_endpoint]) as sub,
    ):
        pub.wait_for_subscribers()
        pub.publish_many((make_batch(i) for i in range(6)), skip={2})
        live = drain(sub, lambda it: any(getattr(x, "seq", -1) == 5 for x in it))
        pub.publish_many((make_batch(i) for i in range(6, 14)), skip=range(6, 11))
        live += drain(sub, lambda it: any(getattr(x, "seq", -1) == 13 for x in it))
    assert "unrecoverable_loss(6..9)" in summarize(live)
    with CaptureWriter(tmp_path / "session.kvcap") as w:
        for it in live:
            if isinstance(it, ReceivedBatch):
                w.write(
                    it.source,
                    it.topic,
                    it.seq,
                    it.payload,
                    recv_ts=it.recv_ts,
                    replayed=it.replayed,
                )
    with Subscriber(f"capture:{path}") as replayed_sub:
        again = list(replayed_sub)
    assert [x for x in view(again) if x[0] == "B"] == [x for x in view(live) if x[0] == "B"]
    losses = [x for x in view(again) if x[0] == "unrecoverable_loss"]
    assert losses == [("unrecoverable_loss", pub.source, 6, 9)]
    assert [b.recv_ts for b in again if isinstance(b, ReceivedBatch)] == [
        b.recv_ts for b in live if isinstance(b, ReceivedBatch)
    ]


def test_raw_frame_capture_with_interleaved_replay_is_merged(tmp_path):
    """A capture of raw frames: live 0, 1, 4, 5, then the replayed 2..5 that answered."""
    path = tmp_path / "raw.kvcap"
    payloads = {i: encode_batch(make_batch(i)) for i in range(7)}
    with CaptureWriter(path) as w:
        for i in (0, 1, 4, 5):
            w.write("engine", b"t", i, payloads[i])
        for i in (2, 3, 4, 5):
            w.write("engine", b"t", i, payloads[i], replayed=True)
        w.write("engine", b"", -1, b"", replayed=True)  # the recorded end marker
        w.write("engine", b"t", 6, payloads[6])
    with Subscriber(CaptureSource(str(path))) as sub:
        items = list(sub)
    assert summarize(items) == ["B0", "B1", "gap(2..3)", "B2r", "B3r", "B4", "B5", "B6"]
    assert [i.payload for i in items if isinstance(i, ReceivedBatch)] == [
        payloads[i] for i in range(7)
    ]
    assert sub.stats.dropped["replay_overlap"] == 2


def test_a_recorded_catch_up_with_live_records_inside_it_reads_back_without_a_gap(tmp_path):
    """The recorder joined late and caught up: its catch-up's replies 0..2 were read, then
    live 10 (on the other socket), then the rest of the catch-up 3..9 and its end marker.
    Read back, that is the catch-up it was, not a gap at seq 3."""
    path = tmp_path / "late-join.kvcap"
    payloads = {i: encode_batch(make_batch(i)) for i in range(12)}
    with CaptureWriter(path) as w:
        for i in (0, 1, 2):
            w.write("engine", b"t", i, payloads[i], replayed=True)
        w.write("engine", b"t", 10, payloads[10])
        for i in range(3, 10):
            w.write("engine", b"t", i, payloads[i], replayed=True)
        w.write("engine", b"", -1, b"", replayed=True)  # the recorded end marker
        w.write("engine", b"t", 11, payloads[11])
    with Subscriber(CaptureSource(str(path))) as sub:
        items = list(sub)
    assert summarize(items) == [f"B{i}r" for i in range(10)] + ["B10", "B11"]
    assert [i.payload for i in items if isinstance(i, ReceivedBatch)] == [
        payloads[i] for i in range(12)
    ]


def test_capture_with_many_sources_and_bad_records(tmp_path):
    path = tmp_path / "multi.kvcap"
    with CaptureWriter(path) as w:
        for i in range(3):
            w.write("a", b"", i, encode_batch(make_batch(i)))
            w.write("b", b"", i, encode_batch(make_batch(i, rank=1)))
        w.write("a", b"", 3, b"\xc1garbage")
        w.write("a", b"", -1, b"not an end marker")
        w.write("a", b"", 4, encode_batch(make_batch(4)))
    with open(path, "ab") as fh:
        fh.write(b"\x00\x00\x01")  # a truncated tail
    src = CaptureSource(str(path))
    with Subscriber(src) as sub:
        items = list(sub)
    assert src.tail_error is not None and "truncated" in src.tail_error
    assert [(b.source, b.dp_rank, b.seq) for b in items if isinstance(b, ReceivedBatch)] == [
        ("a", 0, 0),
        ("b", 1, 0),
        ("a", 0, 1),
        ("b", 1, 1),
        ("a", 0, 2),
        ("b", 1, 2),
        ("a", 0, 4),
    ]
    kinds = [(a.kind, a.source) for a in items if isinstance(a, Anomaly)]
    assert kinds == [
        ("undecodable", "a"),
        ("bad_frame", "a"),
        ("gap", "a"),
        ("unrecoverable_loss", "a"),
    ]


def test_not_a_capture_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.kvcap"
    bad.write_bytes(b"hello")
    with pytest.raises(CaptureError, match="not a kvevents capture"):
        Subscriber(str(bad))


def test_ipv6_publisher_is_followed_live_and_through_replay():
    """A publisher on an IPv6 address (vLLM binds ``tcp://[::]:5557`` or a v6 host): the
    SUB and the replay DEALER must both speak IPv6, or nothing ever arrives."""
    import time

    from kvevents.events import BlockRemoved, KVEventBatch
    from kvevents.publishers import ZmqEventPublisher

    try:
        pub = ZmqEventPublisher(endpoint="tcp://[::1]:0", replay_endpoint="tcp://[::1]:0")
    except ConfigError as exc:  # pragma: no cover - host without IPv6 loopback
        pytest.skip(f"no IPv6 loopback: {exc}")
    try:
        for i in range(3):
            pub.publish(KVEventBatch(float(i), [BlockRemoved([i], "GPU")]))
        # Sent (to nobody) before the subscriber exists: only replay can supply them.
        sent_by = time.monotonic() + 10
        while pub.stats.batches_published < 3:
            assert time.monotonic() < sent_by, "publisher never sent its batches"
            time.sleep(0.001)
        with Subscriber(
            pub.endpoint,
            replay_endpoints=[pub.replay_endpoint],
            options=SubscriberOptions(catch_up=True),
        ) as sub:
            replayed: list[int] = []
            live = False
            deadline = time.monotonic() + 10
            n = 3
            while (len(replayed) < 3 or not live) and time.monotonic() < deadline:
                if len(replayed) >= 3:
                    pub.publish(KVEventBatch(float(n), [BlockRemoved([n], "GPU")]))
                    n += 1
                item = sub.receive(timeout=0.05)
                if isinstance(item, ReceivedBatch):
                    if item.replayed and item.seq < 3:
                        replayed.append(item.seq)
                    elif not item.replayed:
                        live = True
            assert replayed == [0, 1, 2], sub.stats
            assert live, "no live batch arrived over IPv6"
    finally:
        pub.shutdown()


@pytest.mark.parametrize("wildcard", ["tcp://0.0.0.0:0", "tcp://*:0"])
def test_wildcard_endpoint_binds_for_a_publisher_that_connects_out(wildcard):
    """vLLM's PUB connects when its endpoint names a host (C§2.1), e.g. to a collector
    bound on a wildcard address; a subscriber given a wildcard must bind, not connect."""
    import time

    from kvevents.events import BlockRemoved, KVEventBatch
    from kvevents.publishers import ZmqEventPublisher

    src = ZmqSource(wildcard)
    try:
        assert src.bound_endpoint is not None
        port = src.bound_endpoint.rsplit(":", 1)[1]
        with ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{port}") as pub:
            assert not pub.binds
            deadline = time.monotonic() + 10
            got = []
            n = 0
            while not got:
                assert time.monotonic() < deadline, "nothing arrived"
                pub.publish(KVEventBatch(float(n), [BlockRemoved([n], "GPU")]))
                n += 1
                if src.sockets()[0].poll(20):
                    got = [m for m in src.receive(10) if m.kind == "live"]
            assert got[0].kind == "live"
    finally:
        src.close()


def test_a_read_of_large_messages_stops_at_its_byte_budget_and_nothing_is_left_behind():
    """A read of the live socket stops after about 64 KiB of payloads (the decoded
    batches of one read are held until taken); the messages after it come with the
    next reads, in order, and a Subscriber over such a stream delivers every batch."""
    import time

    import zmq

    from kvevents.codec import pack_live
    from kvevents.consumers.source_protocol import LIVE
    from kvevents.events import BlockStored, KVEventBatch

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    # about 40 KiB each: two of them pass the 64 KiB budget
    batches = [
        KVEventBatch(
            float(i),
            [BlockStored([i], None, list(range(100_000, 100_000 + 8_000)), 16, None, "GPU", None)],
        )
        for i in range(12)
    ]
    payloads = [encode_batch(b) for b in batches]
    assert all(40_000 < len(p) < 50_000 for p in payloads)
    src = ZmqSource(endpoint)
    try:
        assert pub.poll(5000), "no subscription"
        pub.recv()
        for seq, p in enumerate(payloads):
            pub.send_multipart(pack_live(b"kv", seq, p))
        got: list[int] = []
        end = time.monotonic() + 10
        while len(got) < len(payloads) and time.monotonic() < end:
            zmq.select(list(src.sockets()), [], [], 0.5)
            msgs = [m for m in src.receive(256) if m.kind == LIVE]
            assert len(msgs) <= 2
            got += [m.seq for m in msgs]
        assert got == list(range(len(payloads)))
    finally:
        src.close()
        pub.close(0)

    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        with Subscriber(
            f"tcp://127.0.0.1:{port}", options=SubscriberOptions(rcvhwm=0, catch_up=False)
        ) as sub:
            assert pub.poll(5000), "no subscription"
            pub.recv()
            for seq, p in enumerate(payloads):
                pub.send_multipart(pack_live(b"kv", seq, p))
            items = drain(sub, lambda xs: sum(isinstance(x, ReceivedBatch) for x in xs) == 12)
            assert [x.batch for x in items if isinstance(x, ReceivedBatch)] == batches
    finally:
        pub.close(0)


def test_a_replay_dealer_whose_curve_keys_fail_is_closed(tmp_path):
    """The CURVE key files are read when a replay DEALER opens; when that fails (a key
    rotated away since the source opened) the request raises a clear error and the
    DEALER does not outlive it: the source's context can still terminate."""
    import threading

    import zmq
    import zmq.auth

    from kvevents.security import CurveClientConfig

    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    _, server_secret = zmq.auth.create_certificates(str(tmp_path), "server")
    _, client_secret = zmq.auth.create_certificates(str(tmp_path), "client")
    curve = CurveClientConfig(client_secret, server_secret)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    src = ZmqSource(
        "tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:2", context=ctx, curve=curve
    )
    os.remove(client_secret)
    with pytest.raises(ConfigError, match="secret key file") as raised:
        src.request_replay(0)
    src.close()
    # (the error is kept, as a caller that logs or stores it would: whatever its frames
    # still reference must be closed already, not left to the garbage collector)
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    assert done.wait(10), "a socket of the source was left open: the context cannot end"
    assert raised.value is not None
