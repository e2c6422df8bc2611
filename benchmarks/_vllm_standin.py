"""A stand-in for vLLM 0.33's ``kv_events`` wire classes and publisher loop.

Written from the wire contract (field names, order, types, defaults and msgspec settings
of ``EventBatch``, ``KVCacheEvent``, ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``, ``KVEventBatch``; the ``ZmqEventPublisher`` thread loop), so that its
typed decoder and encoder do exactly the work vLLM's do.  Used by ``vs_vllm.py`` when vLLM
itself is not importable.  No ``from __future__ import annotations`` here: msgspec
resolves these annotations at class creation.

Why a second copy of the classes in ``kvevents/events.py`` and not an import of them: it
is the baseline those classes are measured against, so it must not move when they do
(a change to kvevents' structs or their msgspec options would otherwise change both
sides of the comparison at once).  It holds only what vLLM's side needs (the six wire
classes and the publisher loop, no helpers, constants or docs), and
``tests/test_vllm_standin.py`` checks that it stays byte-identical on the wire.
"""

import queue
import threading
from collections import deque
from types import SimpleNamespace
from typing import Any, Union

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None]
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


class ZmqEventPublisher:
    """vLLM's loop: blocking put; the thread encodes, sends 3 frames, buffers."""

    def __init__(self, data_parallel_rank: int, endpoint: str, **_: Any) -> None:
        self._rank = data_parallel_rank
        self._q: queue.Queue[Any] = queue.Queue(maxsize=100_000)
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._pub.bind(endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def publish(self, events: Any) -> None:
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._rank
        self._q.put(events)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while self._running or self._q.qsize() > 0:
            try:
                item = self._q.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                break
            payload = encoder.encode(item)
            self._pub.send_multipart((b"", seq.to_bytes(8, "big"), payload), copy=False)
            self._buffer.append((seq, payload))
            seq += 1

    def shutdown(self) -> None:
        self._running = False
        self._q.put(None)
        self._thread.join(5)
        self._pub.close(linger=0)


NAMESPACE = SimpleNamespace(
    KVEventBatch=KVEventBatch,
    BlockStored=BlockStored,
    BlockRemoved=BlockRemoved,
    ZmqEventPublisher=ZmqEventPublisher,
)
