"""Test helpers: a fault-injecting publisher built on raw pyzmq sockets.

:class:`FaultyPublisher` speaks vLLM's wire exactly (C§2.1-2.2): live ``[topic, seq,
payload]`` on a PUB-compatible socket (XPUB, so a test can wait until a subscriber has
joined instead of sleeping) and a ROUTER replay server answering ``[id, b"", start]`` with
every buffered batch ``>= start`` then the end marker - with or without the topic frame
(``legacy_replay=True`` is the pre-0.26 layout).  Faults: ``skip`` seqs (buffered but not
sent), a tiny ``buffer_steps``, :meth:`restart` (seq back to 0, buffer emptied), a
``dead`` replay server (never answers) or a ``held`` one (answers once released).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from kvevents.codec import (
    END_SEQ,
    encode_batch,
    pack_live,
    pack_replay_end,
    pack_replay_reply,
    pack_seq,
    parse_replay_request,
)
from kvevents.consumers.subscriber import worker_source
from kvevents.errors import FrameError
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.005) -> None:
    """Poll ``pred`` until it is true; fail the test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def make_batch(i: int, rank: int | None = 0, *, tag: int = 0) -> KVEventBatch:
    """A distinct, realistic batch: a GPU store of block ``i`` (and a removal of i-1)."""
    events: list[Any] = [
        BlockStored(
            block_hashes=[(tag << 32) + i],
            parent_block_hash=None if i == 0 else (tag << 32) + i - 1,
            token_ids=list(range(i, i + 16)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
    ]
    if i % 3 == 2:
        events.append(BlockRemoved(block_hashes=[(tag << 32) + i - 2], medium="GPU"))
    return KVEventBatch(ts=1_700_000_000.0 + i + tag * 1e-3, events=events, data_parallel_rank=rank)


def _bind_retrying(sock: zmq.Socket[Any], endpoint: str, timeout: float = 5.0) -> None:
    """Bind, retrying while a just-closed socket still holds the address."""
    end = time.monotonic() + timeout
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > end:
                raise
            time.sleep(0.01)


class FaultyPublisher:
    """A vLLM-shaped publisher with injectable faults.  Use from one test thread; the
    replay server runs on its own thread with its own socket."""

    def __init__(
        self,
        *,
        topic: bytes = b"kv@test",
        buffer_steps: int = 10_000,
        replay: bool = True,
        legacy_replay: bool = False,
        dead_replay: bool = False,
        hold_replay: bool = False,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str = "tcp://127.0.0.1:0",
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.ctx = context or zmq.Context.instance()
        self.topic = topic
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.lock = threading.Lock()
        self.seq = 0
        self.legacy_replay = legacy_replay
        self.dead_replay = dead_replay
        self.release = threading.Event()
        if not hold_replay:
            self.release.set()
        self.requests: list[int] = []
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 1_000_000)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        _bind_retrying(self.pub, endpoint)
        self.endpoint: str = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.source = worker_source(self.endpoint, topic)
        """The ``source`` of this publisher's worker ids (endpoint#topic)."""
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            _bind_retrying(self.router, replay_endpoint)
            self.replay_endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()
        self.subscriptions = 0

    # --- live side ----------------------------------------------------------------
    def wait_for_subscribers(
        self, n: int = 1, timeout: float = 5.0, pump: Callable[[], object] | None = None
    ) -> None:
        """Block until ``n`` subscriptions have reached the XPUB (no sleeps).

        ``pump`` is called while waiting: a ZMQ socket only completes a reconnect while
        its owner calls into it, so a test waiting for a subscriber to come back passes
        ``lambda: sub.receive(0.01)`` (and collects nothing it needs from it)."""
        end = time.monotonic() + timeout
        while self.subscriptions < n:
            if time.monotonic() > end:
                raise AssertionError(f"only {self.subscriptions} of {n} subscriber(s)")
            if self.pub.poll(10 if pump else int(timeout * 1000)):
                if self.pub.recv()[:1] == b"\x01":
                    self.subscriptions += 1
            elif pump is not None:
                pump()

    def publish(self, batch: KVEventBatch, *, send: bool = True) -> int:
        """Encode, buffer and (unless ``send`` is false) send one batch; returns its seq."""
        payload = encode_batch(batch)
        return self.publish_raw(payload, send=send)

    def publish_raw(self, payload: bytes, *, send: bool = True) -> int:
        seq = self.seq
        self.seq += 1
        with self.lock:
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart(pack_live(self.topic, seq, payload))
        return seq

    def publish_many(
        self, batches: Iterable[KVEventBatch], skip: Iterable[int] = ()
    ) -> list[tuple[int, bytes]]:
        """Publish ``batches``; the seqs in ``skip`` are buffered but never sent live."""
        skipped = set(skip)
        out = []
        for b in batches:
            payload = encode_batch(b)
            seq = self.publish_raw(payload, send=self.seq not in skipped)
            out.append((seq, payload))
        return out

    def send_frames(self, frames: list[bytes]) -> None:
        """Send an arbitrary (possibly malformed) multipart message on the live socket."""
        self.pub.send_multipart(frames)

    def restart(self) -> None:
        """What a new publisher process looks like on the wire: seq 0, empty buffer."""
        with self.lock:
            self.buffer.clear()
        self.seq = 0

    # --- replay side --------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(20):
                continue
            frames = self.router.recv_multipart()
            try:
                identity, start = parse_replay_request(frames)
            except FrameError:
                continue  # vLLM logs and drops it without a reply
            self.requests.append(start)
            if self.dead_replay:
                continue
            while not self.release.wait(0.02):
                if self._stop.is_set():
                    return
            with self.lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            for s, p in items:
                if self.legacy_replay:
                    self.router.send_multipart([identity, b"", pack_seq(s), p])
                else:
                    self.router.send_multipart(pack_replay_reply(identity, self.topic, s, p))
            if self.legacy_replay:
                self.router.send_multipart([identity, b"", END_SEQ, b""])
            else:
                self.router.send_multipart(pack_replay_end(identity))

    def close(self) -> None:
        self._stop.set()
        self.release.set()
        if self._thread is not None:
            self._thread.join(10)  # it sees the stop within 20 ms, unless starved
            self.router.close(0)
        self.pub.close(0)

    def __enter__(self) -> FaultyPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drain(sub: Any, until: Callable[[list[Any]], bool], timeout: float = 10.0) -> list[Any]:
    """Receive from a subscriber until ``until(items)`` holds (fail after ``timeout``)."""
    items: list[Any] = []
    end = time.monotonic() + timeout
    while not until(items):
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"stream incomplete after {timeout} s: {summarize(items)}")
        item = sub.receive(min(left, 0.5))
        if item is not None:
            items.append(item)
    return items


def summarize(items: list[Any]) -> list[str]:
    out = []
    for it in items:
        if hasattr(it, "batch"):
            out.append(f"B{it.seq}{'r' if it.replayed else ''}")
        else:
            out.append(f"{it.kind}({it.first_seq}..{it.last_seq})")
    return out
