"""Catch-up on joining a live publisher: the ring is asked for once per connect.

Real parts: kvevents' own :class:`ZmqEventPublisher` with its replay service, publishing
from a thread while a real :class:`Subscriber` joins late over TCP loopback.  A
subscriber joining a live engine sees two reasons to catch up at once (its live socket
connected; a new stream's first batch arrived far above seq 0), and must ask the replay
service for the ring one time, not one time per reason.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _tcp_proxy import CutProxy
from _zmq_helpers import make_batch, wait_until

from kvevents.consumers import Anomaly, BlockIndex, ReceivedBatch, Subscriber, SubscriberOptions
from kvevents.publishers.zmq_publisher import ZmqEventPublisher

pytestmark = pytest.mark.timeout(90)


class PacedPublisher:
    """A real publisher whose thread publishes ``make_batch(seq)`` every ``period_s``
    until ``total`` batches are out (``ahead`` of them at once, before anyone joins)."""

    def __init__(self, total: int, ahead: int, period_s: float = 0.002) -> None:
        self.pub = ZmqEventPublisher(
            endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv@a", buffer_steps=4096
        )
        self.endpoint = self.pub.endpoint.replace("*", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")
        assert self.pub.replay_endpoint is not None
        self.replay = self.pub.replay_endpoint.replace("*", "127.0.0.1").replace(
            "0.0.0.0", "127.0.0.1"
        )
        self.total = total
        self.period_s = period_s
        self.published = 0
        for _ in range(ahead):
            self._one()
        wait_until(lambda: self.pub.queue_size == 0, 10)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self) -> None:
        self.pub.publish(make_batch(self.published))
        self.published += 1

    def _run(self) -> None:
        while self.published < self.total:
            self._one()
            time.sleep(self.period_s)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._thread.join(30)
        self.pub.shutdown()


def test_late_join_asks_the_ring_once() -> None:
    """A subscriber joining a publisher that is live and already holds 1,000 batches
    gets every batch once, in order, from one replay request: no second copy of the
    ring (``catch_up_overlap``), and the only copies dropped are the few live batches
    published while the catch-up request was on its way (the replay's snapshot holds
    them too)."""
    pub = PacedPublisher(total=1_600, ahead=1_000)
    sub = Subscriber(
        pub.endpoint, replay_endpoints=[pub.replay], options=SubscriberOptions(stale_after_s=None)
    )
    seqs: list[int] = []
    anomalies: list[Anomaly] = []
    index = BlockIndex()
    try:
        pub.start()  # live while the subscriber joins: both reasons to catch up at once
        end = time.monotonic() + 60
        while len(seqs) < pub.total:
            assert time.monotonic() < end, (len(seqs), dict(sub.stats.replays))
            item = sub.receive(0.1)
            if isinstance(item, ReceivedBatch):
                seqs.append(item.seq)
                index.apply(item.source, item.dp_rank, item.batch)
            elif isinstance(item, Anomaly):
                anomalies.append(item)
    finally:
        sub.close()
        pub.close()
    assert seqs == list(range(pub.total))
    assert anomalies == []
    stats = sub.stats
    assert stats.replays["requested"] == 1, dict(stats.replays)
    assert stats.replays["catch_up"] == 1
    assert stats.dropped["catch_up_overlap"] == 0, dict(stats.dropped)
    # The live batches that crossed the catch-up request (each one a copy in its reply):
    # a handful at 500 batches/s, not the ring's 1,000.
    assert stats.dropped["replay_overlap"] <= 25, dict(stats.dropped)
    assert stats.replayed_batches >= 1_000
    worker = (pub.endpoint + "#kv@a", 0)
    held = index.block_info(worker, 0, pub.total - 1)
    assert held is not None and "GPU" in held.tiers


def test_reconnect_checks_known_streams_without_the_whole_ring() -> None:
    """After the live connection drops and comes back, a known stream is checked by a
    replay from its last applied seq (one batch of overlap: the fingerprint it
    compares), not by a second replay of the whole ring on top."""
    pub = PacedPublisher(total=300, ahead=300)
    relay = CutProxy(pub.endpoint)
    sub = Subscriber(
        relay.endpoint,
        replay_endpoints=[pub.replay],
        options=SubscriberOptions(stale_after_s=None),
    )
    seqs: list[int] = []
    try:
        end = time.monotonic() + 30
        while len(seqs) < 300:
            assert time.monotonic() < end
            item = sub.receive(0.1)
            if isinstance(item, ReceivedBatch):
                seqs.append(item.seq)
        assert sub.stats.replays["requested"] == 1
        relay.drop_links()  # libzmq reconnects through the relay; the monitor reports both
        while sub.stats.replays["completed"] < 2:
            assert time.monotonic() < end, dict(sub.stats.replays)
            item = sub.receive(0.1)
            if isinstance(item, ReceivedBatch):
                seqs.append(item.seq)
    finally:
        sub.close()
        relay.close()
        pub.close()
    stats = sub.stats
    assert stats.connections["disconnected"] == 1 and stats.connections["connected"] == 2
    assert seqs == list(range(300))
    assert stats.replays["requested"] == 2, dict(stats.replays)  # the join, the check
    assert stats.replays["catch_up"] == 1
    assert stats.dropped["catch_up_overlap"] == 0, dict(stats.dropped)
    assert stats.dropped["replay_overlap"] == 1, dict(stats.dropped)
