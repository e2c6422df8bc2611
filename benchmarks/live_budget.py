"""What subscribers that stall one after another make the publisher hold: RSS over time.

A publisher in its own process sends ~14 kB batches (one ``BlockStored`` of 16 blocks
with 2,800 tokens, one ``BlockRemoved``) at 1,000 a second, with a replay endpoint.
This process connects 20 SUB sockets that never read (RCVHWM 1, 4 KiB kernel buffer),
one every ``--stagger`` seconds, so each stalls at another point of the stream and
holds other batches; it reads the publisher's resident memory (``VmRSS``) every half
second.  A healthy :class:`~kvevents.consumers.Subscriber` in a third process follows
the stream with replay and applies it to a :class:`~kvevents.consumers.BlockIndex`; at
the end its index is compared with one built from every batch published.

Rows: RSS growth over the publisher's RSS when publishing started, at each fifth of the
run, at the end and at its peak (MiB), the matching subscriptions at the end, the
re-creations of the PUB socket, the mark at the end, and whether the healthy index
equals the engine's.  Baseline: the same run with vLLM's rule (no byte budget: ``hwm`` 100,000
messages per subscriber).  The replay ring is 2,000 batches (~27 MiB), filled in the
first two seconds in both runs.

``run_scenario`` is also what ``tests/publishers/test_live_budget.py`` runs, with a
smaller budget and a shorter stream.

Usage: ``python benchmarks/live_budget.py [--quick] [--seconds S] [--stagger S]``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zmq

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
MiB = 1024 * 1024
TOKENS = list(range(100_000, 102_800))


def batch(i: int) -> Any:
    """Batch ``i``: stores 16 blocks, removes the 16 stored 8 batches earlier (~14 kB)."""
    from kvevents.events import BlockRemoved, BlockStored, KVEventBatch

    events: list[Any] = [
        BlockStored([(i << 8) + j for j in range(16)], None, TOKENS, 16, None, "GPU", None)
    ]
    if i >= 8:
        events.append(BlockRemoved([((i - 8) << 8) + j for j in range(16)], "GPU"))
    return KVEventBatch(float(i), events)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")  # pragma: no cover - not Linux


# --- children ------------------------------------------------------------------------


def child_publisher(config: dict[str, Any]) -> None:
    """Publish ``total`` batches at ``rate``/s after a line on stdin; print the stats."""
    from kvevents.publishers import ZmqEventPublisher

    pub = ZmqEventPublisher(
        endpoint="tcp://127.0.0.1:0",
        bind=True,
        replay_endpoint="tcp://127.0.0.1:0",
        buffer_steps=config["ring"],
        **config["publisher"],
    )
    print(json.dumps({"endpoint": pub.endpoint, "replay": pub.replay_endpoint}), flush=True)
    sys.stdin.readline()
    total, rate = config["total"], config["rate"]
    start = time.monotonic()
    n = 0
    while n < total:
        due = min(total, int((time.monotonic() - start) * rate) + 1)
        while n < due:
            pub.publish(batch(n))
            n += 1
        time.sleep(0.001)  # pacing, not synchronisation
    while pub.queue_size:
        time.sleep(0.001)
    stats = {
        k: (dict(v) if isinstance(v, Counter) else v)
        for k, v in vars(pub.stats).items()
        if isinstance(v, (int, Counter))
    }
    print(json.dumps({"stats": stats}), flush=True)
    sys.stdin.readline()  # the healthy subscriber is done with replay
    pub.shutdown(0)


def child_healthy(config: dict[str, Any]) -> None:
    """Follow the stream with replay until every seq arrived or the deadline; print
    what arrived and whether the index equals one built from every batch."""
    from kvevents.consumers import (
        Anomaly,
        BlockIndex,
        ReceivedBatch,
        Subscriber,
        SubscriberOptions,
    )

    total = config["total"]
    sub = Subscriber(
        config["endpoint"],
        replay_endpoints=[config["replay"]],
        options=SubscriberOptions(stale_after_s=1.0),
    )
    print("ready", flush=True)
    index = BlockIndex()
    seqs: set[int] = set()
    anomalies: Counter[str] = Counter()
    source = None
    deadline = time.monotonic() + config["deadline_s"]
    try:
        while len(seqs) < total and time.monotonic() < deadline:
            item = sub.receive(0.2)
            if isinstance(item, ReceivedBatch):
                source = item.source
                seqs.add(item.seq)
                index.apply(item.source, item.dp_rank, item.batch)
            elif isinstance(item, Anomaly):
                anomalies[item.kind] += 1
                if item.needs_reset and item.worker is not None:
                    index.reset_worker(item.worker)
    finally:
        sub.close()
    equal = False
    if source is not None:
        reference = BlockIndex()
        for i in range(total):
            reference.apply(source, 0, batch(i))
        equal = index.summary() == reference.summary() and all(
            index.block_info((source, 0), 0, (i << 8) + j)
            == reference.block_info((source, 0), 0, (i << 8) + j)
            for i in range(max(0, total - 16), total)
            for j in range(16)
        )
    print(
        json.dumps(
            {
                "seqs": len(seqs),
                "missing": total - len(seqs),
                "anomalies": dict(anomalies),
                "index_equal": equal,
            }
        ),
        flush=True,
    )


# --- the scenario ----------------------------------------------------------------------


class _Child:
    """A child process of this script whose stdout lines are read by a thread."""

    def __init__(self, role: str, config: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, HERE, "--child", role, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def line(self, timeout: float) -> str:
        out = self.lines.get(timeout=timeout)
        if not out:
            raise RuntimeError(f"child exited with {self.proc.wait()}")
        return out

    def tell(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(5)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.stdout.close()


def run_scenario(
    *,
    publisher: dict[str, Any],
    subscribers: int = 20,
    stagger_s: float = 1.0,
    rate: float = 1000.0,
    seconds: float = 30.0,
    ring: int = 2000,
    sample_s: float = 0.5,
) -> dict[str, Any]:
    """Run one publisher with ``publisher`` keywords, ``subscribers`` stalled SUBs
    connected one every ``stagger_s`` and a healthy subscriber; return the RSS samples
    ``[(seconds, growth bytes)]``, the publisher's stats and the healthy result."""
    total = int(rate * seconds)
    pub = _Child("publisher", {"publisher": publisher, "ring": ring, "total": total, "rate": rate})
    ctx: zmq.Context[Any] = zmq.Context()
    stalled: list[zmq.Socket[Any]] = []
    healthy = None
    try:
        endpoints = json.loads(pub.line(30))
        healthy = _Child(
            "healthy",
            {**endpoints, "total": total, "deadline_s": seconds + 60.0},
        )
        assert healthy.line(30).strip() == "ready"
        base = rss_bytes(pub.proc.pid)
        pub.tell()
        start = time.monotonic()
        samples: list[tuple[float, int]] = []
        next_sample = start
        stats = None
        while stats is None:
            now = time.monotonic()
            while len(stalled) < subscribers and now >= start + len(stalled) * stagger_s:
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, 1)
                sub.setsockopt(zmq.RCVBUF, 4096)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(endpoints["endpoint"])
                stalled.append(sub)  # never read
            if now >= next_sample:
                samples.append((round(now - start, 2), rss_bytes(pub.proc.pid) - base))
                next_sample += sample_s
            try:
                line = pub.lines.get(
                    timeout=max(
                        0.0, min(next_sample, start + len(stalled) * stagger_s) - time.monotonic()
                    )
                )
            except queue.Empty:
                continue
            if not line:
                raise RuntimeError(f"publisher exited with {pub.proc.wait()}")
            stats = json.loads(line)["stats"]
        samples.append((round(time.monotonic() - start, 2), rss_bytes(pub.proc.pid) - base))
        result = json.loads(healthy.line(seconds + 90.0))
        pub.tell()
        pub.proc.wait(30)
    finally:
        for sub in stalled:
            sub.close()
        ctx.term()
        pub.stop()
        if healthy is not None:
            healthy.stop()
    return {"rss": samples, "stats": stats, "healthy": result, "total": total}


def growth_at(samples: list[tuple[float, int]], t: float) -> float:
    """The RSS growth (MiB) of the last sample at or before ``t`` seconds."""
    before = [g for s, g in samples if s <= t]
    return (before[-1] if before else 0) / MiB


def main() -> None:
    from _common import arg_parser, report, result

    p = arg_parser(__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30.0, help="publishing time (s)")
    p.add_argument("--stagger", type=float, default=1.0, help="s between two stalls")
    args = p.parse_args()
    seconds = 10.0 if args.quick else args.seconds
    stagger = min(args.stagger, seconds / 25)
    budget = run_scenario(publisher={}, stagger_s=stagger, seconds=seconds)
    vllm = run_scenario(
        publisher={"live_max_client_bytes": None, "live_max_bytes_in_flight": None},
        stagger_s=stagger,
        seconds=seconds,
    )
    print("RSS growth over time (MiB): t, budget, vLLM's rule")
    for (t, g), (_, v) in zip(budget["rss"], vllm["rss"], strict=False):
        print(f"  {t:6.1f}  {g / MiB:7.1f}  {v / MiB:7.1f}")
    rows = []
    for k in range(1, 6):
        t = seconds * k / 5
        rows.append(
            result(
                f"rss_growth_at_{t:g}s",
                growth_at(budget["rss"], t),
                "MiB",
                growth_at(vllm["rss"], t),
            )
        )
    rows.append(
        result(
            "rss_growth_end",
            budget["rss"][-1][1] / MiB,
            "MiB",
            vllm["rss"][-1][1] / MiB,
        )
    )
    rows.append(
        result(
            "rss_growth_peak",
            max(g for _, g in budget["rss"]) / MiB,
            "MiB",
            max(g for _, g in vllm["rss"]) / MiB,
        )
    )
    stats = budget["stats"]
    rows.append(result("subscribers_at_end", float(stats["live_subscribers"]), "subscriptions"))
    rows.append(result("pub_socket_recreations", float(stats.get("live_recreations", 0)), "times"))
    rows.append(
        result(
            "live_hwm_at_end", float(stats["live_hwm"]), "batches", float(vllm["stats"]["live_hwm"])
        )
    )
    for name, run in (("budget", budget), ("vllm", vllm)):
        h = run["healthy"]
        rows.append(result(f"healthy_{name}_missing_seqs", float(h["missing"]), "batches"))
        rows.append(result(f"healthy_{name}_index_equal", float(h["index_equal"]), "bool"))
    print(
        "reasons:",
        stats.get("live_recreation_reasons"),
        "healthy:",
        budget["healthy"],
        vllm["healthy"],
    )
    report("live_budget", rows)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        {"publisher": child_publisher, "healthy": child_healthy}[sys.argv[2]](
            json.loads(sys.argv[3])
        )
    else:
        main()
