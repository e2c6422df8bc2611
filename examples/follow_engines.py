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
        --replay-endpoint tcp://127.0.0.1:5558

It stops on Ctrl-C, after ``--duration`` seconds, after ``--count`` batches, or once the
engines have been quiet for ``--idle`` seconds; then it prints what the index holds.
The loop itself is ``follow_loop.py``'s, shared with the other consumer examples.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from follow_loop import StopRule, add_follow_arguments, follow, print_anomaly

from kvevents.consumers import BlockIndex, Subscriber


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_follow_arguments(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()

    index = BlockIndex()  # learns block sizes and blocks_per_chunk from the stream
    anomalies: Counter[str] = Counter()
    with Subscriber(args.endpoints, replay_endpoints=args.replay_endpoint) as sub:
        print(f"following {', '.join(args.endpoints)}", file=sys.stderr, flush=True)
        batches = follow(sub, index, StopRule.from_args(args), anomalies, print_anomaly)
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
