"""Consume KV events on asyncio: an ``AsyncSubscriber`` feeding a block index.

``AsyncSubscriber`` is the ``Subscriber`` for asyncio programs (a web router, say): the
same gap repair, replay, duplicate dropping and anomalies, awaited instead of blocked
on, so the event loop keeps serving other tasks.  Here one task applies the stream to a
``BlockIndex`` while a second task reports progress every ``--every`` seconds, standing
in for the rest of an application.

Run::

    python examples/async_consumer.py tcp://127.0.0.1:5557 \\
        --replay-endpoint tcp://127.0.0.1:5558

It stops on Ctrl-C, after ``--duration`` seconds, ``--count`` batches, or ``--idle``
seconds without an event.  The loop itself is ``follow_loop.py``'s, shared with the
other consumer examples.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections import Counter

from follow_loop import StopRule, add_follow_arguments, follow_async, print_anomaly

from kvevents.consumers import AsyncSubscriber, BlockIndex


async def follow(args: argparse.Namespace, index: BlockIndex, anomalies: Counter[str]) -> int:
    """Apply the stream to ``index`` until a stop condition; returns the batches seen."""
    async with AsyncSubscriber(args.endpoints, replay_endpoints=args.replay_endpoint) as sub:
        print(f"following {', '.join(args.endpoints)}", file=sys.stderr, flush=True)
        # other tasks run while this waits for items
        return await follow_async(sub, index, StopRule.from_args(args), anomalies, print_anomaly)


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
    add_follow_arguments(p)
    p.add_argument("--every", type=float, default=1.0, help="progress line every S seconds")
    args = p.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
