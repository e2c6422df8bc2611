"""Engine → relay → NATS JetStream → router, against engine → router over ZMQ.

Both paths carry the same pre-encoded batches (a 4-block GPU store of 64 tokens and a
one-block removal each, vLLM's shape) from a real ``ZmqEventPublisher`` on loopback and
end in a ``BlockIndex``; each figure is block events per second from the first publish
to the last batch applied by the router.  The JetStream path runs a real local
``nats-server`` (file storage), the relay in this process and a ``JetStreamSubscriber``.
Also reported: bytes the stream stores per block event.

``--quick`` shrinks the counts so the run takes a few seconds.  Needs nats-py and a
nats-server binary (the ``test`` extra has both); prints a skip line without them.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import parse_args, report, result
from kvevents.consumers import BlockIndex, ReceivedBatch, Subscriber
from kvevents.consumers.zmq_source import ZmqSource
from kvevents.engines import EngineSpec
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.publishers import ZmqEventPublisher


def batches(n: int) -> list[KVEventBatch]:
    out = []
    for i in range(n):
        base = 1_000_000 + i * 8
        out.append(
            KVEventBatch(
                ts=1_700_000_000.0 + i,
                events=[
                    BlockStored(
                        block_hashes=[base + k for k in range(4)],
                        parent_block_hash=None,
                        token_ids=list(range(i, i + 64)),
                        block_size=16,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                    ),
                    BlockRemoved(block_hashes=[base - 8], medium="GPU"),
                ],
                data_parallel_rank=0,
            )
        )
    return out


BLOCK_EVENTS_PER_BATCH = 5


def publisher(n: int) -> ZmqEventPublisher:
    return ZmqEventPublisher(
        endpoint="tcp://*:0", replay_endpoint="tcp://*:0", buffer_steps=n + 1, hwm=n + 1
    )


def local(ep: str | None) -> str:
    assert ep is not None
    return ep.replace("0.0.0.0", "127.0.0.1")


def drain(sub: Any, n: int, index: BlockIndex, timeout_s: float = 120.0) -> int:
    applied = 0
    deadline = time.monotonic() + timeout_s
    while applied < n and time.monotonic() < deadline:
        item = sub.receive(timeout=0.5)
        if isinstance(item, ReceivedBatch):
            index.apply(item.source, item.dp_rank, item.batch)
            applied += 1
    return applied


def direct_path(bs: list[KVEventBatch]) -> float:
    pub = publisher(len(bs))
    try:
        src = ZmqSource(local(pub.endpoint), b"", local(pub.replay_endpoint), name="e0")
        with Subscriber([src]) as sub:
            index = BlockIndex()
            pub.publish(KVEventBatch(ts=0.0, events=[], data_parallel_rank=0))
            drain(sub, 1, index)  # connected
            start = time.perf_counter()
            for b in bs:
                pub.publish(b)
            got = drain(sub, len(bs), index)
            elapsed = time.perf_counter() - start
        assert got == len(bs), got
    finally:
        pub.shutdown()
    return len(bs) * BLOCK_EVENTS_PER_BATCH / elapsed


def jetstream_path(bs: list[KVEventBatch]) -> tuple[float, float]:
    import asyncio

    import nats

    from kvevents.jetstream import JetStreamRelay, JetStreamSubscriber, LocalNatsServer

    with LocalNatsServer() as server:
        pub = publisher(len(bs))
        spec = EngineSpec("e0", None, local(pub.endpoint), local(pub.replay_endpoint))
        relay = JetStreamRelay(server.url, [spec])
        stop = threading.Event()
        t = threading.Thread(target=relay.run, args=(stop,), daemon=True)
        t.start()
        try:
            pub.publish(KVEventBatch(ts=0.0, events=[], data_parallel_rank=0))
            assert relay.wait_appended(1, 30)
            with JetStreamSubscriber(server.url) as sub:
                index = BlockIndex()
                drain(sub, 1, index)
                start = time.perf_counter()
                for b in bs:
                    pub.publish(b)
                got = drain(sub, len(bs), index)
                elapsed = time.perf_counter() - start
            assert got == len(bs), got
        finally:
            stop.set()
            t.join(10)
            relay.close()
            pub.shutdown()

        async def stored() -> int:
            nc = await nats.connect(server.url)
            info = await nc.jetstream().stream_info("KV_EVENTS")
            await nc.close()
            return int(info.state.bytes)

        nbytes = asyncio.run(stored())
    return len(bs) * BLOCK_EVENTS_PER_BATCH / elapsed, nbytes / (len(bs) * BLOCK_EVENTS_PER_BATCH)


def late_router(n_batches: int, tail: int) -> tuple[float, float, int]:
    """A stream of ``n_batches`` batches (5 block events each): seconds to be caught up
    by replaying it all, and by loading a snapshot taken ``tail`` batches before the end
    and replaying the rest.  Returns ``(full_s, snapshot_s, snapshot_bytes)``."""
    import asyncio
    import zlib

    import nats

    from kvevents.codec import encode_batch
    from kvevents.consumers import BlockIndex
    from kvevents.jetstream import JetStreamSubscriber, LocalNatsServer
    from kvevents.jetstream.naming import BatchHeaders, subject_for
    from kvevents.jetstream.reader import StreamPosition
    from kvevents.jetstream.relay import ensure_stream
    from kvevents.jetstream.snapshots import SnapshotStore, apply_item, restore_latest

    bs = batches(n_batches)
    payloads = [encode_batch(b) for b in bs]

    async def fill(url: str) -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await ensure_stream(js, "KV_EVENTS")
        for i in range(0, len(payloads), 1000):
            futs = [
                await js.publish_async(
                    subject_for("e0", 0),
                    p,
                    headers=BatchHeaders("e0", b"", 0, i + j, 0).to_nats(),
                )
                for j, p in enumerate(payloads[i : i + 1000])
            ]
            await asyncio.gather(*futs)
        await nc.close()

    def catch_up(sub: Any, index: BlockIndex, last: int) -> None:
        while sub.position.stream_seq < last:
            item = sub.receive(timeout=5.0)
            assert item is not None, "stream ended early"
            apply_item(index, item)

    with LocalNatsServer() as server:
        asyncio.run(fill(server.url))
        start = time.perf_counter()
        full = BlockIndex()
        with JetStreamSubscriber(server.url) as sub:
            catch_up(sub, full, n_batches)
        full_s = time.perf_counter() - start

        cut = n_batches - tail  # the snapshot reflects stream seqs 1..cut
        snap = BlockIndex()
        for b in bs[:cut]:
            snap.apply("e0", 0, b)
        with SnapshotStore(server.url) as store:
            store.put(snap, StreamPosition(cut, {("e0", 0): (0, cut - 1)}))
            size = len(zlib.compress(snap.snapshot(), 1))
        start = time.perf_counter()
        state = restore_latest(server.url)
        with state.subscriber as sub:
            catch_up(sub, state.index, n_batches)
        snap_s = time.perf_counter() - start
        assert state.index.summary() == full.summary()
    return full_s, snap_s, size


def main() -> None:
    args = parse_args(__doc__ or "")
    n = 2_000 if args.quick else 20_000
    bs = batches(n)
    try:
        import nats  # noqa: F401

        from kvevents.jetstream import find_nats_server

        find_nats_server()
    except Exception as exc:
        print(f"skipped: {exc}")
        report("relay", [])
        return
    direct = direct_path(bs)
    via_js, per_event = jetstream_path(bs)
    late_batches = 4_000 if args.quick else 200_000  # x5 block events: 1 M in the full run
    full_s, snap_s, snap_bytes = late_router(late_batches, tail=late_batches // 100)
    events = late_batches * BLOCK_EVENTS_PER_BATCH
    report(
        "relay",
        [
            result("engine→relay→JetStream→router", via_js, "block events/s", direct),
            result("engine→router over ZMQ (baseline)", direct, "block events/s"),
            result("JetStream bytes stored per block event", per_event, "B"),
            result(
                f"late router ready after {events:,} events: snapshot + last 1%",
                snap_s,
                "s",
                full_s,
            ),
            result(f"late router ready after {events:,} events: full replay", full_s, "s"),
            result("index snapshot size (zlib)", snap_bytes, "B"),
        ],
    )


if __name__ == "__main__":
    main()
