"""A consumer whose counters Prometheus can scrape.

Every kvevents component keeps its counters in ``.stats``; ``kvevents.metrics``
exposes them without the components knowing about Prometheus.  Here a ``Subscriber``
feeds a ``BlockIndex`` as in ``follow_engines.py``, and a ``StatsCollector`` serves
both components' counters (and the subscriber's decoder's) on
``http://127.0.0.1:PORT/metrics``, for example::

    kvevents_subscriber_batches_total{endpoint="..."} 1234.0
    kvevents_subscriber_anomalies_total{endpoint="...",reason="gap"} 1.0
    kvevents_index_joined_total 310.0

Run::

    python examples/prometheus_consumer.py tcp://127.0.0.1:5557 \\
        --replay-endpoint tcp://127.0.0.1:5558 --from-start --port 9400
    curl -s http://127.0.0.1:9400/metrics | grep kvevents_

It stops on Ctrl-C, after ``--duration`` seconds, ``--count`` batches, or ``--idle``
seconds without an event.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvevents.consumers import Anomaly, BlockIndex, ReceivedBatch, Subscriber
from kvevents.metrics import StatsCollector, start_metrics_server, stats_snapshot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("endpoints", nargs="*", default=["tcp://127.0.0.1:5557"], metavar="ENDPOINT")
    p.add_argument("--replay-endpoint", action="append", metavar="ENDPOINT")
    p.add_argument("--from-start", action="store_true", help="replay each engine's history")
    p.add_argument("--port", type=int, default=9400, help="metrics port on 127.0.0.1")
    p.add_argument("--duration", type=float, help="stop after S seconds")
    p.add_argument("--count", type=int, help="stop after N batches")
    p.add_argument("--idle", type=float, help="stop when nothing arrived for S seconds")
    args = p.parse_args()

    index = BlockIndex()
    sub = Subscriber(
        args.endpoints, replay_endpoints=args.replay_endpoint, replay_from_start=args.from_start
    )
    collector = StatsCollector()  # reads each component's .stats at every scrape
    label = ",".join(args.endpoints)
    collector.register("subscriber", sub, endpoint=label)
    collector.register("decoder", sub.decoder, endpoint=label)
    collector.register("index", index)
    start_metrics_server(args.port, collector)  # a daemon thread; loopback only
    print(f"metrics on http://127.0.0.1:{args.port}/metrics", flush=True)
    print(f"following {', '.join(args.endpoints)}", file=sys.stderr, flush=True)

    batches = 0
    start = last = time.monotonic()
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
            elif isinstance(item, Anomaly) and item.needs_reset and item.dp_rank is not None:
                index.reset_worker((item.source, item.dp_rank))
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
    # The same counters without Prometheus: plain dicts.
    print({"subscriber": stats_snapshot(sub.stats), "index": stats_snapshot(index.stats)})


if __name__ == "__main__":
    main()
