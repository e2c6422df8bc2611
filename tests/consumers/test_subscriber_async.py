"""AsyncSubscriber: the same stream as the sync Subscriber, without blocking the loop."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _zmq_helpers import FaultyPublisher, drain, make_batch

from kvevents.consumers import (
    Anomaly,
    AsyncSubscriber,
    ReceivedBatch,
    Subscriber,
    SubscriberOptions,
)

pytestmark = pytest.mark.timeout(30)


def view(items: list[object]) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for i in items:
        if isinstance(i, ReceivedBatch):
            out.append(("B", i.source, i.dp_rank, i.seq, i.replayed, i.topic, i.payload))
        elif isinstance(i, Anomaly):
            out.append((i.kind, i.source, i.dp_rank, i.first_seq, i.last_seq))
    return out


def is_end(item: object) -> bool:
    return isinstance(item, ReceivedBatch) and item.seq == 59


def test_async_receives_the_same_stream_as_sync():
    with FaultyPublisher(buffer_steps=40) as pub:
        # No start-up catch-up: its timing against the first publish would differ.
        sync_sub = Subscriber(
            pub.endpoint,
            replay_endpoints=[pub.replay_endpoint],
            options=SubscriberOptions(catch_up=False),
        )
        async_sub = AsyncSubscriber(
            pub.endpoint,
            replay_endpoints=[pub.replay_endpoint],
            options=SubscriberOptions(catch_up=False),
        )
        try:
            pub.wait_for_subscribers(2)
            # Drops repaired by replay, drops older than the buffer, a bad payload.
            pub.publish_many((make_batch(i) for i in range(30)), skip={10, 25})
            pub.publish_raw(b"\xc1")
            pub.publish_many((make_batch(i) for i in range(31, 60)), skip={40, 41})
            expected = drain(sync_sub, lambda it: any(is_end(x) for x in it))

            async def consume() -> list[object]:
                got: list[object] = []
                async with async_sub:
                    async for item in async_sub:
                        got.append(item)
                        if is_end(item):
                            return got
                return got

            got = asyncio.run(asyncio.wait_for(consume(), 10))
        finally:
            sync_sub.close()
            async_sub.close()
    assert view(got) == view(expected)
    assert any(isinstance(x, ReceivedBatch) and x.replayed for x in got)
    kinds = {a.kind for a in got if isinstance(a, Anomaly)}
    assert kinds == {"gap", "undecodable", "unrecoverable_loss"}
    # 60 published; seq 10 fell out of the 40-batch buffer, seq 30 was undecodable.
    assert async_sub.stats.batches == sync_sub.stats.batches == 58


def test_waiting_does_not_block_the_event_loop():
    with FaultyPublisher() as pub:

        async def scenario() -> tuple[int, object, float]:
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.01)

            async with AsyncSubscriber(pub.endpoint, replay_endpoints=[pub.replay_endpoint]) as sub:
                await asyncio.get_running_loop().run_in_executor(None, pub.wait_for_subscribers)
                task = asyncio.ensure_future(ticker())
                t0 = time.monotonic()
                nothing = await sub.receive(0.3)
                waited = time.monotonic() - t0
                pub.publish(make_batch(0))
                item = await sub.receive(5)
                task.cancel()
                assert nothing is None and waited >= 0.25
                return ticks, item, waited

        ticks, item, _ = asyncio.run(scenario())
    assert ticks >= 5  # the loop kept running while receive() waited
    assert isinstance(item, ReceivedBatch) and item.seq == 0
