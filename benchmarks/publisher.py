"""What ``ZmqEventPublisher.publish()`` costs the engine thread, and how fast batches flow.

Measures, with a realistic step batch (4 ``BlockStored`` of 16 tokens + 1 ``BlockRemoved``):

* ``publish()`` time on the caller's thread (median, p99, max in µs) when a subscriber
  in another process drains the stream (tight loop, and paced at one batch per 0.2 ms),
  when a connected subscriber never reads (RCVHWM 1), and when the sender thread is
  stalled so the queue is full and every call takes the drop path.  Baseline: a bare
  ``queue.Queue.put_nowait`` of the same item, timed the same way in the same run.
* end-to-end batches/s and events/s to a SUB in another process over TCP loopback.
  Baseline: a raw PUB socket sending the same pre-encoded frames from one thread.

Usage: ``python benchmarks/publisher.py [--quick]``.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import contextlib

import zmq
from _common import parse_args, report, result

from kvevents.codec import encode_batch, pack_live
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.publishers import ZmqEventPublisher

EVENTS_PER_BATCH = 5


def step_batch(i: int) -> KVEventBatch:
    """One engine step's worth of events."""
    stored = [
        BlockStored(
            [i * 8 + k],
            i * 8 + k - 1,
            list(range(16 * k, 16 * k + 16)),
            16,
            None,
            "GPU",
            None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        for k in range(4)
    ]
    return KVEventBatch(time.time(), [*stored, BlockRemoved([i], "GPU", group_idx=0)])


# --- subscriber process -----------------------------------------------------------------


def _subscriber(endpoint: str, ctl: Connection) -> None:
    """Count messages with seq >= start until ``n`` arrived; report the last arrival."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    sub.recv_multipart()
    ctl.send("ready")
    while True:
        cmd = ctl.recv()
        if cmd is None:
            break
        start, n, timeout_s = cmd
        got, last = 0, 0.0
        deadline = time.monotonic() + timeout_s
        while got < n and time.monotonic() < deadline:
            if not sub.poll(100):
                continue
            frames = sub.recv_multipart()
            if int.from_bytes(frames[1], "big") >= start:
                got += 1
                last = time.monotonic()
        ctl.send((got, last))
    sub.close(linger=0)
    ctx.term()


class RemoteSub:
    """A SUB socket in another process (no GIL shared with the publisher)."""

    def __init__(self, endpoint: str, probe: Callable[[], None]) -> None:
        mpctx = mp.get_context("spawn")
        self.ctl, child = mpctx.Pipe()
        self.proc = mpctx.Process(target=_subscriber, args=(endpoint, child), daemon=True)
        self.proc.start()
        while not self.ctl.poll(0.02):  # slow joiner: probe until the first one arrives
            probe()
        assert self.ctl.recv() == "ready"

    def expect(self, start: int, n: int, timeout_s: float = 60.0) -> None:
        self.ctl.send((start, n, timeout_s))

    def result(self) -> tuple[int, float]:
        got, last = self.ctl.recv()
        return int(got), float(last)

    def close(self) -> None:
        self.ctl.send(None)
        self.proc.join(10)


# --- timing helpers ---------------------------------------------------------------------


def time_calls(call: Callable[[int], None], n: int, pace_s: float = 0.0) -> list[float]:
    """Per-call wall time in µs of ``call(i)`` for i in range(n)."""
    out = []
    clock = time.perf_counter
    for i in range(n):
        t0 = clock()
        call(i)
        out.append((clock() - t0) * 1e6)
        if pace_s:
            time.sleep(pace_s)
    return out


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def connect_addr(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


def live_latency_during_replay(buffer: int, replay_slice: int, rounds: int) -> float:
    """Median ms from ``publish()`` to SUB receipt of a live batch published while a
    ``buffer``-batch replay is being served (sender thread mid-replay)."""
    ctx = zmq.Context.instance()
    pub = ZmqEventPublisher(
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        buffer_steps=buffer,
        replay_slice=replay_slice,
    )
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(connect_addr(pub.endpoint))
    while True:  # slow joiner
        pub.publish(step_batch(0))
        if sub.poll(20):
            break
    for i in range(buffer):
        pub.publish(step_batch(i))
    while pub.stats.batches_published < pub._next_seq:
        time.sleep(0.001)
    while sub.poll(0):
        sub.recv_multipart()
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.RCVHWM, 0)
    client.connect(connect_addr(pub.replay_endpoint or ""))
    latencies = []
    for r in range(rounds):
        before = pub.stats.replay_batches_sent
        client.send_multipart([b"", (0).to_bytes(8, "big")])
        while pub.stats.replay_batches_sent == before:  # the replay has started
            time.sleep(0)
        t0 = time.perf_counter()
        pub.publish(step_batch(r))
        sub.recv_multipart()
        latencies.append((time.perf_counter() - t0) * 1e3)
        done = pub.stats.replays_completed
        while pub.stats.replays_completed < r + 1 and done < r + 1:
            time.sleep(0.001)
            done = pub.stats.replays_completed
        while client.poll(0):
            client.recv_multipart()
    client.close(linger=0)
    sub.close(linger=0)
    pub.shutdown()
    return statistics.median(latencies)


def main() -> None:
    args = parse_args(__doc__ or "")
    logging.basicConfig(level=logging.ERROR)  # the drop scenario warns by design
    n = 2_000 if args.quick else 50_000
    n_paced = 500 if args.quick else 5_000
    n_e2e = 5_000 if args.quick else 100_000
    batches = [step_batch(i) for i in range(max(n, n_e2e))]
    # Keep the cyclic GC from re-scanning the benchmark's own pre-built batches (a
    # gen-2 pass over them takes milliseconds and would land in whichever call
    # triggers it, ours or the baseline's).
    gc.collect()
    gc.freeze()
    results: list[dict[str, Any]] = []

    # Baseline: queue.Queue.put_nowait of the same item, drained by a consumer thread.
    base_q: queue.Queue[Any] = queue.Queue(maxsize=100_000)
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            with contextlib.suppress(queue.Empty):
                base_q.get(timeout=0.05)

    consumer = threading.Thread(target=drain, daemon=True)
    consumer.start()
    base = time_calls(lambda i: base_q.put_nowait((i, batches[i])), n)
    base_paced = time_calls(lambda i: base_q.put_nowait((i, batches[i])), n_paced, 0.0002)
    stop.set()
    consumer.join()

    # 1. publish() with a draining subscriber in another process.
    pub = ZmqEventPublisher(endpoint="tcp://*:0")
    seq = 0

    def probe() -> None:
        nonlocal seq
        pub.publish(step_batch(0))
        seq += 1

    remote = RemoteSub(connect_addr(pub.endpoint), probe)
    remote.expect(seq, n)
    draining = time_calls(lambda i: pub.publish(batches[i]), n)
    got, _ = remote.result()
    seq += n
    remote.expect(seq, n_paced)
    paced = time_calls(lambda i: pub.publish(batches[i]), n_paced, 0.0002)
    got_paced, _ = remote.result()
    seq += n_paced
    drops_draining = pub.stats.dropped_batches

    # 2. End-to-end throughput to the same subscriber.
    remote.expect(seq, n_e2e)
    t0 = time.monotonic()
    for i in range(n_e2e):
        pub.publish(batches[i])
    got_e2e, last = remote.result()
    e2e_rate = got_e2e / (last - t0) if got_e2e else 0.0
    seq += n_e2e
    remote.close()
    pub.shutdown()

    # Baseline: raw PUB sending the same pre-encoded frames from one thread.
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    raw.set_hwm(100_000)
    raw.bind("tcp://127.0.0.1:0")
    raw_ep = raw.getsockopt(zmq.LAST_ENDPOINT).decode()
    payloads = [encode_batch(b) for b in batches[:n_e2e]]
    raw_seq = 0

    def raw_probe() -> None:
        nonlocal raw_seq
        raw.send_multipart(pack_live(b"", raw_seq, payloads[0]))
        raw_seq += 1

    raw_remote = RemoteSub(raw_ep, raw_probe)
    raw_remote.expect(raw_seq, n_e2e)
    t0 = time.monotonic()
    for i in range(n_e2e):
        raw.send_multipart(pack_live(b"", raw_seq + i, payloads[i]))
    raw_got, raw_last = raw_remote.result()
    raw_rate = raw_got / (raw_last - t0) if raw_got else 0.0
    raw_remote.close()
    raw.close(linger=0)

    # 3. publish() with a connected subscriber that never reads.
    pub2 = ZmqEventPublisher(endpoint="tcp://*:0", hwm=1000)
    stalled_sub = ctx.socket(zmq.SUB)
    stalled_sub.setsockopt(zmq.RCVHWM, 1)
    stalled_sub.setsockopt(zmq.SUBSCRIBE, b"")
    stalled_sub.connect(connect_addr(pub2.endpoint))
    while True:  # connected (a probe arrived, left unread), then it never reads
        pub2.publish(batches[0])
        if stalled_sub.poll(20):
            break
    stalled = time_calls(lambda i: pub2.publish(batches[i]), n)
    while pub2.queue_size:  # let its sender finish before the next measurement
        time.sleep(0.01)
    pub2.shutdown()
    stalled_sub.close(linger=0)

    # 4. publish() with the sender thread stalled: full queue, every call drops.
    pub3 = ZmqEventPublisher(endpoint="tcp://*:0", max_queue_size=1, warn_interval_s=3600)
    pub3._pause_sender()
    dropping = time_calls(lambda i: pub3.publish(batches[i]), n)
    drops = pub3.stats.dropped_batches
    pub3._resume_sender()
    pub3.shutdown()

    # 5. Live latency while a long replay is served: sliced vs one synchronous burst
    #    (vLLM's behaviour), same publisher code otherwise.
    replay_buffer = 2_000 if args.quick else 10_000
    rounds = 3 if args.quick else 7
    sliced = live_latency_during_replay(replay_buffer, 64, rounds)
    unsliced = live_latency_during_replay(replay_buffer, 10**9, rounds)

    def cost(name: str, values: list[float], baseline: list[float]) -> None:
        results.append(
            result(
                f"publish_{name}_median",
                statistics.median(values),
                "us",
                statistics.median(baseline),
            )
        )
        results.append(result(f"publish_{name}_p99", pct(values, 0.99), "us", pct(baseline, 0.99)))
        results.append(result(f"publish_{name}_max", max(values), "us", max(baseline)))
        slow = float(sum(v > 1000 for v in values))
        results.append(
            result(
                f"publish_{name}_calls_over_1ms",
                slow,
                "calls",
                float(sum(v > 1000 for v in baseline)),
            )
        )

    cost("draining", draining, base)
    cost("draining_paced", paced, base_paced)
    cost("stalled_subscriber", stalled, base)
    cost("stalled_sender_drop", dropping, base)
    results.append(result("e2e_batches_per_s", e2e_rate, "batch/s", raw_rate))
    results.append(
        result(
            "e2e_events_per_s", e2e_rate * EVENTS_PER_BATCH, "event/s", raw_rate * EVENTS_PER_BATCH
        )
    )
    results.append(result(f"live_latency_during_{replay_buffer}_replay", sliced, "ms", unsliced))
    results.append(result("e2e_delivered_fraction", got_e2e / n_e2e, "fraction", raw_got / n_e2e))
    results.append(result("draining_delivered", (got + got_paced) / (n + n_paced), "fraction"))
    results.append(result("queue_drops_while_draining", float(drops_draining), "batches"))
    results.append(result("drop_path_drops", float(drops), "batches", float(n - 1)))
    report("publisher", results)


if __name__ == "__main__":
    main()
