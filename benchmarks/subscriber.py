"""Subscriber throughput and gap-recovery time on loopback.

* Receive + decode + seq tracking of vLLM-shaped traffic from 1, 8 and 64 publishers
  (each its own XPUB/PUB endpoint, in a separate process that has pre-sent everything),
  against a baseline measured in the same run: raw SUB ``recv_multipart`` of the same
  traffic without decoding or tracking.
* The time to recover a 1,000-batch gap by replay (gap seen -> every missing batch
  delivered in order), against a raw DEALER request/drain of the same 1,000 batches.
* Memory under hostile peers (resident set of the subscriber process, MiB, before and
  at its peak): a publisher flooding frames far over ``max_message_size`` (each one is
  refused by ZMQ, which drops the connection; the subscriber redials), against the same
  flood taken by a subscriber without a size limit; and a replay endpoint whose reply
  stream never ends, against a raw DEALER without a receive bound reading nothing.
  (The subscriber's bound is its replay receive queue: ``replay_rcvhwm`` messages.)

``--quick`` shrinks every count so the run takes a few seconds; ``--publishers 1,64,512``
picks the publisher counts of the throughput rows; ``--rounds N`` (default 3) alternates
that many raw and subscriber runs per row and compares their medians.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import arg_parser, count, report, result
from kvevents.codec import (
    encode_batch,
    pack_live,
    pack_replay_end,
    pack_replay_reply,
    pack_replay_request,
    parse_replay_request,
)
from kvevents.consumers import ReceivedBatch, Subscriber, SubscriberOptions
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch

TOPIC = b"kv@bench"


def payloads(n: int = 64) -> list[bytes]:
    """Typical per-step batches: a 4-block GPU store (64 tokens) and a removal."""
    out = []
    for i in range(n):
        base = 1_000_000 + i * 8
        out.append(
            encode_batch(
                KVEventBatch(
                    ts=1_700_000_000.0 + i,
                    events=[
                        BlockStored(
                            block_hashes=[base + k for k in range(4)],
                            parent_block_hash=base - 1,
                            token_ids=list(range(i, i + 64)),
                            block_size=16,
                            lora_id=None,
                            medium="GPU",
                            lora_name=None,
                            group_idx=0,
                            kv_cache_spec_kind="full_attention",
                        ),
                        BlockRemoved(block_hashes=[base - 8], medium="GPU", group_idx=0),
                    ],
                    data_parallel_rank=0,
                )
            )
        )
    return out


EVENTS_PER_BATCH = 2


def _publisher_proc(n_pubs: int, per_pub: int, ports: Any, ready: Any, done: Any) -> None:
    ctx = zmq.Context()
    socks = []
    for _ in range(n_pubs):
        s = ctx.socket(zmq.XPUB)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.LINGER, -1)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        socks.append(s)
        ports.put(port)
    for s in socks:  # wait for each subscription (no slow-joiner loss)
        s.recv()
    ready.set()
    data = payloads()
    for seq in range(per_pub):
        p = data[seq % len(data)]
        frames = pack_live(TOPIC, seq, p)
        for s in socks:
            s.send_multipart(frames)
    done.set()
    for s in socks:
        s.close()  # linger -1: flush everything first
    ctx.term()


def _start_publishers(n_pubs: int, per_pub: int) -> tuple[Any, list[str], Any, Any]:
    ports: Any = mp.Queue()
    ready, done = mp.Event(), mp.Event()
    proc = mp.Process(target=_publisher_proc, args=(n_pubs, per_pub, ports, ready, done))
    proc.start()
    eps = [f"tcp://127.0.0.1:{ports.get(timeout=30)}" for _ in range(n_pubs)]
    return proc, eps, ready, done


def run_raw(n_pubs: int, per_pub: int) -> float:
    """Baseline: raw SUB recv_multipart of the traffic; returns batches/s."""
    proc, eps, ready, done = _start_publishers(n_pubs, per_pub)
    ctx = zmq.Context.instance()
    socks = []
    poller = zmq.Poller()
    for ep in eps:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(ep)
        poller.register(s, zmq.POLLIN)
        socks.append(s)
    ready.wait(30)
    done.wait(120)
    total = n_pubs * per_pub
    got = 0
    t0 = time.perf_counter()
    while got < total:
        for s, _ in poller.poll(1000):
            while True:
                try:
                    s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got += 1
    elapsed = time.perf_counter() - t0
    for s in socks:
        s.close(0)
    proc.join(30)
    return total / elapsed


def run_subscriber(n_pubs: int, per_pub: int) -> tuple[float, int]:
    """Subscriber: receive, decode, track; returns (batches/s, anomalies seen)."""
    proc, eps, ready, done = _start_publishers(n_pubs, per_pub)
    sub = Subscriber(eps, options=SubscriberOptions(rcvhwm=0))
    ready.wait(30)
    done.wait(120)
    total = n_pubs * per_pub
    got = anomalies = 0
    t0 = time.perf_counter()
    while got < total:
        item = sub.receive(5)
        if item is None:
            raise RuntimeError(f"stalled after {got} of {total}")
        if isinstance(item, ReceivedBatch):
            got += 1
        else:
            anomalies += 1
    elapsed = time.perf_counter() - t0
    sub.close()
    proc.join(30)
    return total / elapsed, anomalies


# --- gap recovery ---------------------------------------------------------------------


def _replay_server_proc(gap: int, ports: Any, stop: Any) -> None:
    """Publish seq 0 live, buffer 1..gap unsent, publish gap+1 live; serve replays."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 2 * (gap + 3))
    ports.put(pub.bind_to_random_port("tcp://127.0.0.1"))
    ports.put(router.bind_to_random_port("tcp://127.0.0.1"))
    data = payloads()
    buf = [(s, data[s % len(data)]) for s in range(gap + 2)]
    poller = zmq.Poller()
    poller.register(pub, zmq.POLLIN)
    poller.register(router, zmq.POLLIN)
    while not stop.is_set():
        for sock, _ in poller.poll(50):
            if sock is pub:
                msg = pub.recv()
                if msg[:1] == b"\x01":  # a subscriber joined: play the gapped stream
                    pub.send_multipart(pack_live(TOPIC, 0, buf[0][1]))
                    pub.send_multipart(pack_live(TOPIC, gap + 1, buf[gap + 1][1]))
            else:
                ident, start = parse_replay_request(router.recv_multipart())
                for s, p in buf:
                    if s >= start:
                        router.send_multipart(pack_replay_reply(ident, TOPIC, s, p))
                router.send_multipart(pack_replay_end(ident))
    pub.close(0)
    router.close(0)
    ctx.term()


def gap_recovery(gap: int, repeats: int) -> tuple[float, float]:
    """Median seconds to repair a ``gap``-batch hole: (subscriber, raw DEALER baseline)."""
    ports: Any = mp.Queue()
    stop = mp.Event()
    proc = mp.Process(target=_replay_server_proc, args=(gap, ports, stop))
    proc.start()
    ep = f"tcp://127.0.0.1:{ports.get(timeout=30)}"
    rep = f"tcp://127.0.0.1:{ports.get(timeout=30)}"
    sub_times, raw_times = [], []
    ctx = zmq.Context.instance()
    try:
        for _ in range(repeats):
            with Subscriber(
                ep,
                replay_endpoints=[rep],
                options=SubscriberOptions(replay_timeout_s=30, catch_up=False),
            ) as sub:
                t_gap = None
                while True:
                    item = sub.receive(30)
                    if item is None:
                        raise RuntimeError("gap recovery stalled")
                    if t_gap is None and not isinstance(item, ReceivedBatch):
                        t_gap = time.perf_counter()  # the gap anomaly: replay requested
                    if isinstance(item, ReceivedBatch) and item.seq == gap + 1:
                        break
                assert t_gap is not None and sub.stats.replayed_batches == gap
                sub_times.append(time.perf_counter() - t_gap)
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(rep)
            t0 = time.perf_counter()
            dealer.send_multipart(pack_replay_request(1))
            n = 0
            while True:
                frames = dealer.recv_multipart()
                if frames[-1] == b"":
                    break
                n += 1
            raw_times.append(time.perf_counter() - t0)
            dealer.close(0)
    finally:
        stop.set()
        proc.join(30)
    return statistics.median(sub_times), statistics.median(raw_times)


# --- hostile peers: memory ---------------------------------------------------------------


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _flooder_proc(frames: int, size: int, ports: Any, done: Any) -> None:
    """A PUB (XPUB) that sends ``frames`` huge live messages, one whenever a subscriber
    is connected (a refused frame drops the connection; the subscriber redials)."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    pub.setsockopt(zmq.SNDHWM, 4)
    ports.put(pub.bind_to_random_port("tcp://127.0.0.1"))
    junk = b"\xc1" * size
    subscribed = False
    sent = 0
    while sent < frames:
        if pub.poll(20):
            subscribed = pub.recv()[:1] == b"\x01"
        if subscribed:
            try:
                pub.send_multipart(pack_live(TOPIC, sent, junk), zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
    time.sleep(1.0)  # let the last frames drain before the socket goes
    done.set()
    pub.close()
    ctx.term()


def _endless_replay_proc(size: int, ports: Any, stop: Any) -> None:
    """A ROUTER that answers a replay request with replies that never end."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # only so a subscriber connects (and asks for a catch-up)
    ports.put(pub.bind_to_random_port("tcp://127.0.0.1"))
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 1000)
    ports.put(router.bind_to_random_port("tcp://127.0.0.1"))
    junk = b"\xc1" * size
    clients: list[bytes] = []
    seq = 0
    while not stop.is_set():
        while router.poll(0):
            ident, _ = parse_replay_request(router.recv_multipart())
            clients.append(ident)
        for ident in clients:
            try:
                router.send_multipart(pack_replay_reply(ident, TOPIC, seq, junk), zmq.NOBLOCK)
                seq += 1
            except zmq.Again:
                pass
        if not clients:
            time.sleep(0.01)
    router.close(0)
    pub.close(0)
    ctx.term()


def _measure(fn: Any, out: Any) -> None:
    before = _rss_mib()
    fn()
    out.put((before, _peak_mib(), _rss_mib()))


def _sub_under_flood(limit: int | None, frames: int, size: int) -> tuple[float, float, float]:
    ports: Any = mp.Queue()
    done = mp.Event()
    flood = mp.Process(target=_flooder_proc, args=(frames, size, ports, done))
    flood.start()
    ep = f"tcp://127.0.0.1:{ports.get(timeout=30)}"

    def run() -> None:
        with Subscriber(
            ep, options=SubscriberOptions(max_message_size_bytes=limit, stale_after_s=None)
        ) as sub:
            end = time.monotonic() + 120
            while not done.is_set() and time.monotonic() < end:
                sub.receive(0.05)
            while sub.receive(0.2) is not None:
                pass

    out: Any = mp.Queue()
    proc = mp.Process(target=_measure, args=(run, out))
    proc.start()
    res = out.get(timeout=300)
    proc.join(30)
    flood.join(30)
    return res


def _sub_under_endless_replay(bounded: bool, seconds: float, size: int) -> tuple[float, ...]:
    ports: Any = mp.Queue()
    stop = mp.Event()
    server = mp.Process(target=_endless_replay_proc, args=(size, ports, stop))
    server.start()
    ep = f"tcp://127.0.0.1:{ports.get(timeout=30)}"
    rep = f"tcp://127.0.0.1:{ports.get(timeout=30)}"

    def run() -> None:
        end = time.monotonic() + seconds
        if bounded:
            # A subscriber whose application keeps up, told the replay holds 20k.
            with Subscriber(
                ep,
                replay_endpoints=[rep],
                options=SubscriberOptions(stale_after_s=None, max_replay_batches=20_000),
            ) as sub:
                while time.monotonic() < end:
                    sub.receive(0.05)
        else:
            # Baseline: a DEALER with no receive bound whose reader stalls.
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVHWM, 0)
            dealer.connect(rep)
            dealer.send_multipart(pack_replay_request(0))
            time.sleep(seconds)
            dealer.close(0)

    out: Any = mp.Queue()
    proc = mp.Process(target=_measure, args=(run, out))
    proc.start()
    res = out.get(timeout=300)
    proc.join(30)
    stop.set()
    server.join(30)
    return res


def main() -> None:
    p = arg_parser(__doc__ or "")
    p.add_argument(
        "--publishers",
        default="1,8,64",
        help="comma-separated publisher counts for the throughput rows (default 1,8,64)",
    )
    p.add_argument(
        "--rounds",
        type=count,
        default=3,
        help="alternated raw/subscriber runs per throughput row; the medians are compared "
        "(default 3)",
    )
    args = p.parse_args()
    try:
        counts = [int(c) for c in args.publishers.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        p.error("--publishers takes counts of at least 1, e.g. 1,8,64")
    mp.set_start_method("fork", force=True)
    total = 20_000 if args.quick else 256_000
    results = []
    for n in counts:
        per_pub = max(1, total // n)
        raws, rates = [], []
        for _ in range(1 if args.quick else args.rounds):  # alternated: noise hits both
            raws.append(run_raw(n, per_pub))
            got, anomalies = run_subscriber(n, per_pub)
            rates.append(got)
            if anomalies:
                print(f"warning: {anomalies} anomalies with {n} publishers", file=sys.stderr)
        raw, rate = statistics.median(raws), statistics.median(rates)
        results.append(result(f"batches/s, {n} publisher(s)", rate, "batches/s", raw))
        results.append(
            result(
                f"events/s, {n} publisher(s)",
                rate * EVENTS_PER_BATCH,
                "events/s",
                raw * EVENTS_PER_BATCH,
            )
        )
    gap = 1000
    sub_t, raw_t = gap_recovery(gap, 3 if args.quick else 7)
    results.append(result(f"recover a {gap}-batch gap", sub_t * 1e3, "ms", raw_t * 1e3))
    frames, size = (6, 8 << 20) if args.quick else (24, 16 << 20)
    before, peak, _ = _sub_under_flood(1 << 20, frames, size)
    b_before, b_peak, _ = _sub_under_flood(None, frames, size)
    print(
        f"huge-frame flood ({frames} x {size >> 20} MiB): RSS {before:.0f} -> peak {peak:.0f} "
        f"MiB with max_message_size 1 MiB; {b_before:.0f} -> {b_peak:.0f} MiB without a limit"
    )
    results.append(
        result(
            f"RSS growth, {frames} x {size >> 20} MiB frames, max_message_size 1 MiB",
            peak - before,
            "MiB",
            b_peak - b_before,
        )
    )
    secs = 1.5 if args.quick else 3.0
    before, peak, _ = _sub_under_endless_replay(True, secs, 16 << 10)
    b_before, b_peak, _ = _sub_under_endless_replay(False, secs, 16 << 10)
    print(
        f"endless replay ({secs:g} s of 16 KiB replies): RSS {before:.0f} -> peak {peak:.0f} "
        f"MiB (subscriber); {b_before:.0f} -> {b_peak:.0f} MiB (unbounded DEALER)"
    )
    results.append(
        result(
            f"RSS growth, {secs:g} s endless replay of 16 KiB replies",
            peak - before,
            "MiB",
            b_peak - b_before,
        )
    )
    report("subscriber", results)


if __name__ == "__main__":
    main()
