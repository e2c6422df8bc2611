"""ZmqEventPublisher behaviour: never blocking, drops, shutdown, threads, topics, replay
clients that misbehave.  Real sockets throughout."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from pubtest_helpers import (
    dealer,
    read_replay,
    recv,
    removed_batch,
    subscribe,
    wait_until,
    warm_up,
)

from kvevents.codec import decode_batch, pack_seq, unpack_seq
from kvevents.errors import PublisherClosedError
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.publishers import ZmqEventPublisher, is_bind_endpoint


@pytest.fixture
def ctx() -> zmq.Context[Any]:
    return zmq.Context.instance()


# --- back-pressure ---------------------------------------------------------------------


def test_full_queue_drops_and_counts_without_blocking(
    ctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvevents.publishers.zmq_publisher")
    pub = ZmqEventPublisher(endpoint="tcp://*:0", max_queue_size=1)
    sub = subscribe(ctx, pub.endpoint)
    try:
        n = warm_up(pub, sub)
        dropped_before = pub.stats.dropped_batches  # probes the warm-up lost, if any
        pub._pause_sender()  # the sender is stalled: nothing leaves the queue
        two_events = [BlockRemoved([1], "GPU"), BlockRemoved([2], "GPU")]
        durations = []
        for i in range(1000):
            t0 = time.perf_counter()
            pub.publish(KVEventBatch(float(i), list(two_events)))
            durations.append(time.perf_counter() - t0)
        # vLLM would block forever on the second call; every call here returned.
        assert max(durations) < 0.25
        assert sorted(durations)[500] < 0.001
        # The first call fills the one-slot queue; the other 999 are dropped.
        assert pub.stats.dropped_batches - dropped_before == 999
        assert pub.stats.drop_reasons == {"queue_full": 999 + dropped_before}
        assert pub.stats.dropped_events == 1998 + dropped_before
        warnings = [r for r in caplog.records if "queue full" in r.getMessage()]
        assert 1 <= len(warnings) <= 2  # rate-limited, not one per drop
        pub._resume_sender()
        wait_until(lambda: pub.queue_size == 0, what="queued batch taken")
        pub.publish(removed_batch(7))
        seqs = [unpack_seq(recv(sub)[1]) for _ in range(2)]
        # The queued batch (seq n) goes out, then the next accepted one: a visible gap.
        assert seqs == [n, n + 1000]
    finally:
        pub._resume_sender()
        sub.close()
        pub.shutdown()


def test_shutdown_on_a_full_queue_with_a_stalled_sender_returns(ctx: zmq.Context[Any]) -> None:
    pub = ZmqEventPublisher(endpoint="tcp://*:0", max_queue_size=1)
    pub._pause_sender()
    for i in range(5):
        pub.publish(removed_batch(i))
    t0 = time.monotonic()
    pub.shutdown(timeout_s=0.2)  # must not raise although the queue is full
    assert time.monotonic() - t0 < 2.0
    assert pub.closed
    with pytest.raises(PublisherClosedError, match="after shutdown"):
        pub.publish(removed_batch(9))
    pub._resume_sender()
    # The thread wakes up past its deadline: the queued batch is counted, sockets closed.
    wait_until(lambda: not pub._thread.is_alive(), what="sender thread exit")
    assert pub.stats.drop_reasons == {"queue_full": 4, "shutdown": 1}
    assert pub.stats.batches_published == 0
    pub.shutdown()  # idempotent


def test_shutdown_flushes_queued_batches(ctx: zmq.Context[Any]) -> None:
    pub = ZmqEventPublisher(endpoint="tcp://*:0")
    sub = subscribe(ctx, pub.endpoint)
    n = warm_up(pub, sub)
    for i in range(200):
        pub.publish(removed_batch(i))
    pub.shutdown(timeout_s=10.0)  # returns as soon as all is written
    assert pub.stats.batches_published == n + 200
    assert pub.stats.dropped_batches == 0
    seqs = [unpack_seq(recv(sub)[1]) for _ in range(200)]
    assert seqs == list(range(n, n + 200))
    sub.close()


def test_publish_rejects_a_non_batch_without_using_a_seq(ctx: zmq.Context[Any]) -> None:
    with ZmqEventPublisher(endpoint=f"inproc://kv-type-{uuid.uuid4().hex}") as pub:
        sub = subscribe(ctx, pub.endpoint)
        with pytest.raises(TypeError, match="got list"):
            pub.publish([BlockRemoved([1], "GPU")])  # type: ignore[arg-type]
        pub.publish(removed_batch(0))
        assert recv(sub)[1] == pack_seq(0)
        sub.close()


def test_publish_after_shutdown_raises_and_shutdown_is_idempotent() -> None:
    pub = ZmqEventPublisher(endpoint="tcp://*:0")
    pub.shutdown()
    pub.shutdown()
    with pytest.raises(PublisherClosedError) as info:
        pub.publish(removed_batch(0))
    assert isinstance(info.value, RuntimeError)
    assert "shutdown" in str(info.value)
    assert not pub._thread.is_alive()


# --- ordering, threads -----------------------------------------------------------------


def test_batches_from_several_threads_arrive_with_strictly_increasing_seq(
    ctx: zmq.Context[Any],
) -> None:
    pub = ZmqEventPublisher(endpoint="tcp://*:0")
    sub = subscribe(ctx, pub.endpoint)
    n = warm_up(pub, sub)
    threads, per_thread = 4, 250
    start = threading.Barrier(threads)

    def worker(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            pub.publish(
                KVEventBatch(0.0, [BlockStored([t * 10_000 + i], None, [], 0, None, "GPU", None)])
            )

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    received = [recv(sub) for _ in range(threads * per_thread)]
    seqs = [unpack_seq(f[1]) for f in received]
    assert seqs == list(range(n, n + threads * per_thread))
    by_thread: dict[int, list[int]] = {}
    for f in received:
        h = decode_batch(f[2]).events[0].block_hashes[0]
        by_thread.setdefault(h // 10_000, []).append(h % 10_000)
    assert by_thread == {t: list(range(per_thread)) for t in range(threads)}
    assert pub.stats.dropped_batches == 0
    sub.close()
    pub.shutdown()


def test_publisher_sets_the_rank_on_each_batch(ctx: zmq.Context[Any]) -> None:
    endpoint = f"inproc://kv-rank-{uuid.uuid4().hex}"
    with ZmqEventPublisher(data_parallel_rank=2, endpoint=endpoint) as pub:
        assert pub.endpoint == endpoint + "_dp2"
        sub = subscribe(ctx, pub.endpoint)
        batch = removed_batch(1)
        pub.publish(batch)
        assert decode_batch(recv(sub)[2]).data_parallel_rank == 2
        sub.close()


def test_publisher_keeps_a_rank_the_caller_already_set(ctx: zmq.Context[Any]) -> None:
    # C§1.2: vLLM's publish() fills the rank only when the batch has none.
    endpoint = f"inproc://kv-rank-kept-{uuid.uuid4().hex}"
    with ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint) as pub:
        sub = subscribe(ctx, pub.endpoint)
        pub.publish(KVEventBatch(1.0, [BlockRemoved([1], "GPU")], data_parallel_rank=3))
        pub.publish(removed_batch(2))
        assert decode_batch(recv(sub)[2]).data_parallel_rank == 3
        assert decode_batch(recv(sub)[2]).data_parallel_rank == 0
        sub.close()


# --- topics ----------------------------------------------------------------------------


def test_topic_is_the_first_frame_and_subscribers_filter_on_its_prefix(
    ctx: zmq.Context[Any],
) -> None:
    # inproc: subscriptions made before the first send are always seen, so "nothing
    # arrived" below is a real negative, not a slow joiner.
    name = uuid.uuid4().hex
    foo = ZmqEventPublisher(endpoint=f"inproc://foo-{name}", topic="foo")
    bar = ZmqEventPublisher(endpoint=f"inproc://bar-{name}", topic="bar")
    only_foo = subscribe(ctx, foo.endpoint, b"fo")
    only_foo.connect(bar.endpoint)
    everything = subscribe(ctx, bar.endpoint, b"")
    for i in range(3):
        bar.publish(removed_batch(i))
        foo.publish(removed_batch(i))
    wait_until(lambda: foo.stats.batches_published == 3 and bar.stats.batches_published == 3)
    got = [recv(only_foo) for _ in range(3)]
    assert [f[0] for f in got] == [b"foo"] * 3
    assert [recv(everything)[0] for _ in range(3)] == [b"bar"] * 3
    with pytest.raises(zmq.Again):
        only_foo.recv_multipart(zmq.NOBLOCK)
    for s in (only_foo, everything):
        s.close()
    foo.shutdown()
    bar.shutdown()


def test_default_topic_is_an_empty_frame(ctx: zmq.Context[Any]) -> None:
    with ZmqEventPublisher(endpoint=f"inproc://kv-empty-{uuid.uuid4().hex}") as pub:
        sub = subscribe(ctx, pub.endpoint)
        pub.publish(removed_batch(0))
        assert recv(sub)[:2] == [b"", pack_seq(0)]
        sub.close()


# --- failures on the sender thread -----------------------------------------------------


def test_unencodable_batch_consumes_its_seq_and_is_counted(ctx: zmq.Context[Any]) -> None:
    with ZmqEventPublisher(endpoint="tcp://*:0", replay_endpoint="tcp://*:0") as pub:
        sub = subscribe(ctx, pub.endpoint)
        n = warm_up(pub, sub)
        pub.publish(KVEventBatch(0.0, [object()]))  # msgpack cannot carry it
        pub.publish(removed_batch(1))
        assert unpack_seq(recv(sub)[1]) == n + 1  # seq n was consumed by the failure
        assert pub.stats.encode_errors == 1
        assert pub.stats.drop_reasons == {"encode_error": 1}
        client = dealer(ctx, pub.replay_endpoint)
        client.send_multipart([b"", pack_seq(n)])
        assert [unpack_seq(r[2]) for r in read_replay(client)[:-1]] == [n + 1]
        client.close()
        sub.close()


# --- replay clients that misbehave -----------------------------------------------------


def test_stalled_replay_client_blocks_neither_live_nor_other_clients(
    ctx: zmq.Context[Any],
) -> None:
    payload_hashes = [2**63 + i for i in range(200)]  # ~1.9 KB per batch
    pub = ZmqEventPublisher(
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        buffer_steps=200,
        replay_stall_timeout_s=0.3,
    )
    sub = subscribe(ctx, pub.endpoint)
    n = warm_up(pub, sub)
    for i in range(200):
        pub.publish(KVEventBatch(float(i), [BlockRemoved(payload_hashes, "GPU")]))
    wait_until(lambda: pub.stats.batches_published == n + 200)
    for _ in range(200):
        recv(sub)
    # A client that asks for many replays and reads nothing, with tiny buffers: its
    # pipe fills (ROUTER SNDHWM is replay_sndhwm) and the replay stalls.
    stuck = dealer(ctx, pub.replay_endpoint, RCVHWM=1, RCVBUF=4096)
    for _ in range(30):
        stuck.send_multipart([b"", pack_seq(0)])
    wait_until(lambda: pub.stats.replay_requests == 30, what="requests accepted")
    # Live publishing goes on while that replay is stuck...
    for i in range(50):
        pub.publish(removed_batch(i))
    assert [unpack_seq(recv(sub)[1]) for _ in range(50)] == list(range(n + 200, n + 250))
    # ...and another client still gets its whole replay.
    healthy = dealer(ctx, pub.replay_endpoint)
    healthy.send_multipart([b"", pack_seq(n + 240)])
    assert [unpack_seq(r[2]) for r in read_replay(healthy)[:-1]] == list(range(n + 240, n + 250))
    # The stuck client is abandoned after the stall timeout, and that is counted.
    wait_until(lambda: pub.stats.replay_drop_reasons["client_stalled"] > 0, what="abandon")
    # All of its pending replays are dropped together, and the accounting adds up:
    # every reply of the 30 replays (200 batches + end marker) was sent or dropped.
    wait_until(lambda: pub._pending == 0, what="replays settled")
    sent = pub.stats.replay_batches_sent - 10 + pub.stats.replays_completed - 1
    assert sent + pub.stats.replay_batches_dropped == 30 * 201
    for s in (stuck, healthy, sub):
        s.close()
    # A generous budget: this test is about the stall, not the shutdown budget (on a
    # loaded machine ZeroMQ's confirmations of the last live batches can lag 1 s).
    pub.shutdown(timeout_s=10.0)
    assert pub.stats.dropped_batches == 0


def test_too_many_pending_replays_are_refused_and_counted(ctx: zmq.Context[Any]) -> None:
    with ZmqEventPublisher(
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        buffer_steps=200,
        max_pending_replays=2,
        replay_stall_timeout_s=30,
    ) as pub:
        for i in range(200):
            pub.publish(KVEventBatch(float(i), [BlockRemoved([2**63 + i] * 200, "GPU")]))
        wait_until(lambda: pub.stats.batches_published == 200)
        stuck = dealer(ctx, pub.replay_endpoint, RCVHWM=1, RCVBUF=4096)
        for _ in range(30):
            stuck.send_multipart([b"", pack_seq(0)])
        wait_until(lambda: pub.stats.replay_requests == 30)
        wait_until(lambda: pub.stats.replay_requests_refused > 0, what="refusal")
        stuck.close()


# --- transports and sockets ------------------------------------------------------------


def test_ipc_endpoint_binds_and_publishes(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    with ZmqEventPublisher(endpoint=f"ipc://{path}") as pub:
        assert pub.binds
        assert pub.endpoint == f"ipc://{path}"
        sub = subscribe(ctx, pub.endpoint)
        n = warm_up(pub, sub)
        pub.publish(removed_batch(5))
        frames = recv(sub)
        assert unpack_seq(frames[1]) == n
        assert msgspec.msgpack.decode(frames[2])[1][0]["block_hashes"] == [5]
        sub.close()


def test_port_zero_resolves_to_the_real_port() -> None:
    with ZmqEventPublisher(endpoint="tcp://*:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        port = int(pub.endpoint.rsplit(":", 1)[1])
        replay_port = int((pub.replay_endpoint or "").rsplit(":", 1)[1])
        assert port > 0 and replay_port > 0
        assert pub.replay_endpoint.startswith("tcp://127.0.0.1:")  # type: ignore[union-attr]


def test_connect_endpoint_reaches_a_bound_subscriber(ctx: zmq.Context[Any]) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:0")
    addr = sub.getsockopt(zmq.LAST_ENDPOINT).decode()
    with ZmqEventPublisher(endpoint=addr) as pub:
        assert not pub.binds
        warm_up(pub, sub)
    sub.close()


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://router-host:5557", False),
    ],
)
def test_bind_or_connect_rule(endpoint: str, binds: bool) -> None:
    assert is_bind_endpoint(endpoint) is binds
