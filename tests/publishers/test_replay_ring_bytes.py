"""The replay ring is bounded in bytes as well as in batches."""

from __future__ import annotations

from typing import Any

import zmq
from pubtest_helpers import dealer, read_replay, wait_until

from kvevents.codec import pack_replay_request, parse_replay_reply
from kvevents.events import BlockStored, KVEventBatch
from kvevents.publishers import ZmqEventPublisher


def big(i: int) -> KVEventBatch:
    """About 3 kB encoded."""
    tokens = list(range(100_000, 100_600))
    return KVEventBatch(float(i), [BlockStored([i], None, tokens, 16, None, "GPU", None)])


def test_the_ring_keeps_the_newest_batches_that_fit_its_bytes() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    with ZmqEventPublisher(
        endpoint="tcp://127.0.0.1:0",
        bind=True,
        replay_endpoint="tcp://127.0.0.1:0",
        buffer_steps=10_000,
        replay_max_buffer_bytes=20_000,
    ) as pub:
        for i in range(50):
            pub.publish(big(i))
        wait_until(lambda: pub.stats.batches_published == 50, what="all sent")
        kept = [seq for seq, _ in pub._buffer]
        size = sum(len(p) for _, p in pub._buffer)
        assert size <= 20_000 < size + len(pub._buffer[0][1])
        assert kept == list(range(50 - len(kept), 50))
        assert pub.stats.replay_buffer_bytes == size
        client = dealer(ctx, pub.replay_endpoint or "")
        client.send_multipart(pack_replay_request(0))
        replies = [parse_replay_reply(frames) for frames in read_replay(client)]
        seqs = [r.seq for r in replies if not r.is_end]
        assert seqs == kept  # a replay from 0 starts at the oldest kept
        client.close()
    ctx.destroy(linger=0)


def test_one_batch_bigger_than_the_cap_is_still_kept() -> None:
    with ZmqEventPublisher(
        endpoint="tcp://127.0.0.1:0",
        bind=True,
        replay_endpoint="tcp://127.0.0.1:0",
        replay_max_buffer_bytes=100,
    ) as pub:
        for i in range(3):
            pub.publish(big(i))
        wait_until(lambda: pub.stats.batches_published == 3, what="all sent")
        assert [seq for seq, _ in pub._buffer] == [2]
