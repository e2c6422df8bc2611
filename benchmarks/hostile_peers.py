"""Publisher memory under hostile peers: does RSS stay bounded?

Each scenario runs a fresh publisher in its own process (so freed memory of one
scenario does not hide growth in the next) and the hostile peers in another process.
The publisher fills its replay ring, its RSS is read (``before``), the peers attack for
a few seconds while the publisher keeps working, and the peak RSS is reported
(``growth`` = peak - before, MiB).

* ``dealer_flood``: 100 DEALERs that never read (RCVHWM 1, small kernel buffer) each
  ask for the whole ring.  Baseline: the same publisher with vLLM's replay settings
  (ROUTER SNDHWM ``2 * (buffer_steps + 1)``, no client or byte caps), measured in the
  same run.
* ``stalled_subs``: 20 SUBs that never read while the publisher publishes ``2 * hwm``
  batches; PUB keeps up to ``hwm`` messages per subscriber (vLLM's rule), so the growth
  must stop at about ``20 * hwm * message size``: reported after ``hwm`` and after
  ``2 * hwm`` batches.
* ``malformed_flood``: 10 DEALERs send malformed requests (wrong frame counts, starts
  that are not 8 bytes) as fast as they can, and 20 more send one 2 MiB frame each
  (above ``ZMQ_MAXMSGSIZE``).  Baseline: the same publisher, idle, for the same time.

Usage: ``python benchmarks/hostile_peers.py [--quick]``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import parse_args, report, result

MiB = 1024 * 1024


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")  # pragma: no cover - not Linux


def batch(i: int, hashes: int) -> Any:
    from kvevents.events import BlockRemoved, KVEventBatch

    return KVEventBatch(
        float(i), [BlockRemoved([2**63 + i * hashes + k for k in range(hashes)], "GPU")]
    )


def connect_addr(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


# --- the hostile peers (their own process) -----------------------------------------------


def attacker(kind: str, live: str, replay: str, ctl: Connection) -> None:
    import zmq

    ctx = zmq.Context()
    socks: list[zmq.Socket[Any]] = []
    sent = 0
    if kind == "dealer_flood":
        for _ in range(100):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(replay)
            s.send_multipart([b"", (0).to_bytes(8, "big")])
            socks.append(s)
    elif kind == "stalled_subs":
        for _ in range(20):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(live)
            socks.append(s)
    ctl.send("attacking")
    if kind == "malformed_flood":
        for _ in range(20):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(replay)
            s.send_multipart([b"", b"\x01" * (2 * MiB)])
            socks.append(s)
        flooders = []
        for _ in range(10):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 1000)
            s.connect(replay)
            flooders.append(s)
        bad = [[b"", b"\x00" * 9], [b"\x00" * 8], [b"", b"\x00" * 8, b"x"], [b"", b"\x00" * 4]]
        while not ctl.poll(0):
            for s in flooders:
                try:
                    s.send_multipart(bad[sent % len(bad)], zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
        socks += flooders
    else:
        ctl.poll(None)
    ctl.recv()
    ctl.send(sent)
    for s in socks:
        s.close(0)
    ctx.term()


# --- the publisher (its own process) -----------------------------------------------------


def publisher(kind: str, bounded: bool, quick: bool, ctl: Connection) -> None:
    import gc
    import logging

    from kvevents.publishers import ZmqEventPublisher

    logging.basicConfig(level=logging.ERROR)
    ring = 2_000 if quick else 4_000
    hwm = 2_000 if quick else 10_000
    hashes = 400 if kind == "dealer_flood" else 40  # ~3.6 KB / ~400 B payloads
    extra: dict[str, Any] = {}
    if not bounded:  # vLLM's replay settings: no caps, whole replies
        extra = {
            "replay_sndhwm": 2 * (ring + 1),
            "replay_max_clients": 10**6,
            "max_pending_replays": 10**6,
            "replay_max_reply_bytes": 2**62,
            "replay_max_client_bytes": 2**62,
            "replay_max_bytes_in_flight": 2**62,
            "replay_stall_timeout_s": 3600.0,
        }
    pub = ZmqEventPublisher(
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        buffer_steps=ring,
        hwm=hwm,
        warn_interval_s=3600,
        **extra,
    )
    for i in range(ring):
        pub.publish(batch(i, hashes))
    while pub.stats.batches_published < pub._next_seq:
        time.sleep(0.01)
    payload = len(pub._buffer[-1][1])
    gc.collect()
    time.sleep(0.3)
    before = rss_mib()
    ctl.send((connect_addr(pub.endpoint), connect_addr(pub.replay_endpoint or ""), before))
    ctl.recv()  # the peers are attacking
    peak = before
    marks: dict[str, float] = {}
    hold = 3.0 if quick else 8.0
    if kind == "stalled_subs":
        # Let every SUB's subscription arrive, then publish 2 * hwm more batches.
        time.sleep(0.5)
        for i in range(2 * hwm):
            pub.publish(batch(ring + i, hashes))
            if i + 1 in (hwm, 2 * hwm):
                while pub.stats.batches_published < pub._next_seq:
                    time.sleep(0.005)
                time.sleep(0.5)
                peak = max(peak, rss_mib())
                marks[f"after_{i + 1}"] = rss_mib() - before
            if i % 1000 == 0:
                peak = max(peak, rss_mib())
    else:
        end = time.monotonic() + hold
        while time.monotonic() < end:
            time.sleep(0.1)
            peak = max(peak, rss_mib())
    s = pub.stats
    info = {
        "payload_bytes": payload,
        "refusals": dict(s.replay_refusals),
        "replay_batches_sent": s.replay_batches_sent,
        "in_flight_mib": pub.replay_bytes_in_flight / MiB,
        "peer_disconnects": s.replay_peer_disconnects,
        "hwm": hwm,
        **marks,
    }
    ctl.send((before, peak, info))
    ctl.recv()
    pub.shutdown(timeout_s=0.2)


def run(kind: str, bounded: bool, quick: bool) -> tuple[float, float, dict[str, Any]]:
    spawn = mp.get_context("spawn")
    pub_ctl, pub_end = spawn.Pipe()
    atk_ctl, atk_end = spawn.Pipe()
    p = spawn.Process(target=publisher, args=(kind, bounded, quick, pub_end))
    p.start()
    live, replay, _ = pub_ctl.recv()
    a = spawn.Process(target=attacker, args=(kind, live, replay, atk_end))
    a.start()
    atk_ctl.recv()
    pub_ctl.send("go")
    before, peak, info = pub_ctl.recv()
    atk_ctl.send("stop")
    info["attacker_messages"] = atk_ctl.recv()
    pub_ctl.send("stop")
    p.join(30)
    a.join(30)
    for proc in (p, a):
        if proc.is_alive():  # pragma: no cover
            proc.kill()
    return before, peak, info


def main() -> None:
    args = parse_args(__doc__ or "")
    q = args.quick
    results: list[dict[str, Any]] = []

    before, peak, info = run("dealer_flood", True, q)
    b_before, b_peak, b_info = run("dealer_flood", False, q)
    results.append(result("dealer_flood_rss_before", before, "MiB", b_before))
    results.append(result("dealer_flood_rss_growth", peak - before, "MiB", b_peak - b_before))
    results.append(
        result(
            "dealer_flood_replayed_batches",
            info["replay_batches_sent"],
            "batches",
            b_info["replay_batches_sent"],
        )
    )
    results.append(result("dealer_flood_refused", sum(info["refusals"].values()), "requests", None))

    before, peak, info = run("stalled_subs", True, q)
    per_msg = info["payload_bytes"] + 64
    bound = 20 * info["hwm"] * per_msg / MiB
    results.append(result("stalled_subs_rss_before", before, "MiB"))
    results.append(
        result(f"stalled_subs_growth_after_{info['hwm']}", info[f"after_{info['hwm']}"], "MiB")
    )
    results.append(
        result(
            f"stalled_subs_growth_after_{2 * info['hwm']}",
            info[f"after_{2 * info['hwm']}"],
            "MiB",
        )
    )
    results.append(result("stalled_subs_bound_20_x_hwm_x_msg", bound, "MiB"))

    before, peak, info = run("malformed_flood", True, q)
    results.append(result("malformed_flood_rss_before", before, "MiB"))
    results.append(result("malformed_flood_rss_growth", peak - before, "MiB"))
    results.append(result("malformed_flood_refused", sum(info["refusals"].values()), "requests"))
    results.append(
        result("malformed_flood_oversize_peers_dropped", info["peer_disconnects"], "peers")
    )
    report("hostile_peers", results)


if __name__ == "__main__":
    main()
