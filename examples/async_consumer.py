"""Consume KV events on asyncio: an ``AsyncSubscriber`` feeding a block index.

``AsyncSubscriber`` is the ``Subscriber`` for asyncio programs (a web router, say): the
same gap repair, replay, duplicate dropping and anomalies, awaited instead of blocked
on, so the event loop keeps serving other tasks.  Here one task applies the stream to a
``BlockIndex`` while a second task reports progress every ``--every`` seconds, standing
in for the rest of an application.

Run::

    python examples/async_consumer.py tcp://127.0.0.1:5557 \\
        --replay-endpoint tcp://127.0.0.1:5558 --from-start

It stops on Ctrl-C, after ``--duration`` seconds, ``--count`` batches, or ``--idle``
seconds without an event.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter

from kvevents.consumers import Anomaly, AsyncSubscriber, BlockIndex, ReceivedBatch


async def follow(args: argparse.Namespace, index: BlockIndex, anomalies: Counter[str]) -> int:
    """Apply the stream to ``index`` until a stop condition; returns the batches seen."""
    batches = 0
    start = last = time.monotonic()
    async with AsyncSubscriber(
        args.endpoints, replay_endpoints=args.replay_endpoint, replay_from_start=args.from_start
    ) as sub:
        print(f"following {', '.join(args.endpoints)}", file=sys.stderr, flush=True)
        while args.count is None or batches < args.count:
            now = time.monotonic()
            if args.duration is not None and now - start >= args.duration:
                break
            if args.idle is not None and batches and now - last >= args.idle:
                break
            item = await sub.receive(timeout=0.1)  # other tasks run while this waits
            if item is None:
                continue
            last = time.monotonic()
            if isinstance(item, ReceivedBatch):
                index.apply(item.source, item.dp_rank, item.batch)
                batches += 1
            elif isinstance(item, Anomaly):
                anomalies[item.kind] += 1
                print(f"anomaly {item.kind} {item.source}#{item.dp_rank}: {item.detail}")
                if item.needs_reset and item.dp_rank is not None:
                    index.reset_worker((item.source, item.dp_rank))
    return batches


async def report(index: BlockIndex, every: float) -> None:
    """The rest of the application: here, a progress line now and then."""
    while True:
        await asyncio.sleep(every)
        print(f"... {index.stats.batches} batches applied, {len(index.workers())} worker(s)")


async def run(args: argparse.Namespace) -> dict[str, object]:
    index = BlockIndex()
    anomalies: Counter[str] = Counter()
    reporter = asyncio.create_task(report(index, args.every))
    try:
        batches = await follow(args, index, anomalies)
    finally:
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter
    return {
        "batches": batches,
        "anomalies": dict(anomalies),
        "joined": index.stats.joined,
        "workers": {
            f"{wid[0]}#{wid[1]}": {t: s.entries for t, s in ws.tiers.items()}
            for wid, ws in index.summary().items()
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("endpoints", nargs="*", default=["tcp://127.0.0.1:5557"], metavar="ENDPOINT")
    p.add_argument("--replay-endpoint", action="append", metavar="ENDPOINT")
    p.add_argument("--from-start", action="store_true", help="replay each engine's history")
    p.add_argument("--duration", type=float, help="stop after S seconds")
    p.add_argument("--count", type=int, help="stop after N batches")
    p.add_argument("--idle", type=float, help="stop when nothing arrived for S seconds")
    p.add_argument("--every", type=float, default=1.0, help="progress line every S seconds")
    args = p.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
