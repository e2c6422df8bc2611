"""Frames the publisher never sent cannot reset a worker or reach the index.

Real parts: kvevents' :class:`ZmqEventPublisher` (with its replay service) connecting
out to a subscriber that binds (vLLM's connect mode), and a forger: another PUB that
connects to the same unauthenticated socket and sends decodable batches under seqs the
publisher has not sent (a few hundred ahead, far ahead, near 2**64, behind).  (A forged
seq the publisher sends within one replay round trip can be taken for the stream going
on: docs/subscriber.md says so; CURVE is the defence.)  The index the
subscriber feeds must end equal to one built from the publisher's own batches.
"""

from __future__ import annotations

import os
import random
import sys
import time

import pytest
import zmq

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from _ports import free_port_block
from _zmq_helpers import make_batch, wait_until

from kvevents.codec import encode_batch, pack_live
from kvevents.consumers import (
    Anomaly,
    BlockIndex,
    ReceivedBatch,
    Subscriber,
    SubscriberOptions,
    ZmqSource,
)
from kvevents.publishers.zmq_publisher import ZmqEventPublisher

pytestmark = pytest.mark.timeout(120)

LEGIT, FORGED = 3_000, 24


def forged_seq(kind: str, newest: int, rng: random.Random) -> int:
    """A seq the publisher never sent, relative to its newest published seq."""
    if kind == "ahead":  # (within the near-jump range, beyond a replay's round trip)
        return newest + rng.randrange(200, 1_000)
    if kind == "far":
        return newest + rng.randrange(1_000, 100_000)
    if kind == "huge":
        return (1 << 64) - 1 - rng.randrange(100)
    return rng.randrange(0, newest)  # behind


def test_forged_frames_among_live_batches_never_reset_or_reach_the_index() -> None:
    rng = random.Random(34)
    topic = b"kv@a"
    rport = free_port_block(1)
    replay = f"tcp://127.0.0.1:{rport}"
    src = ZmqSource("tcp://*:0", topic, replay, name="collector")
    assert src.bound_endpoint is not None
    port = src.bound_endpoint.rsplit(":", 1)[1]
    pub = ZmqEventPublisher(
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://*:{rport}",
        topic=topic.decode(),
        buffer_steps=10_000,
    )
    sub = Subscriber([src], options=SubscriberOptions(stale_after_s=None))
    ctx = zmq.Context.instance()
    forger = ctx.socket(zmq.PUB)
    forger.setsockopt(zmq.LINGER, 0)
    forger.connect(f"tcp://127.0.0.1:{port}")
    items: list[object] = []

    def pump(until: float = 0.0) -> None:
        while True:
            item = sub.receive(0.0 if until == 0.0 else 0.05)
            if item is not None:
                items.append(item)
            elif time.monotonic() >= until:
                return

    at = sorted(rng.sample(range(100, LEGIT), FORGED))
    kinds = ["ahead", "far", "huge", "behind"]
    sent: list[int] = []
    try:
        for i in range(LEGIT):
            pub.publish(make_batch(i, tag=1))
            if at and i == at[0]:
                at.pop(0)
                wait_until(lambda: pub.queue_size == 0, 10)
                seq = forged_seq(kinds[len(sent) % 4], i, rng)
                sent.append(seq)
                forger.send_multipart(pack_live(topic, seq, encode_batch(make_batch(i, tag=9))))
            if i % 10 == 0:
                pump()
        deadline = time.monotonic() + 60
        while not any(isinstance(x, ReceivedBatch) and x.seq == LEGIT - 1 for x in items):
            assert time.monotonic() < deadline, [
                (a.kind, a.first_seq, a.last_seq, a.detail) for a in items if isinstance(a, Anomaly)
            ][:12]
            pump(time.monotonic() + 0.1)
        pump(time.monotonic() + 0.5)  # the last disowning replays
    finally:
        sub.close()
        forger.close(0)
        pub.shutdown()
    assert len(sent) == FORGED
    resets = [a for a in items if isinstance(a, Anomaly) and a.needs_reset]
    assert resets == []
    batches = [x for x in items if isinstance(x, ReceivedBatch)]
    assert [b.seq for b in batches] == list(range(LEGIT))
    assert all(b.batch.events[0].block_hashes[0] >> 32 == 1 for b in batches)
    disowned = [a for a in items if isinstance(a, Anomaly) and a.kind == "disowned_seq"]
    assert 0 < len(disowned) <= FORGED and all(not a.needs_reset for a in disowned)
    index, truth = BlockIndex(), BlockIndex()
    for b in batches:
        index.apply(b.source, b.dp_rank, b.batch)
    worker = batches[0].worker
    for i in range(LEGIT):
        truth.apply(worker[0], worker[1], make_batch(i, tag=1))
    assert index.summary() == truth.summary()
    missing = [
        i
        for i in range(LEGIT)
        if (truth.block_info(worker, 0, (1 << 32) + i) is not None)
        != (index.block_info(worker, 0, (1 << 32) + i) is not None)
    ]
    assert missing == []
    assert sub.stats.anomalies["publisher_restart"] == 0
    assert sub.stats.anomalies["unrecoverable_loss"] == 0
