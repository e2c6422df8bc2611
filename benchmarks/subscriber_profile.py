"""CPU cost per batch of ``Subscriber.receive`` (receive + decode + seq tracking), for
profiling and A/B runs of the subscriber's hot path.

One raw PUB in this process pre-sends ``--batches`` 2-event batches (the traffic of
``benchmarks/subscriber.py``); the subscriber then drains them.  The figure is the main
thread's CPU time (``time.thread_time``) per batch, in microseconds, best of
``--repeat`` runs: the machine is shared, so wall-clock time is noisy.  ``--raw`` times
a bare ``recv_multipart`` loop over the same traffic instead; ``--profile`` prints a
``cProfile`` of one run.  ``--paced RATE`` has a publisher in another process send the
batches at RATE per second instead, as a live engine does: most reads then find one
batch, so the per-read work (the wait, connection checks, the read that finds nothing
more) counts as it does in a live deployment.  ``--engines N`` (with ``--paced``) spreads
that traffic round robin over N publishers, one endpoint each, which the subscriber
follows as N sources: a fleet, where a wait must not cost more with each engine.
``--warm`` times one wake-up with warm caches instead: an inproc PUB in this process
sends one batch, then one ``receive`` takes it, against a bare ``zmq.Poller`` loop over
the same sends (the per-wake-up Python, without the sleep between batches).
``--opcodes`` counts, instead of timing, the Python opcodes and calls that one such
warm wake-up runs, ours and the bare loop's: deterministic where timings are noisy.
``--wakeups N [--loop ours|bare]`` runs N warm wake-ups untimed, for
``valgrind --tool=cachegrind --cache-sim=no``: the difference of the instruction counts
of two values of N, divided by their difference, is the instructions per wake-up.  To
compare two checkouts, run this script under each one's ``PYTHONPATH`` alternately.

Prints a table and a last JSON line (the subscriber against the bare loop, measured in
the same run, and the time the garbage collector took in each); ``--raw`` alone prints
one JSON line ``{"us_per_batch": ..., "runs": [...]}``.
"""

from __future__ import annotations

import cProfile
import gc
import json
import multiprocessing
import pstats
import selectors
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import arg_parser, report, result
from benchmarks.subscriber import TOPIC, payloads
from kvevents.codec import pack_live
from kvevents.consumers import ReceivedBatch, Subscriber, SubscriberOptions


def _pub(ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[zmq.Socket[bytes], str]:
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    return pub, f"tcp://127.0.0.1:{port}"


def _send(pub: zmq.Socket[bytes], n: int) -> None:
    pub.recv()  # the subscription: nothing is sent before it
    data = payloads()
    for seq in range(n):
        pub.send_multipart(pack_live(TOPIC, seq, data[seq % len(data)]))


def _paced_sender(n: int, rate: float, endpoint: Any, done: Any, engines: int = 1) -> None:
    """A publisher process: bind ``engines`` publishers, report their endpoints, then send
    ``n`` batches in all at ``rate`` per second, round robin over the engines, once each
    is subscribed; stay up until ``done``."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * engines + 64)
    pubs = [_pub(ctx) for _ in range(engines)]
    endpoint.put([ep for _, ep in pubs])
    for pub, _ in pubs:
        pub.recv()  # the subscription
    data = payloads()
    t0 = time.perf_counter()
    for seq in range(n):
        while time.perf_counter() - t0 < seq / rate:
            pass
        pub = pubs[seq % engines][0]
        pub.send_multipart(pack_live(TOPIC, seq // engines, data[seq % len(data)]))
    done.wait(60)
    for pub, _ in pubs:
        pub.close(0)
    ctx.term()


class _Feed:
    """The traffic of one run: pre-sent in this process (``rate`` None) or paced from
    another process, by ``engines`` publishers (paced only)."""

    def __init__(self, n: int, rate: float | None, engines: int = 1) -> None:
        self.n, self.rate = n, rate
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 2 * engines + 64)
        if rate is None:
            self.pub, endpoint = _pub(self.ctx)
            self.endpoints = [endpoint]
        else:
            mp = multiprocessing.get_context("spawn")
            q, self.done = mp.Queue(), mp.Event()
            self.proc = mp.Process(target=_paced_sender, args=(n, rate, q, self.done, engines))
            self.proc.start()
            self.endpoints = q.get(timeout=120)

    def start(self) -> None:
        """Called once subscribed: pre-sends everything, or lets the pacing run."""
        if self.rate is None:
            _send(self.pub, self.n)
            time.sleep(0.3)  # let the I/O thread move the frames (not a synchronisation)

    def close(self) -> None:
        if self.rate is None:
            self.pub.close(0)
        else:
            self.done.set()
            self.proc.join(30)
        self.ctx.term()


class _Collections:
    """Time the garbage collector spends while enabled (``gc.callbacks``): collections
    of each generation and their milliseconds, in the process (any thread)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.ms = 0.0
        self._began = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._began) * 1e3

    def start(self) -> _Collections:
        gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)


# The collector's work in each timed run of run_subscriber and run_raw.
SUB_GC: list[_Collections] = []
RAW_GC: list[_Collections] = []


def run_subscriber(
    n: int, prof: cProfile.Profile | None = None, rate: float | None = None, engines: int = 1
) -> float:
    feed = _Feed(n, rate, engines)
    endpoints = feed.endpoints[0] if engines == 1 else feed.endpoints
    sub = Subscriber(
        endpoints, options=SubscriberOptions(rcvhwm=0, catch_up=False, stale_after_s=None)
    )
    feed.start()
    got = 0
    if prof is not None:
        prof.enable()
    collections = _Collections().start()
    t0 = time.thread_time()
    while got < n:
        item = sub.receive(5)
        if item is None:
            raise RuntimeError(f"stalled after {got} of {n}")
        if isinstance(item, ReceivedBatch):
            got += 1
    cpu = time.thread_time() - t0
    collections.stop()
    SUB_GC.append(collections)
    if prof is not None:
        prof.disable()
    sub.close()
    feed.close()
    return cpu / n * 1e6


def run_raw(
    n: int,
    decode: Callable[[bytes], object] | None = None,
    rate: float | None = None,
    engines: int = 1,
) -> float:
    """CPU us per batch of a bare ``recv_multipart`` loop over the traffic; with
    ``decode``, each payload is also passed to it.  One engine: a :class:`zmq.Poller`
    on its SUB.  Several: a selector (epoll) on every SUB's ``ZMQ_FD``, each signalled
    socket read until ``zmq.Again`` - the cheapest bare loop over many sockets (a
    ``zmq.Poller`` asks every socket on every wait)."""
    feed = _Feed(n, rate, engines)
    socks = []
    for ep in feed.endpoints:
        s = feed.ctx.socket(zmq.SUB)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(ep)
        socks.append(s)
    feed.start()
    got = 0
    collections = _Collections().start()
    t0 = time.thread_time()
    if engines == 1:
        poller = zmq.Poller()
        poller.register(socks[0], zmq.POLLIN)
        while got < n:
            for sock, _ in poller.poll(5000):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if decode is not None:
                        decode(frames[2])
                    got += 1
    else:
        sel = selectors.DefaultSelector()
        for s in socks:
            sel.register(s.getsockopt(zmq.FD), selectors.EVENT_READ, s)
        ready = list(socks)  # (a descriptor signals only changes: read each once first)
        while got < n:
            for sock in ready:
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if decode is not None:
                        decode(frames[2])
                    got += 1
            ready = [key.data for key, _ in sel.select(5)]
        sel.close()
    cpu = time.thread_time() - t0
    collections.stop()
    RAW_GC.append(collections)
    for s in socks:
        s.close(0)
    feed.close()
    return cpu / n * 1e6


class _WarmPair:
    """Two inproc PUBs in this process: the ``ours`` one feeds a :class:`Subscriber`,
    the ``bare`` one a SUB under a :class:`zmq.Poller` (the bare loop)."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.pubs = []
        for name in ("ours", "bare"):
            pub = self.ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, 0)
            pub.bind(f"inproc://warm-{name}")
            self.pubs.append(pub)
        self.data = payloads()
        self.sub = Subscriber(
            "inproc://warm-ours",
            context=self.ctx,
            options=SubscriberOptions(rcvhwm=0, catch_up=False, stale_after_s=None),
        )
        self.raw = self.ctx.socket(zmq.SUB)
        self.raw.setsockopt(zmq.RCVHWM, 0)
        self.raw.setsockopt(zmq.SUBSCRIBE, b"")
        self.raw.connect("inproc://warm-bare")
        self.poller = zmq.Poller()
        self.poller.register(self.raw, zmq.POLLIN)

    def send(self, loop: str, seq: int) -> None:
        """One batch to ``loop`` (``ours`` or ``bare``)."""
        pub = self.pubs[0 if loop == "ours" else 1]
        pub.send_multipart(pack_live(TOPIC, seq, self.data[seq % len(self.data)]))

    def take(self, loop: str) -> None:
        """Take what was sent to ``loop``, as the timed loops of :func:`run_warm` do."""
        if loop == "ours":
            if not isinstance(self.sub.receive(5), ReceivedBatch):
                raise RuntimeError("the subscriber missed a batch")
            return
        for sock, _ in self.poller.poll(5000):
            while True:
                try:
                    sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break

    def close(self) -> None:
        self.sub.close()
        self.raw.close(0)
        for pub in self.pubs:
            pub.close(0)
        self.ctx.term()


def run_warm(n: int, rounds: int) -> tuple[list[float], list[float]]:
    """CPU us per batch of one wake-up with warm caches: an inproc PUB in this process
    sends one batch, then ``Subscriber.receive`` takes it (ours), or a ``zmq.Poller``
    loop polls and drains its own SUB (the bare loop, fed by a second PUB); both include
    the send.  ``rounds`` alternated rounds of ``n`` batches each; the per-round
    figures of each."""
    pair = _WarmPair()
    sub, poller, data = pair.sub, pair.poller, pair.data
    seq = 0
    ours: list[float] = []
    bare: list[float] = []
    try:
        for _ in range(rounds):
            send = pair.pubs[0].send_multipart
            t0 = time.thread_time()
            for i in range(n):
                send(pack_live(TOPIC, seq + i, data[i % len(data)]))
                if not isinstance(sub.receive(5), ReceivedBatch):
                    raise RuntimeError("the subscriber missed a batch")
            ours.append((time.thread_time() - t0) / n * 1e6)
            send = pair.pubs[1].send_multipart
            t0 = time.thread_time()
            for i in range(n):
                send(pack_live(TOPIC, seq + i, data[i % len(data)]))
                for sock, _ in poller.poll(5000):
                    while True:
                        try:
                            sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
            bare.append((time.thread_time() - t0) / n * 1e6)
            seq += n
    finally:
        pair.close()
    return ours, bare


def count_opcodes(n: int) -> dict[str, tuple[float, float]]:
    """Python opcodes and Python-level calls per warm wake-up (the take, not the send),
    for each loop: ``{loop: (opcodes, calls)}``, averaged over ``n`` wake-ups after
    ``n`` untraced ones.  Deterministic, unlike a timing: how much interpreter work a
    wake-up runs (``sys.settrace`` with ``f_trace_opcodes``)."""
    pair = _WarmPair()
    counts = {"opcodes": 0, "calls": 0}

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
            counts["calls"] += 1
        elif event == "opcode":
            counts["opcodes"] += 1
        return tracer

    out: dict[str, tuple[float, float]] = {}
    try:
        for loop in ("ours", "bare"):
            for seq in range(n):
                pair.send(loop, seq)
                pair.take(loop)
            counts.update(opcodes=0, calls=0)
            for seq in range(n, 2 * n):
                pair.send(loop, seq)
                sys.settrace(tracer)
                try:
                    pair.take(loop)
                finally:
                    sys.settrace(None)
            # (the tracer also saw take's own call and body: counted for both loops)
            out[loop] = (counts["opcodes"] / n, counts["calls"] / n)
    finally:
        pair.close()
    return out


def run_wakeups(n: int, loop: str) -> None:
    """``n`` warm wake-ups of ``loop`` after 200 untimed ones, nothing measured: for a
    run under ``valgrind --tool=cachegrind``, whose instruction count at two values of
    ``n`` gives the instructions per wake-up (send included)."""
    pair = _WarmPair()
    try:
        for seq in range(200 + n):
            pair.send(loop, seq)
            pair.take(loop)
    finally:
        pair.close()


def main() -> None:
    p = arg_parser(__doc__ or "")
    p.add_argument("--batches", type=int, default=60_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--raw", action="store_true", help="time only the bare recv_multipart loop")
    p.add_argument("--profile", action="store_true", help="print a cProfile of one run")
    p.add_argument(
        "--paced",
        type=float,
        metavar="RATE",
        help="batches per second from a publisher process (default: pre-sent in-process)",
    )
    p.add_argument(
        "--engines",
        type=int,
        default=1,
        metavar="N",
        help="with --paced: N publishers (endpoints), sent to round robin",
    )
    p.add_argument(
        "--warm",
        action="store_true",
        help="one wake-up with warm caches: an inproc PUB in this process sends one batch, "
        "then one receive (7 alternated rounds of 20,000 batches)",
    )
    p.add_argument(
        "--opcodes",
        action="store_true",
        help="count the Python opcodes and calls of one warm wake-up, ours and the bare loop",
    )
    p.add_argument(
        "--wakeups",
        type=int,
        metavar="N",
        help="run N warm wake-ups of --loop untimed (for valgrind's instruction count)",
    )
    p.add_argument("--loop", choices=("ours", "bare"), default="ours")
    a = p.parse_args()
    batches, repeat = (3_000, 1) if a.quick else (a.batches, a.repeat)
    if a.engines > 1 and a.paced is None:
        p.error("--engines needs --paced")
    if a.wakeups is not None:
        run_wakeups(a.wakeups, a.loop)
        return
    if a.opcodes:
        counted = count_opcodes(200 if a.quick else 2_000)
        report(
            "subscriber_profile",
            [
                result(
                    f"one wake-up, warm: Python {what} (vs a bare Poller loop)",
                    counted["ours"][i],
                    what,
                    counted["bare"][i],
                )
                for i, what in enumerate(("opcodes", "calls"))
            ],
        )
        return
    if a.warm:
        ours, bare = run_warm(3_000, 2) if a.quick else run_warm(20_000, 7)
        report(
            "subscriber_profile",
            [
                result(
                    "one wake-up, warm: Subscriber.receive, CPU per batch, min of rounds "
                    "(vs a bare Poller loop)",
                    round(min(ours), 3),
                    "us",
                    round(min(bare), 3),
                ),
            ],
        )
        return
    if a.profile:
        prof = cProfile.Profile()
        run_subscriber(batches, prof, a.paced, a.engines)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    if a.raw:
        runs = [run_raw(batches, rate=a.paced, engines=a.engines) for _ in range(repeat)]
        print(
            json.dumps({"us_per_batch": round(min(runs), 3), "runs": [round(r, 3) for r in runs]})
        )
        return
    # The subscriber and its baseline (the bare loop over the same traffic), interleaved.
    sub_runs: list[float] = []
    raw_runs: list[float] = []
    for _ in range(repeat):
        sub_runs.append(run_subscriber(batches, rate=a.paced, engines=a.engines))
        raw_runs.append(run_raw(batches, rate=a.paced, engines=a.engines))
    sub_us, raw_us = min(sub_runs), min(raw_runs)
    for name, runs in (("ours", SUB_GC), ("bare", RAW_GC)):
        counts = [sum(c.count[g] for c in runs) for g in range(3)]
        print(f"garbage collections, {name}, {len(runs)} runs: generation 0/1/2 = {counts}")
    paced = "" if a.paced is None else f", paced at {a.paced:,.0f}/s"
    if a.engines > 1:
        paced += f" from {a.engines:,} engines"
    report(
        "subscriber_profile",
        [
            result(
                f"Subscriber.receive, batches per CPU second (vs a bare receive loop){paced}",
                round(1e6 / sub_us),
                "batches/s",
                round(1e6 / raw_us),
            ),
            result(f"Subscriber.receive, CPU per batch{paced}", round(sub_us, 3), "us"),
            result(f"bare receive loop, CPU per batch{paced}", round(raw_us, 3), "us"),
            result(
                "garbage collector, ms per 10,000 batches (ours vs the bare loop)",
                _per_10k(SUB_GC, batches),
                "ms",
                _per_10k(RAW_GC, batches),
            ),
        ],
    )


def _per_10k(runs: list[_Collections], batches: int) -> float:
    return round(sum(c.ms for c in runs) / (len(runs) * batches) * 10_000, 3)


if __name__ == "__main__":
    main()
