"""Subscriber against kvevents' own ZmqEventPublisher (skipped where it is not built yet).

The publisher lives on the engine side; only this test, never the consumer package,
imports it.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _zmq_helpers import drain, make_batch

from kvevents.codec import encode_batch
from kvevents.consumers import Anomaly, ReceivedBatch, Subscriber, SubscriberOptions

publishers = pytest.importorskip("kvevents.publishers.zmq_publisher")
pytestmark = pytest.mark.timeout(30)


def loopback(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1")


def test_follows_our_publisher_and_catches_up_whatever_the_join_timing():
    pub = publishers.ZmqEventPublisher(
        endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv@pod", buffer_steps=1000
    )
    try:
        with Subscriber(
            loopback(pub.endpoint),
            topic=b"kv@pod",
            replay_endpoints=[loopback(pub.replay_endpoint)],
            options=SubscriberOptions(catch_up=True),
        ) as sub:
            # A PUB gives no sign of a subscriber joining: publish until something
            # arrives; whatever the slow joiner missed is caught up through replay.
            items: list[object] = []
            n = 0
            while not items and n < 500:
                pub.publish(make_batch(n, rank=None))
                n += 1
                item = sub.receive(0.01)
                items += [] if item is None else [item]
            for i in range(n, n + 20):
                pub.publish(make_batch(i, rank=None))
            last = n + 19
            items += drain(sub, lambda it: any(getattr(x, "seq", -1) == last for x in it))
    finally:
        pub.shutdown()
    got = [x for x in items if isinstance(x, ReceivedBatch)]
    assert [b.seq for b in got] == list(range(last + 1))
    assert [b.payload for b in got] == [
        encode_batch(make_batch(i, rank=0)) for i in range(last + 1)
    ]
    assert all(b.topic == b"kv@pod" and b.dp_rank == 0 for b in got)
    assert [x for x in items if isinstance(x, Anomaly) and x.needs_reset] == []
