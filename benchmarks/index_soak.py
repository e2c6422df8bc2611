"""BlockIndex soak: a churny stream of millions of block events against a small cap.

Three streams, each from four engine workers: ``gpu`` (GPU stores and one-hash GPU
removals), ``placeholder`` (plus CPU placeholders for every chunk tail and their CPU
removals) and ``self-describing`` (CPU stores that carry their chunk's tokens).  Chats
of 4-32 blocks grow on eight shared system prompts per worker (stored once, never
re-announced), live for a while and are removed block by block; 3% of the removals are
lost (never sent), so an unbounded index grows for ever.  Each stream is applied with
``max_blocks`` small (10,000 entries, retention 5,000; 2,000 and 1,000 with
``--quick``) and uncapped (the baseline), each run in its own process so RSS is its
own, alternating capped and uncapped ``--repeat`` times (best rate of each kept).
A first row checks that a stale pending placeholder on one worker costs the others
nothing.  ``--interleaved`` adds, per stream, the capped/uncapped rate ratio measured in
one process: both indexes are fed the same batches, a slice of about 20,000 block events
at a time, alternately (which goes first alternates too), so that the load of a shared
machine falls on both alike.

Reported per stream: apply throughput capped vs uncapped (block events per second of
``apply`` time; generating the stream is not timed), the largest ``len(index)`` seen
after any ``apply`` (must not exceed the cap), and the process RSS at half time and at
the end (a plateau: the second half adds little).

Run: ``python benchmarks/index_soak.py [--quick] [--interleaved]`` (5 M block events per
run; 200 k with ``--quick``).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import report, result

from kvevents.consumers.index import BlockIndex
from kvevents.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch

BS = 16
BPC = 4
CAP = 10_000  # 2,000 with --quick
RETENTION = 5_000  # 1,000 with --quick
WORKERS = 4
STREAMS = ("gpu", "placeholder", "self-describing")


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0  # pragma: no cover


class Workload:
    """One worker's churny stream, generated batch by batch (deterministic per seed)."""

    def __init__(self, kind: str, seed: int) -> None:
        self.kind = kind
        self.rng = random.Random(seed)
        self.next_hash = (seed + 1) << 40
        self.live: deque[tuple[list[int], list[int]]] = deque()  # (gpu hashes, cpu tails)
        self.prompts: list[int] = []  # last block of each system prompt

    def _hashes(self, n: int) -> list[int]:
        h = self.next_hash
        self.next_hash += n
        return list(range(h, h + n))

    def _gpu(self, hashes: list[int], parent: int | None) -> BlockStored:
        base = hashes[0] & 0xFFFFFF
        toks = list(range(base, base + BS * len(hashes)))
        return BlockStored(hashes, parent, toks, BS, None, "GPU", None, group_idx=0,
                           kv_cache_spec_kind="full_attention")  # fmt: skip

    def first(self) -> KVEventBatch:
        events: list[KVEvent] = []
        for _ in range(8):
            hs = self._hashes(self.rng.randrange(16, 65))
            events.append(self._gpu(hs, None))
            self.prompts.append(hs[-1])
        return KVEventBatch(0.0, events)

    def next(self) -> KVEventBatch:
        rng = self.rng
        events: list[KVEvent] = []
        n = rng.randrange(4, 33)
        parent = rng.choice(self.prompts) if rng.random() < 0.7 else None
        hs = self._hashes(n)
        events.append(self._gpu(hs, parent))
        tails: list[int] = []
        if self.kind == "placeholder":
            tails = hs[BPC - 1 :: BPC]
            events += [BlockStored([t], None, [], 0, None, "CPU", None, group_idx=0)
                       for t in tails]  # fmt: skip
        elif self.kind == "self-describing":
            for c in range(n // BPC):
                chunk = hs[c * BPC : (c + 1) * BPC]
                up = hs[c * BPC - 1] if c else parent
                base = chunk[0] & 0xFFFFFF
                events.append(BlockStored(chunk, up, list(range(base, base + BS * BPC)), BS, None,
                                          "CPU", None, group_idx=0))  # fmt: skip
                tails.append(chunk[-1])
        self.live.append((hs, tails))
        if len(self.live) > 40:  # the oldest chat's blocks go, one event per block
            old, old_tails = self.live.popleft()
            events += [BlockRemoved([h], "GPU", group_idx=0) for h in reversed(old)
                       if rng.random() >= 0.03]  # fmt: skip
            gone = [t for t in old_tails if rng.random() >= 0.03]
            if gone:
                events.append(BlockRemoved(gone, "CPU", group_idx=0))
        return KVEventBatch(0.0, events)


def _block_events(batch: KVEventBatch) -> int:
    return sum(len(ev.block_hashes) for ev in batch.events)  # type: ignore[union-attr]


def run_one(kind: str, capped: bool, total: int, cap: int, retention: int) -> dict[str, Any]:
    """Apply ``total`` block events of stream ``kind``; measure as the module says."""
    index = (
        BlockIndex(blocks_per_chunk=BPC, max_blocks=cap, gpu_metadata_retention=retention)
        if capped
        else BlockIndex(blocks_per_chunk=BPC, max_blocks=1 << 40, gpu_metadata_retention=retention)
    )
    loads = [Workload(kind, seed) for seed in range(WORKERS)]
    for w, load in enumerate(loads):
        index.apply("engine", w, load.first())
    done = 0
    apply_s = 0.0
    max_len = len(index)
    rss_half = 0.0
    gc.collect()
    rss_start = _rss_mib()
    chunk: list[tuple[int, KVEventBatch]] = []
    while done < total:
        chunk.clear()
        n = 0
        while n < 20_000:
            for w, load in enumerate(loads):
                b = load.next()
                n += _block_events(b)
                chunk.append((w, b))
        t0 = time.perf_counter()
        for w, b in chunk:
            index.apply("engine", w, b)
            size = len(index)
            if size > max_len:
                max_len = size
        apply_s += time.perf_counter() - t0
        before = done
        done += n
        if before < total // 2 <= done:
            rss_half = _rss_mib()
    chunk.clear()
    return {
        "rate": done / apply_s,
        "max_len": max_len,
        "final_len": len(index),
        "rss_start": rss_start,
        "rss_half": rss_half,
        "rss_end": _rss_mib(),
        "evicted": index.stats.evicted_by_cap,
        "retained": index.retained_count,
        "block_events": done,
    }


def bench_interleaved(kind: str, total: int, cap: int, retention: int) -> dict[str, Any]:
    """Capped vs uncapped apply rate of stream ``kind`` in one process, the two indexes
    fed the same slices alternately (see the module docstring)."""
    capped = BlockIndex(blocks_per_chunk=BPC, max_blocks=cap, gpu_metadata_retention=retention)
    uncapped = BlockIndex(
        blocks_per_chunk=BPC, max_blocks=1 << 40, gpu_metadata_retention=retention
    )
    loads = [Workload(kind, seed) for seed in range(WORKERS)]
    for w, load in enumerate(loads):
        first = load.first()
        capped.apply("engine", w, first)
        uncapped.apply("engine", w, first)
    spent = {True: 0.0, False: 0.0}
    done = 0
    turn = True
    chunk: list[tuple[int, KVEventBatch]] = []
    while done < total:
        chunk.clear()
        n = 0
        while n < 20_000:
            for w, load in enumerate(loads):
                b = load.next()
                n += _block_events(b)
                chunk.append((w, b))
        for which in (turn, not turn):
            index = capped if which else uncapped
            t0 = time.perf_counter()
            for w, b in chunk:
                index.apply("engine", w, b)
            spent[which] += time.perf_counter() - t0
        assert len(capped) <= cap
        turn = not turn
        done += n
    return result(
        f"{kind}: apply, cap {cap:,} (vs uncapped), interleaved in one process",
        done / spent[True],
        "block-events/s",
        done / spent[False],
    )


def bench_pending(total: int) -> dict[str, Any]:
    """Apply rate of the ``gpu`` stream with one stale placeholder (a CPU store whose GPU
    store never comes) waiting on another worker, vs none: a worker without pending
    entries must not pay for another's."""
    load = Workload("gpu", 0)
    batches = [load.first()]
    n = 0
    while n < total:
        batches.append(load.next())
        n += _block_events(batches[-1])
    stale = KVEventBatch(0.0, [BlockStored([7], None, [], 0, None, "CPU", None, group_idx=0)])
    best = {False: 0.0, True: 0.0}
    for _ in range(3):
        for with_stale in (True, False):
            index = BlockIndex(blocks_per_chunk=BPC)
            if with_stale:
                index.apply("other", 0, stale)
            gc.collect()
            t0 = time.perf_counter()
            for b in batches:
                index.apply("engine", 0, b)
            best[with_stale] = max(best[with_stale], n / (time.perf_counter() - t0))
    return result(
        "gpu stream, one stale pending entry on another worker (vs none)",
        best[True],
        "block-events/s",
        best[False],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="200 k block events per run")
    p.add_argument("--one", nargs=2, metavar=("STREAM", "CAPPED"), help=argparse.SUPPRESS)
    p.add_argument("--events", type=int, help="block events per run (default 5 M)")
    p.add_argument("--repeat", type=int, help="capped/uncapped pairs per stream (3; 1 quick)")
    p.add_argument("--streams", nargs="*", choices=STREAMS, default=list(STREAMS))
    p.add_argument(
        "--interleaved", action="store_true", help="add the one-process interleaved ratios"
    )
    p.add_argument("--only-interleaved", action="store_true", help="only the interleaved ratios")
    args = p.parse_args()
    total = args.events or (200_000 if args.quick else 5_000_000)
    cap, retention = (2_000, 1_000) if args.quick else (CAP, RETENTION)
    repeat = args.repeat or (1 if args.quick else 3)
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1] == "1", total, cap, retention)))
        return
    if args.only_interleaved:
        report("index_soak", [bench_interleaved(k, total, cap, retention) for k in args.streams])
        return
    results = [bench_pending(50_000 if args.quick else 500_000)]
    for kind in args.streams if args.interleaved else ():
        results.append(bench_interleaved(kind, total, cap, retention))
    for kind in args.streams:
        runs: dict[bool, dict[str, Any]] = {}
        for _ in range(repeat):
            for capped in (True, False):
                out = subprocess.run(
                    [sys.executable, __file__, "--one", kind, "1" if capped else "0",
                     "--events", str(total)] + (["--quick"] if args.quick else []),
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                got = json.loads(out.stdout.strip().splitlines()[-1])
                assert got["max_len"] <= cap or not capped, got
                if capped not in runs or got["rate"] > runs[capped]["rate"]:
                    runs[capped] = got
        c, u = runs[True], runs[False]
        results += [
            result(
                f"{kind}: apply, cap {cap:,} (vs uncapped)", c["rate"], "block-events/s", u["rate"]
            ),
            result(
                f"{kind}: largest len(index) after an apply (vs the cap)",
                c["max_len"],
                "entries",
                cap,
            ),
            result(f"{kind}: len(index) at the end, uncapped", u["final_len"], "entries"),
            result(
                f"{kind}: RSS at the end, capped (vs at half time)",
                c["rss_end"],
                "MiB",
                c["rss_half"],
            ),
            result(
                f"{kind}: RSS at the end, uncapped (vs at half time)",
                u["rss_end"],
                "MiB",
                u["rss_half"],
            ),
            result(f"{kind}: evicted by the cap", c["evicted"], "entries"),
        ]
    report("index_soak", results)


if __name__ == "__main__":
    main()
