"""Shared helpers for the publisher tests: real sockets, condition waits, no sleeps."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from kvevents.codec import parse_replay_reply, unpack_seq
from kvevents.events import BlockRemoved, KVEventBatch
from kvevents.publishers import ZmqEventPublisher

TIMEOUT_S = 10.0


def wait_until(pred: Callable[[], bool], timeout: float = TIMEOUT_S, what: str = "") -> None:
    """Poll ``pred`` until it is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or pred}")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def recv(sock: zmq.Socket[Any], timeout: float = TIMEOUT_S) -> list[bytes]:
    """Receive one multipart message or fail after ``timeout`` seconds."""
    if not sock.poll(int(timeout * 1000)):
        raise AssertionError("timed out waiting for a message")
    return sock.recv_multipart()


def connectable(endpoint: str) -> str:
    """The address a local client connects to for a publisher's bound endpoint."""
    return endpoint.replace("0.0.0.0", "127.0.0.1").replace("//*:", "//127.0.0.1:")


def removed_batch(i: int, ts: float | None = None) -> KVEventBatch:
    """The C§8.2 transcript batch: ``[BlockRemoved([i], "GPU")]`` at ``ts=i``."""
    return KVEventBatch(float(i) if ts is None else ts, [BlockRemoved([i], "GPU")])


def subscribe(
    ctx: zmq.Context[Any], endpoint: str, topic: bytes = b"", *, rcvhwm: int = 0
) -> zmq.Socket[Any]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, rcvhwm)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(connectable(endpoint))
    return sub


def dealer(ctx: zmq.Context[Any], endpoint: str, **opts: int) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(connectable(endpoint))
    return sock


def warm_up(pub: ZmqEventPublisher, sub: zmq.Socket[Any], published: int = 0) -> int:
    """Publish probes until ``sub`` receives one (TCP/IPC slow-joiner), then drain them.

    ``published`` is how many batches ``pub`` had published before; returns the count
    after the probes, which is also the next seq ``pub`` will assign.
    """
    deadline = time.monotonic() + TIMEOUT_S
    n = published
    while True:
        pub.publish(removed_batch(n))
        n += 1
        if sub.poll(20):
            break
        if time.monotonic() > deadline:
            raise AssertionError("subscriber never connected")
    # A fence the queue surely has room for (probes may have been dropped by a tiny
    # max_queue_size), then read up to it.
    wait_until(lambda: pub.queue_size == 0, what="queue drained")
    pub.publish(removed_batch(n))
    n += 1
    while unpack_seq(recv(sub)[1]) != n - 1:
        pass
    return n


def read_replay(sock: zmq.Socket[Any]) -> list[list[bytes]]:
    """Read replies up to and including the end marker."""
    replies = []
    while True:
        frames = recv(sock)
        replies.append(frames)
        if parse_replay_reply(frames).is_end:
            return replies
