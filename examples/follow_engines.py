"""Follow engines' KV events into a block index, handling every anomaly.

The consumer side in one file: a ``Subscriber`` follows one or more engines (vLLM, or
``examples/publish_engine.py``), repairs seq gaps by replay when a replay endpoint is
given, drops duplicates, and hands over batches and anomalies in stream order.  Each
batch goes into a ``BlockIndex``, which joins the CPU placeholders (``block_size=0``, no
tokens) with the GPU stores of the same hash.  Anomalies are handled as a router must:

* ``gap`` (repaired by replay when possible) and ``duplicate``: informational;
* ``publisher_restart`` (the engine restarted, seq went back to 0) and
  ``unrecoverable_loss`` (a gap replay could not fill): what the index holds for that
  worker can no longer be trusted, so it is reset and rebuilt from the events that follow;
* ``undecodable`` / ``bad_frame``: a payload was skipped; the stream goes on.

Run::

    python examples/follow_engines.py tcp://127.0.0.1:5557 \\
        --replay-endpoint tcp://127.0.0.1:5558 --from-start

It stops on Ctrl-C, after ``--duration`` seconds, after ``--count`` batches, or once the
engines have been quiet for ``--idle`` seconds; then it prints what the index holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

from kvevents.consumers import Anomaly, BlockIndex, ReceivedBatch, Subscriber


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("endpoints", nargs="*", default=["tcp://127.0.0.1:5557"], metavar="ENDPOINT")
    p.add_argument(
        "--replay-endpoint",
        action="append",
        metavar="ENDPOINT",
        help="the replay endpoint of each ENDPOINT, in the same order",
    )
    p.add_argument("--from-start", action="store_true", help="replay each engine's history")
    p.add_argument("--duration", type=float, help="stop after S seconds")
    p.add_argument("--count", type=int, help="stop after N batches")
    p.add_argument("--idle", type=float, help="stop when nothing arrived for S seconds")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()

    index = BlockIndex()  # learns block sizes and blocks_per_chunk from the stream
    anomalies: Counter[str] = Counter()
    batches = 0
    start = last = time.monotonic()
    with Subscriber(
        args.endpoints,
        replay_endpoints=args.replay_endpoint,
        replay_from_start=args.from_start,
    ) as sub:
        print(f"following {', '.join(args.endpoints)}", file=sys.stderr, flush=True)
        try:
            while args.count is None or batches < args.count:
                now = time.monotonic()
                if args.duration is not None and now - start >= args.duration:
                    break
                if args.idle is not None and batches and now - last >= args.idle:
                    break
                item = sub.receive(timeout=0.1)
                if item is None:
                    continue
                last = time.monotonic()
                if isinstance(item, ReceivedBatch):
                    index.apply(item.source, item.dp_rank, item.batch)
                    batches += 1
                elif isinstance(item, Anomaly):
                    anomalies[item.kind] += 1
                    action = ""
                    if item.needs_reset and item.dp_rank is not None:
                        index.reset_worker((item.source, item.dp_rank))
                        action = "; worker reset, rebuilding from the next events"
                    print(
                        f"anomaly {item.kind} {item.source}#{item.dp_rank}: {item.detail}{action}",
                        flush=True,
                    )
        except KeyboardInterrupt:
            pass
        stats = sub.stats

    holdings = {
        f"{wid[0]}#{wid[1]}": {t: s.entries for t, s in ws.tiers.items()}
        for wid, ws in index.summary().items()
    }
    result = {
        "batches": batches,
        "events": stats.events,
        "replayed_batches": stats.replayed_batches,
        "lost_batches": stats.lost_batches,
        "anomalies": dict(anomalies),
        "resets": index.stats.resets,
        "joined": index.stats.joined,
        "unjoined": sum(index.stats.unjoined.values()),
        "workers": holdings,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{batches} batches ({stats.events} events, {stats.replayed_batches} by replay, "
        f"{stats.lost_batches} lost); {index.stats.joined} CPU/STORAGE chunks joined to "
        f"their GPU store; anomalies: {dict(anomalies) or 'none'}"
    )
    for worker, tiers in holdings.items():
        print(f"  {worker}: " + ", ".join(f"{t} {n}" for t, n in tiers.items()))


if __name__ == "__main__":
    main()
