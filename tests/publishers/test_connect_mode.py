"""Connect mode (the engine connects out to a bound collector): no head loss.

A PUB socket sends only to peers whose subscription it has received, so what an engine
published before its connection to the collector was up used to vanish (2 batches in 23
of 25 runs).  The publisher now holds those batches, bounded and counted, and sends them
once the first subscription arrives.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from pubtest_helpers import recv, removed_batch, wait_until

from kvevents.codec import unpack_seq
from kvevents.publishers import ZmqEventPublisher
from kvevents.publishers.head_hold import HeadHold


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def collector(ctx: zmq.Context[Any], port: int | None = None) -> tuple[zmq.Socket[Any], int]:
    """A bound SUB, as a central collector is (a random port unless ``port``)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if port is None:
        port = sub.bind_to_random_port("tcp://127.0.0.1")
    else:
        sub.bind(f"tcp://127.0.0.1:{port}")
    return sub, port


def quiet_port() -> int:
    """A free port below the ephemeral range: a socket reconnecting to an ephemeral port
    nobody listens on can end up connected to itself (TCP self-connect) and take it."""
    for _ in range(200):
        port = random.randrange(20_000, 32_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError("no free port")


def received_seqs(sub: zmq.Socket[Any], n: int) -> list[int]:
    return [unpack_seq(recv(sub)[1]) for _ in range(n)]


def test_batches_published_right_after_start_reach_a_bound_collector_25_of_25(
    ctx: zmq.Context[Any],
) -> None:
    lost_runs = 0
    for _ in range(25):
        sub, port = collector(ctx)
        pub = ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{port}")  # connects (vLLM's rule)
        try:
            assert not pub.binds
            for i in range(5):
                pub.publish(removed_batch(i))
            seqs = []
            while len(seqs) < 5 and sub.poll(5000):
                seqs.append(unpack_seq(sub.recv_multipart()[1]))
            lost_runs += seqs != [0, 1, 2, 3, 4]
        finally:
            pub.shutdown()
            sub.close()
    assert lost_runs == 0


def test_a_collector_that_binds_late_gets_the_held_head_then_live_in_order(
    ctx: zmq.Context[Any],
) -> None:
    port = quiet_port()  # nobody listens on it, for now
    with ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{port}") as pub:
        for i in range(5):
            pub.publish(removed_batch(i))
        wait_until(lambda: pub.stats.head_batches_held == 5, what="the head held")
        assert pub.stats.batches_published == 0
        sub, _ = collector(ctx, port)
        assert received_seqs(sub, 5) == [0, 1, 2, 3, 4]
        for i in range(5, 8):
            pub.publish(removed_batch(i))
        assert received_seqs(sub, 3) == [5, 6, 7]
        wait_until(lambda: pub.stats.batches_published == 8, what="all counted")
        sub.close()


def test_without_a_collector_the_hold_is_bounded_and_every_batch_is_counted(
    ctx: zmq.Context[Any],
) -> None:
    port = quiet_port()
    pub = ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{port}", hwm=3, shutdown_timeout_s=0.2)
    for i in range(10):
        pub.publish(removed_batch(i))
    wait_until(
        lambda: pub.stats.head_batches_held + pub.stats.drop_reasons["no_subscriber"] == 10,
        what="every batch held or dropped",
    )
    assert pub.stats.head_batches_held == 3  # hwm batches at most
    assert pub.stats.drop_reasons["no_subscriber"] == 7
    pub.shutdown()
    assert pub.stats.batches_published == 0
    assert pub.stats.drop_reasons["shutdown"] == 3  # held, never sent
    assert pub.stats.dropped_batches == 10


def test_bind_mode_holds_nothing_as_in_vllm(ctx: zmq.Context[Any]) -> None:
    with ZmqEventPublisher(endpoint="tcp://127.0.0.1:0", bind=True) as pub:
        for i in range(3):
            pub.publish(removed_batch(i))
        wait_until(lambda: pub.stats.batches_published == 3, what="sent with no subscriber")
        assert pub.stats.head_batches_held == 0


def test_the_hold_refuses_beyond_its_bytes() -> None:
    hold = HeadHold(max_bytes=10, max_batches=0)
    assert hold.hold(0, b"12345", 1)
    assert hold.hold(1, b"12345", 1)
    assert not hold.hold(2, b"1", 1)
    assert [seq for seq, _, _ in hold.release()] == [0, 1]
    assert hold.held_bytes == 0


def test_a_socket_recreated_by_the_byte_budget_holds_its_head_again(
    ctx: zmq.Context[Any],
) -> None:
    """Batches far above the hint make the live byte budget re-create the PUB socket,
    which connects out again; what is published until the collector's subscription
    comes back over the new connection is held and sent, and the stream goes on."""
    sub, port = collector(ctx)
    with ZmqEventPublisher(
        endpoint=f"tcp://127.0.0.1:{port}",
        live_max_client_bytes=1024 * 1024,
        live_batch_bytes_hint=16,
        warn_interval_s=3600,
    ) as pub:
        assert not pub.binds
        n = 0
        while True:
            pub.publish(removed_batch(n))
            n += 1
            wait_until(lambda: pub.queue_size == 0)
            pub._pause_sender()  # the round that sent it (and re-created) is over
            if pub.stats.live_recreations:
                break
            # Until the re-creation the collector reads as it goes; after it, it is not
            # touched until the five batches below are published, so its subscription
            # cannot reach the new connection before them (libzmq attaches a bound
            # socket's new peer in the application's thread).
            while sub.poll(0):
                sub.recv_multipart()
            pub._resume_sender()
        assert dict(pub.stats.live_recreation_reasons) == {"batch_size": 1}
        held_before = pub.stats.head_batches_held
        after = n
        for _ in range(5):
            pub.publish(removed_batch(n))
            n += 1
        pub._resume_sender()
        wait_until(lambda: pub.stats.head_batches_held == held_before + 5, what="the head held")
        seen: list[int] = []
        while after + 4 not in seen:
            seen.append(unpack_seq(recv(sub)[1]))
        # Held until the subscription came back, then sent in order: none of the five lost.
        assert [s for s in seen if s >= after] == list(range(after, after + 5))
    sub.close()
