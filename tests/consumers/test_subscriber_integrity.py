"""Transport integrity: the subscriber never loses, invents or misattributes a batch.

Real sockets and real processes: a publisher process killed with SIGKILL and restarted
on the same endpoint, a real XSUB/XPUB proxy with two engines on one endpoint, a live
backlog deeper than the publisher's replay ring, silent engines, oversize frames, and a
lossy forwarder that drops, duplicates and reorders batches around a publisher restart.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq

sys.path.insert(0, os.path.dirname(__file__))
from _zmq_helpers import FaultyPublisher, drain, make_batch, summarize, wait_until

from kvevents.codec import encode_batch, pack_live
from kvevents.consumers import (
    Anomaly,
    AsyncSubscriber,
    BlockIndex,
    ReceivedBatch,
    Router,
    Subscriber,
    SubscriberOptions,
)
from kvevents.consumers.subscriber import worker_source
from kvevents.publishers.zmq_publisher import ZmqEventPublisher

pytestmark = pytest.mark.timeout(60)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def batches_of(items: list[object]) -> list[ReceivedBatch]:
    return [i for i in items if isinstance(i, ReceivedBatch)]


def anomalies_of(items: list[object], kind: str | None = None) -> list[Anomaly]:
    return [i for i in items if isinstance(i, Anomaly) and (kind is None or i.kind == kind)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def apply_all(index: BlockIndex, items: list[object]) -> None:
    """What an application does: apply batches, reset a worker when told to."""
    for it in items:
        if isinstance(it, ReceivedBatch):
            index.apply(it.source, it.dp_rank, it.batch)
        elif isinstance(it, Anomaly) and it.needs_reset and it.worker is not None:
            index.reset_worker(it.worker)


def held_hashes(index: BlockIndex, worker: tuple[str, int], hashes: list[int]) -> set[int]:
    return {
        h
        for h in hashes
        if (info := index.block_info(worker, 0, h)) is not None and "GPU" in info.tiers
    }


class PublisherProcess:
    """kvevents' publisher in its own process (``_publisher_proc.py``)."""

    def __init__(self, endpoint: str, replay: str, topic: str, tag: int, n0: int = 0) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "_publisher_proc.py"),
                endpoint,
                replay,
                topic,
                str(tag),
                str(n0),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def publish(self, n: int) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"pub {n}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split()
        assert line[0] == "ok"
        return int(line[1])

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()


def pump_until(
    receive: Callable[[float], object], until: Callable[[list[object]], bool], timeout: float
) -> list[object]:
    items: list[object] = []
    end = time.monotonic() + timeout
    while not until(items):
        assert time.monotonic() < end, f"not reached in {timeout} s: {summarize(items)}"
        item = receive(0.05)
        if item is not None:
            items.append(item)
    return items


# --- a publisher process killed and restarted on the same endpoint -----------------------


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_sigkilled_publisher_restarted_while_disconnected_is_never_continued(flavour: str):
    """Old process at seq 0..4 is SIGKILLed; a new process on the same endpoints publishes
    0..8 before the subscriber reconnects, so its seq passes the old last seq.  The
    subscriber must report a restart and the index must hold only the new process's
    blocks (a gap 5..8 replayed onto the old state would keep the dead prefix)."""
    port, rport = free_port(), free_port()
    endpoint, replay = f"tcp://*:{port}", f"tcp://127.0.0.1:{rport}"
    sub_kw: dict[str, Any] = {
        "replay_endpoints": [replay],
        "options": SubscriberOptions(stale_after_s=None),
    }
    if flavour == "sync":
        sub: Any = Subscriber(f"tcp://127.0.0.1:{port}", **sub_kw)
        receive = sub.receive
    else:
        sub = AsyncSubscriber(f"tcp://127.0.0.1:{port}", **sub_kw)
        loop = asyncio.new_event_loop()

        def receive(timeout: float) -> object:
            return loop.run_until_complete(sub.receive(timeout))

    old = PublisherProcess(endpoint, replay, "", tag=0)
    new: PublisherProcess | None = None
    try:
        # The subscriber may join late: catch-up fills whatever it missed.
        old.publish(5)
        items = pump_until(receive, lambda it: any(getattr(x, "seq", -1) == 4 for x in it), 15)
        assert [b.seq for b in batches_of(items)] == [0, 1, 2, 3, 4]
        old.kill()
        new = PublisherProcess(endpoint, replay, "", tag=1, n0=9)  # seqs 0..8 at once
        last = new.publish(3)  # 9..11, maybe before the subscriber has reconnected
        items += pump_until(
            receive,
            lambda it: (
                bool(anomalies_of(it, "publisher_restart"))
                and any(
                    getattr(x, "seq", -1) == last
                    for x in it[it.index(anomalies_of(it, "publisher_restart")[0]) :]
                )
            ),
            20,
        )
    finally:
        old.close()
        if new is not None:
            new.close()
        sub.close()
        if flavour == "async":
            loop.close()
    restarts = anomalies_of(items, "publisher_restart")
    assert len(restarts) == 1 and restarts[0].needs_reset
    after = batches_of(items[items.index(restarts[0]) :])
    assert [b.seq for b in after] == list(range(12))
    assert all(b.batch.events[0].block_hashes[0] >> 32 == 1 for b in after)
    index = BlockIndex()
    apply_all(index, items)
    worker = (f"tcp://127.0.0.1:{port}", 0)
    old_hashes = list(range(5))
    assert held_hashes(index, worker, old_hashes) == set()  # nothing of the dead process
    new_hashes = [(1 << 32) + i for i in range(12)]
    removed = {(1 << 32) + i - 2 for i in range(12) if i % 3 == 2}
    assert held_hashes(index, worker, new_hashes) == set(new_hashes) - removed
    assert anomalies_of(items, "unrecoverable_loss") == []
    assert sub.stats.connections["disconnected"] >= 1


# --- engines behind one XSUB/XPUB proxy -----------------------------------------------------


@contextmanager
def xsub_xpub_proxy() -> Iterator[tuple[str, str]]:
    """A real proxy in a thread: publishers connect to the first address, subscribers
    to the second.  Stopped through zmq.proxy_steerable's control socket."""
    ctx = zmq.Context.instance()
    xsub, xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
    for s in (xsub, xpub):
        s.setsockopt(zmq.LINGER, 0)
    xsub.bind("tcp://127.0.0.1:0")
    xpub.bind("tcp://127.0.0.1:0")
    ctl_addr = f"inproc://proxy-ctl-{id(xsub)}"
    ctl = ctx.socket(zmq.PAIR)
    ctl.bind(ctl_addr)
    ready = threading.Event()

    def run() -> None:
        peer = ctx.socket(zmq.PAIR)
        peer.connect(ctl_addr)
        ready.set()
        try:
            zmq.proxy_steerable(xsub, xpub, None, peer)
        except zmq.ZMQError:
            pass
        finally:
            peer.close(0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(5)
    try:
        yield (
            xsub.getsockopt(zmq.LAST_ENDPOINT).decode(),
            xpub.getsockopt(zmq.LAST_ENDPOINT).decode(),
        )
    finally:
        ctl.send(b"TERMINATE")
        thread.join(5)
        for s in (ctl, xsub, xpub):
            s.close(0)


def test_two_rank0_engines_behind_one_proxy_are_two_workers():
    with xsub_xpub_proxy() as (front, back):
        a = ZmqEventPublisher(
            endpoint=front, replay_endpoint="tcp://127.0.0.1:0", topic="kv@engine-a"
        )
        b = ZmqEventPublisher(
            endpoint=front, replay_endpoint="tcp://127.0.0.1:0", topic="kv@engine-b"
        )
        assert a.replay_endpoint is not None and b.replay_endpoint is not None
        wa, wb = worker_source(back, b"kv@engine-a"), worker_source(back, b"kv@engine-b")
        assert wa == f"{back}#kv@engine-a"
        sub = Subscriber(
            back,
            topic=b"kv@",
            replay_endpoints={wa: a.replay_endpoint, wb: b.replay_endpoint},
        )
        try:
            sent: dict[str, list[bytes]] = {wa: [], wb: []}
            for i in range(20):  # interleaved: seqs 0,0,1,1,... on one endpoint
                for pub, w, tag in ((a, wa, 1), (b, wb, 2)):
                    batch = make_batch(i, tag=tag)
                    pub.publish(batch)
                    sent[w].append(encode_batch(batch))
            items = drain(
                sub,
                lambda it: all(
                    any(getattr(x, "source", "") == w and getattr(x, "seq", -1) == 19 for x in it)
                    for w in (wa, wb)
                ),
                15,
            )
        finally:
            sub.close()
            a.shutdown()
            b.shutdown()
    for w in (wa, wb):
        got = [x for x in batches_of(items) if x.source == w]
        assert [x.seq for x in got] == list(range(20)), summarize(items)
        assert [x.payload for x in got] == sent[w]
        assert {x.dp_rank for x in got} == {0}
    bad = [a for a in anomalies_of(items) if a.kind not in ("gap", "duplicate")]
    assert bad == [], bad  # no restart, no loss: two streams, not one collapsed stream
    assert {x.worker for x in batches_of(items)} == {(wa, 0), (wb, 0)}


# --- a live backlog deeper than the replay ring -----------------------------------------------


def test_backlog_deeper_than_the_ring_with_an_early_gap_invents_nothing():
    """Receive HWM 100k vs a 10k ring: 30k batches wait in the subscriber's socket when
    it first reads, and seq 5 never went out live.  The replay then starts at 20k:
    only seq 5 is truly gone; 7..19999 are still queued on the live path."""
    n, skipped = 30_000, 5
    with FaultyPublisher(buffer_steps=10_000) as pub:
        sub = Subscriber(
            pub.endpoint,
            topic=b"kv",
            replay_endpoints=[pub.replay_endpoint],
            options=SubscriberOptions(rcvhwm=100_000),
        )
        try:
            pub.wait_for_subscribers()
            sent = pub.publish_many((make_batch(i) for i in range(n)), skip={skipped})
            items = drain(sub, lambda it: bool(it) and getattr(it[-1], "seq", -1) == n - 1, 60)
        finally:
            sub.close()
    got = batches_of(items)
    assert [(b.seq, b.payload) for b in got] == [s for s in sent if s[0] != skipped]
    losses = anomalies_of(items, "unrecoverable_loss")
    assert [(a.first_seq, a.last_seq) for a in losses] == [(skipped, skipped)]
    assert anomalies_of(items, "publisher_restart") == []
    assert sub.stats.lost_batches == 1
    # (whether part of the ring's tail arrives ahead of the live path, and is dropped as
    # "replay_ahead", depends on timing and on the publisher's replay byte bounds)


# --- liveness ----------------------------------------------------------------------------------


def test_silent_engine_is_stale_only_when_its_replay_endpoint_is_silent_too():
    with (
        FaultyPublisher() as pub,
        FaultyPublisher(replay=False, topic=b"kv@noreplay") as quiet,
    ):
        sub = Subscriber(
            [pub.endpoint, quiet.endpoint],
            topic=b"kv",
            replay_endpoints=[pub.replay_endpoint, None],
            options=SubscriberOptions(stale_after_s=0.6, replay_timeout_s=0.3, replay_cooldown_s=0),
        )
        index = BlockIndex()
        router = Router(index)
        try:
            pub.wait_for_subscribers()
            quiet.wait_for_subscribers()
            pub.publish(make_batch(0))
            quiet.publish(make_batch(0, tag=5))
            items = drain(sub, lambda it: len(batches_of(it)) == 2)
            apply_all(index, items)
            # Idle but alive: probes are answered, the engine stays routable.
            items += drain(sub, lambda it: sub.stats.replays["probe"] >= 4, 10)
            assert anomalies_of(items, "stale") == []
            # Its replay endpoint stops answering too: stale after stale_after_s.
            pub.dead_replay = True
            items += drain(sub, lambda it: bool(anomalies_of(it, "stale")), 10)
            (stale,) = anomalies_of(items, "stale")
            assert stale.worker == (pub.source, 0)
            assert sub.stale_workers == [(pub.source, 0)] and sub.stats.stale_workers == 1
            index.set_stale(stale.worker)
            assert (pub.source, 0) not in {c.worker for c in router.score(list(range(32)))}
            assert router.select(list(range(32))) == (quiet.source, 0)
            # It publishes again: live.
            pub.dead_replay = False
            pub.publish(make_batch(1))
            items += drain(sub, lambda it: bool(anomalies_of(it, "live")), 10)
            (back,) = anomalies_of(items, "live")
            index.set_stale(back.worker, False)
            assert sub.stale_workers == [] and index.stale_workers == frozenset()
        finally:
            sub.close()
    # The engine without a replay endpoint was silent all along and never stale.
    assert all(a.source != quiet.source for a in anomalies_of(items, "stale"))
    assert anomalies_of(items, "unrecoverable_loss") == []


# --- oversize frames ---------------------------------------------------------------------------


def test_oversize_frame_is_refused_counted_and_the_stream_goes_on():
    limit = 64 * 1024
    with FaultyPublisher() as pub:
        sub = Subscriber(
            pub.endpoint,
            topic=b"kv",
            replay_endpoints=[pub.replay_endpoint],
            options=SubscriberOptions(
                max_message_size_bytes=limit, replay_timeout_s=2, stale_after_s=None
            ),
        )
        try:
            pub.wait_for_subscribers()
            pub.publish(make_batch(0))
            items = drain(sub, lambda it: len(batches_of(it)) == 1)
            big = encode_batch(make_batch(1)) + b"\x00" * (2 * limit)  # trailing junk: oversize
            assert pub.publish_raw(big) == 1
            # ZMQ drops the connection; the subscriber reconnects.
            pub.wait_for_subscribers(2, pump=lambda: items.append(sub.receive(0.01)))
            pub.publish_many(make_batch(i) for i in range(2, 5))
            items += drain(sub, lambda it: any(getattr(x, "seq", -1) == 4 for x in it), 15)
        finally:
            sub.close()
    items = [x for x in items if x is not None]
    assert [b.seq for b in batches_of(items)] == [0, 2, 3, 4]
    assert [(a.first_seq, a.last_seq) for a in anomalies_of(items, "unrecoverable_loss")] == [
        (1, 1)
    ]
    assert sub.stats.connections["disconnected"] >= 1
    assert sub.stats.connections["replay_disconnected"] >= 1  # the replay of seq 1 too
    assert anomalies_of(items, "publisher_restart") == []


# --- fault injection: a lossy forwarder ----------------------------------------------------------


class LossyForwarder:
    """SUB from a publisher, PUB to subscribers, dropping / duplicating / reordering live
    batches with a seeded RNG (real sockets, its own thread)."""

    def __init__(self, upstream: str, *, drop: float, dup: float, swap: float, seed: int):
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(upstream)
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.rng = random.Random(seed)
        self.drop, self.dup, self.swap = drop, dup, swap
        self.forwarded = 0
        self.subscribed = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.pub, zmq.POLLIN)
        held: list[bytes] | None = None
        while not self._stop.is_set():
            for sock, _ in poller.poll(20):
                if sock is self.pub:
                    if self.pub.recv()[:1] == b"\x01":
                        self.subscribed.set()
                    continue
                frames = self.sub.recv_multipart()
                self.forwarded += 1
                r = self.rng.random()
                if r < self.drop:
                    continue
                if r < self.drop + self.swap and held is None:
                    held = frames  # sent after the next one
                    continue
                self.pub.send_multipart(frames)
                if r < self.drop + self.swap + self.dup:
                    self.pub.send_multipart(frames)
                if held is not None:
                    self.pub.send_multipart(held)
                    held = None

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sub.close(0)
        self.pub.close(0)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("drop", [0.01, 0.10, 0.50])
def test_lossy_forwarder_with_a_restart_ends_with_the_reference_index(drop: float, seed: int):
    """Drops, duplicates, reorders, and a publisher restart behind the forwarder (no
    socket event reaches the subscriber).  After replays the index must equal a
    reference built from the final publisher lifetime alone; the ring holds everything,
    so no loss may be reported at all, and exactly one restart."""
    first, second = 150, 200
    with FaultyPublisher(buffer_steps=1_000) as pub:
        fwd = LossyForwarder(pub.endpoint, drop=drop, dup=0.05, swap=0.05, seed=seed)
        sub = Subscriber(
            fwd.endpoint,
            topic=b"kv",
            replay_endpoints=[pub.replay_endpoint],
            # a lost tail is fetched by the liveness probe
            options=SubscriberOptions(stale_after_s=0.3),
        )
        try:
            pub.wait_for_subscribers()
            assert fwd.subscribed.wait(5)
            items: list[object] = []
            for i in range(first):
                pub.publish(make_batch(i, tag=1))
                if i % 50 == 49:
                    items.append(sub.receive(0))
            items += drain(
                sub, lambda it: any(getattr(x, "seq", -1) == first - 1 for x in it + items), 15
            )
            pub.restart()  # a new lifetime: seq 0, empty ring, same sockets
            final = [make_batch(i, tag=2) for i in range(second)]
            for i, b in enumerate(final):
                pub.publish(b)
                if i % 50 == 49:
                    items.append(sub.receive(0))
            items += drain(
                sub,
                lambda it: any(
                    getattr(x, "seq", -1) == second - 1
                    and x.batch.events[0].block_hashes[0] >> 32 == 2
                    for x in it + items
                    if isinstance(x, ReceivedBatch)
                ),
                20,
            )
            wait_until(lambda: fwd.forwarded == first + second)
        finally:
            sub.close()
            fwd.close()
    items = [x for x in items if x is not None]
    worker = (worker_source(fwd.endpoint, b"kv@test"), 0)
    restarts = anomalies_of(items, "publisher_restart")
    assert len(restarts) == 1, summarize(items)
    assert anomalies_of(items, "unrecoverable_loss") == [], summarize(items)
    after = batches_of(items[items.index(restarts[0]) :])
    assert [b.seq for b in after] == list(range(second))
    assert [b.payload for b in after] == [encode_batch(b) for b in final]
    index, reference = BlockIndex(), BlockIndex()
    apply_all(index, items)
    for b in final:
        reference.apply(*worker, b)
    assert index.summary() == reference.summary()
    every = [(t << 32) + i for t in (1, 2) for i in range(max(first, second))]
    for h in every:
        assert index.block_info(worker, 0, h) == reference.block_info(worker, 0, h), h


def test_forged_batch_does_not_reset_a_worker():
    """A batch with an applied seq but other content (forged, corrupted, or a reordering
    relay's stray) is checked against the replay ring: same publisher, nothing reset."""
    with FaultyPublisher() as pub:
        sub = Subscriber(pub.endpoint, topic=b"kv", replay_endpoints=[pub.replay_endpoint])
        try:
            pub.wait_for_subscribers()
            pub.publish_many(make_batch(i) for i in range(5))
            items = drain(sub, lambda it: len(batches_of(it)) == 5)
            pub.send_frames(pack_live(pub.topic, 2, encode_batch(make_batch(99, tag=7))))
            pub.publish_many(make_batch(i) for i in range(5, 8))
            items += drain(sub, lambda it: any(getattr(x, "seq", -1) == 7 for x in it))
            items += drain(
                sub, lambda it: not sub._table.streams[(pub.source, 0)].tracker.replaying
            )
        finally:
            sub.close()
    assert [b.seq for b in batches_of(items)] == list(range(8))
    assert [a for a in anomalies_of(items) if a.needs_reset] == []
    assert sub.stats.dropped["mismatch"] == 1, sub.stats
