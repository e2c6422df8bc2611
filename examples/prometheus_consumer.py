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
        --replay-endpoint tcp://127.0.0.1:5558 --port 9400
    curl -s http://127.0.0.1:9400/metrics | grep kvevents_

It stops on Ctrl-C, after ``--duration`` seconds, ``--count`` batches, or ``--idle``
seconds without an event.  The loop itself is ``follow_loop.py``'s, shared with the
other consumer examples.
"""

from __future__ import annotations

import argparse
import sys

from follow_loop import StopRule, add_follow_arguments, follow

from kvevents.consumers import BlockIndex, Subscriber
from kvevents.metrics import StatsCollector, start_metrics_server, stats_snapshot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_follow_arguments(p)
    p.add_argument("--port", type=int, default=9400, help="metrics port on 127.0.0.1")
    args = p.parse_args()

    index = BlockIndex()
    sub = Subscriber(args.endpoints, replay_endpoints=args.replay_endpoint)
    collector = StatsCollector()  # reads each component's .stats at every scrape
    label = ",".join(args.endpoints)
    collector.register("subscriber", sub, endpoint=label)
    collector.register("decoder", sub.decoder, endpoint=label)
    collector.register("index", index)
    start_metrics_server(args.port, collector)  # a daemon thread; loopback only
    print(f"metrics on http://127.0.0.1:{args.port}/metrics", flush=True)
    print(f"following {', '.join(args.endpoints)}", file=sys.stderr, flush=True)

    try:
        follow(sub, index, StopRule.from_args(args))
    finally:
        sub.close()
    # The same counters without Prometheus: plain dicts.
    print({"subscriber": stats_snapshot(sub.stats), "index": stats_snapshot(index.stats)})


if __name__ == "__main__":
    main()
