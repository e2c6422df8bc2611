"""``kvevents record``: subscribe to publishers and write every frame to a capture file.

May import the consumers (subscriber, ZMQ source), :mod:`kvevents.capture`, the codec,
:mod:`kvevents.endpoints`, :mod:`kvevents.jetstream.cli` (all lazily, so the parser loads
fast) and the CLI's shared helpers.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections import Counter
from typing import Any

from kvevents.cli.common import print_anomaly, stop_on_signals
from kvevents.cli.progress import StatusLine
from kvevents.errors import ConfigError

__all__ = ["cmd_record"]


class _RawTap:
    """A source wrapper for ``record``: it keeps the raw messages of the source's latest
    reads, so that a frame the subscriber cannot decode is still written to the capture
    byte for byte (flagged undecodable) instead of being dropped.  The subscriber
    processes what a source returns before reading it again, and ``record`` drains every
    item in between, so the last two reads always hold the frame an anomaly names.
    Everything but :meth:`receive` is the wrapped source's own (attribute lookups are
    forwarded, optional parts of the source protocol included)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._recent: list[list[Any]] = [[], []]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def receive(self, limit: int) -> list[Any]:
        msgs: list[Any] = self.inner.receive(limit)
        if msgs:
            self._recent = [self._recent[1], msgs]
        return msgs

    def take_undecodable(self, origin: str, seq: int, replayed: bool, decoder: Any) -> Any:
        """The raw message of seq ``seq`` from ``origin`` that does not decode, or None."""
        from kvevents.consumers.sources import LIVE, REPLAY
        from kvevents.errors import DecodeError

        kind = REPLAY if replayed else LIVE
        for batch in self._recent:
            for i, msg in enumerate(batch):
                if msg.kind != kind or msg.seq != seq or (msg.origin or self.name) != origin:
                    continue
                try:
                    decoder.decode(msg.payload)
                except DecodeError:
                    del batch[i]
                    return msg
        return None


def cmd_record(args: argparse.Namespace) -> int:
    from kvevents.capture import FLAG_UNDECODABLE, CaptureWriter
    from kvevents.codec import BatchDecoder
    from kvevents.consumers import Anomaly, ReceivedBatch, Subscriber, ZmqSource
    from kvevents.consumers.subscriber import UNDECODABLE
    from kvevents.endpoints import is_wildcard_endpoint, require_connect
    from kvevents.jetstream.cli import is_nats_url, open_jetstream_subscriber

    replay = args.replay_endpoint or None
    if replay is not None and len(replay) != len(args.endpoints):
        raise ConfigError(
            f"give one --replay-endpoint per endpoint ({len(args.endpoints)}), got {len(replay)}"
        )
    from_jetstream = any(is_nats_url(e) for e in args.endpoints)
    for endpoint in [] if from_jetstream else args.endpoints:
        if not args.listen:
            require_connect(
                endpoint,
                "kvevents record",
                alternative="or pass --listen to accept engines that connect out to this host",
            )
        elif not is_wildcard_endpoint(endpoint):
            raise ConfigError(
                f"kvevents record --listen binds, but {endpoint!r} is not an address to listen "
                "on: use tcp://*:PORT (engines then publish to tcp://THIS_HOST:PORT), or drop "
                "--listen to connect to an engine that binds"
            )
    for endpoint in replay or []:
        require_connect(endpoint, "kvevents record --replay-endpoint")
    if not args.append and not args.force and os.path.exists(args.output):
        raise ConfigError(
            f"{args.output} already exists; use --append to continue it or --force to replace it"
        )
    meta = {
        "endpoints": list(args.endpoints),
        "replay_endpoints": list(replay or []),
        "topic": args.topic,
        "recorder": "kvevents record",
    }
    stop = threading.Event()
    status = StatusLine(sys.stderr, enabled=not args.quiet)
    batches = events = undecodable = 0
    gaps: Counter[str] = Counter()
    start = time.monotonic()
    deadline = start + args.duration if args.duration is not None else None
    topic = args.topic.encode("utf-8")
    taps: dict[str, _RawTap] = {}
    sub: Any
    if from_jetstream:
        sub = open_jetstream_subscriber(list(args.endpoints), args.stream)
        meta["stream"] = args.stream
    else:
        for i, ep in enumerate(args.endpoints):
            tap = _RawTap(ZmqSource(ep, topic, replay[i] if replay else None))
            taps[tap.name] = tap
        sub = Subscriber(list(taps.values()))
    decoder = BatchDecoder()
    written = 0
    try:
        with (
            CaptureWriter(
                args.output, meta=meta, append=args.append, overwrite=args.force
            ) as writer,
            stop_on_signals(stop),
        ):
            draining = False
            while True:
                if args.count is not None and batches >= args.count:
                    break
                now = time.monotonic()
                if not draining and (stop.is_set() or (deadline is not None and now >= deadline)):
                    draining = True  # keep what the subscriber already has ready
                if draining:
                    item = sub.receive(timeout=0)
                    if item is None:
                        break
                else:
                    wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - now))
                    item = sub.receive(timeout=wait)
                if isinstance(item, ReceivedBatch):
                    writer.write(
                        item.source,
                        item.topic,
                        item.seq,
                        item.payload,
                        recv_ts=item.recv_ts,
                        replayed=item.replayed,
                    )
                    batches += 1
                    events += len(item.batch.events)
                elif isinstance(item, Anomaly):
                    gaps[item.kind] += 1
                    if item.kind == UNDECODABLE and item.first_seq is not None:
                        raw = None
                        for tap in taps.values():
                            raw = tap.take_undecodable(
                                item.source,
                                item.first_seq,
                                item.detail.startswith("replayed "),
                                decoder,
                            )
                            if raw is not None:
                                break
                        if raw is not None:
                            writer.write(
                                item.source,
                                raw.topic,
                                raw.seq,
                                raw.payload,
                                recv_ts=raw.recv_ts,
                                replayed=raw.kind != "live" or raw.replayed,
                                flags=FLAG_UNDECODABLE,
                            )
                            undecodable += 1
                    if not args.quiet:
                        status.done()
                        print_anomaly(item, sys.stderr)
                elapsed = max(time.monotonic() - start, 1e-9)
                status.update(
                    f"recording {args.output}: {batches} batches, {events} events, "
                    f"{gaps['gap']} gaps ({sub.stats.replayed_batches} replayed, "
                    f"{sub.stats.lost_batches} lost), {events / elapsed:,.0f} events/s"
                )
            written = writer.records_written
    finally:
        sub.close()
        status.done()
    elapsed = time.monotonic() - start
    anomalies = ", ".join(f"{k} x{n}" for k, n in sorted(gaps.items())) or "none"
    kept = f", {undecodable} undecodable frame(s) kept" if undecodable else ""
    print(
        f"recorded {written} records ({batches} batches, {events} events{kept}) from "
        f"{len(args.endpoints)} endpoint(s) in {elapsed:.1f} s to {args.output}; "
        f"anomalies: {anomalies}",
        file=sys.stderr,
    )
    return 0
