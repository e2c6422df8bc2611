"""CPU cost per batch of ``Subscriber.receive`` (receive + decode + seq tracking), for
profiling and A/B runs of the subscriber's hot path.

One raw PUB in this process pre-sends ``--batches`` 2-event batches (the traffic of
``benchmarks/subscriber.py``); the subscriber then drains them.  The figure is the main
thread's CPU time (``time.thread_time``) per batch, in microseconds, best of
``--repeat`` runs: the machine is shared, so wall-clock time is noisy.  ``--raw`` times
a bare ``recv_multipart`` loop over the same traffic instead; ``--profile`` prints a
``cProfile`` of one run.  To compare two checkouts, run this script under each one's
``PYTHONPATH`` alternately.

Prints a table and a last JSON line (the subscriber against the bare loop, measured in
the same run); ``--raw`` alone prints one JSON line ``{"us_per_batch": ..., "runs": [...]}``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import report, result
from benchmarks.subscriber import TOPIC, payloads
from kvevents.codec import pack_live
from kvevents.consumers import ReceivedBatch, Subscriber


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


def run_subscriber(n: int, prof: cProfile.Profile | None = None) -> float:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub, ep = _pub(ctx)
    sub = Subscriber(ep, rcvhwm=0, catch_up=False, stale_after_s=None)
    _send(pub, n)
    time.sleep(0.3)  # let the I/O thread move the frames (not a synchronisation)
    got = 0
    if prof is not None:
        prof.enable()
    t0 = time.thread_time()
    while got < n:
        item = sub.receive(5)
        if item is None:
            raise RuntimeError(f"stalled after {got} of {n}")
        if isinstance(item, ReceivedBatch):
            got += 1
    cpu = time.thread_time() - t0
    if prof is not None:
        prof.disable()
    sub.close()
    pub.close(0)
    ctx.term()
    return cpu / n * 1e6


def run_raw(n: int, decode: Callable[[bytes], object] | None = None) -> float:
    """CPU us per batch of a bare ``recv_multipart`` loop over the traffic; with
    ``decode``, each payload is also passed to it."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub, ep = _pub(ctx)
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.RCVHWM, 0)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(ep)
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    _send(pub, n)
    time.sleep(0.3)
    got = 0
    t0 = time.thread_time()
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
    cpu = time.thread_time() - t0
    s.close(0)
    pub.close(0)
    ctx.term()
    return cpu / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", type=int, default=60_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    p.add_argument("--raw", action="store_true", help="time only the bare recv_multipart loop")
    p.add_argument("--profile", action="store_true", help="print a cProfile of one run")
    a = p.parse_args()
    batches, repeat = (3_000, 1) if a.quick else (a.batches, a.repeat)
    if a.profile:
        prof = cProfile.Profile()
        run_subscriber(batches, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    if a.raw:
        runs = [run_raw(batches) for _ in range(repeat)]
        print(
            json.dumps({"us_per_batch": round(min(runs), 3), "runs": [round(r, 3) for r in runs]})
        )
        return
    # The subscriber and its baseline (the bare loop over the same traffic), interleaved.
    sub_runs: list[float] = []
    raw_runs: list[float] = []
    for _ in range(repeat):
        sub_runs.append(run_subscriber(batches))
        raw_runs.append(run_raw(batches))
    sub_us, raw_us = min(sub_runs), min(raw_runs)
    report(
        "subscriber_profile",
        [
            result(
                "Subscriber.receive, batches per CPU second (vs a bare receive loop)",
                round(1e6 / sub_us),
                "batches/s",
                round(1e6 / raw_us),
            ),
            result("Subscriber.receive, CPU per batch", round(sub_us, 3), "us"),
            result("bare receive loop, CPU per batch", round(raw_us, 3), "us"),
        ],
    )


if __name__ == "__main__":
    main()
