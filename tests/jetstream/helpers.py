"""Shared pieces of the JetStream tests: an engine on fixed ports, stream readers."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvevents.consumers import Anomaly, BlockIndex
from kvevents.engines import EngineSpec
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.jetstream import JetStreamRelay, JetStreamSubscriber
from kvevents.publishers import ZmqEventPublisher


def wait_until(pred: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def batch(i: int, life: int = 0) -> KVEventBatch:
    """Batch ``i`` of a publisher's life ``life``: two new blocks, and the removal of an
    older one every third batch (so removals matter to the final state)."""
    base = 1_000_000 * life + 10 * i
    events: list[Any] = [
        BlockStored(
            block_hashes=[base + 1, base + 2],
            parent_block_hash=None,
            token_ids=list(range(base, base + 32)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
    ]
    if i % 3 == 2:
        events.append(BlockRemoved(block_hashes=[base - 20 + 1], medium="GPU"))
    return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)


class Engine:
    """One publisher on fixed ports, so a restarted one comes back where it was."""

    def __init__(self) -> None:
        self.port, self.replay_port = free_port(), free_port()
        self.life = -1
        self.pub: ZmqEventPublisher | None = None
        self.sent: list[KVEventBatch] = []
        self.start()

    def start(self) -> None:
        self.life += 1
        self.sent = []
        self.pub = ZmqEventPublisher(
            endpoint=f"tcp://*:{self.port}", replay_endpoint=f"tcp://*:{self.replay_port}"
        )

    def stop(self) -> None:
        if self.pub is not None:
            self.pub.shutdown()
            self.pub = None

    def publish(self, n: int) -> None:
        assert self.pub is not None
        for _ in range(n):
            b = batch(len(self.sent), self.life)
            self.pub.publish(b)
            self.sent.append(b)

    def spec(self, name: str = "e0") -> EngineSpec:
        return EngineSpec(
            name,
            events_endpoint=f"tcp://127.0.0.1:{self.port}",
            replay_endpoint=f"tcp://127.0.0.1:{self.replay_port}",
        )

    def truth(self, name: str = "e0") -> BlockIndex:
        index = BlockIndex()
        for b in self.sent:
            index.apply(name, 0, b)
        return index


def holdings(index: BlockIndex) -> dict[Any, Any]:
    return {
        w: {t: (s.entries, s.tokens) for t, s in ws.tiers.items()}
        for w, ws in index.summary().items()
    }


def stream_seqs(url: str, stream: str = "KV_EVENTS") -> list[tuple[int, int]]:
    """(epoch, seq) of every stored batch, in stream order."""

    async def read() -> list[tuple[int, int]]:
        import nats

        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(stream)
            out = []
            for s in range(info.state.first_seq, info.state.last_seq + 1):
                msg = await js.get_msg(stream, s)
                h = msg.headers or {}
                out.append((int(h["Kvevents-Epoch"]), int(h["Kvevents-Seq"])))
            return out
        finally:
            await nc.close()

    return asyncio.run(read())


def follow(url: str, batches: int) -> tuple[BlockIndex, list[Anomaly]]:
    """Read ``batches`` batches from the stream into a fresh index (anomalies handled)."""
    index = BlockIndex()
    anomalies: list[Anomaly] = []
    applied = 0
    with JetStreamSubscriber(url) as sub:
        deadline = time.monotonic() + 20
        while applied < batches and time.monotonic() < deadline:
            item = sub.receive(timeout=0.2)
            if item is None:
                continue
            if isinstance(item, Anomaly):
                anomalies.append(item)
                if item.needs_reset and item.dp_rank is not None:
                    index.reset_worker((item.source, item.dp_rank))
                continue
            index.apply(item.source, item.dp_rank, item.batch)
            applied += 1
    assert applied == batches
    return index, anomalies


def run_relay_thread(relay: JetStreamRelay) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    t = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    t.start()
    return stop, t


def stream_seqs_or_empty(url: str) -> list[tuple[int, int]]:
    try:
        return stream_seqs(url)
    except Exception:  # the stream does not exist yet
        return []
