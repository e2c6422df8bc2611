"""``kvevents record``: subscribe to publishers and write every frame to a capture file.

May import the consumers (subscriber, ZMQ source), :mod:`kvevents.capture`, the codec,
:mod:`kvevents.endpoints`, :mod:`kvevents.jetstream.cli` (all lazily, so the parser loads
fast) and the CLI's shared helpers.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections import Counter
from typing import Any

from kvevents.cli.common import print_anomaly, stop_on_signals
from kvevents.cli.progress import StatusLine
from kvevents.errors import ConfigError

__all__ = ["cmd_record"]


def cmd_record(args: argparse.Namespace) -> int:
    """Run ``kvevents record``: every frame each publisher sends goes to the capture as
    it is read off the socket, before anything decodes it (:mod:`kvevents.cli.rawtap`);
    the subscriber on top repairs gaps by replay and reports anomalies.  From JetStream
    the batches are written as the JetStream subscriber delivers them."""
    from kvevents.capture import CaptureWriter
    from kvevents.cli.rawtap import FrameRecorder, RecordingSource
    from kvevents.consumers import Anomaly, ReceivedBatch, Subscriber
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
    if from_jetstream:
        meta["stream"] = args.stream
    stop = threading.Event()
    status = StatusLine(sys.stderr, enabled=not args.quiet)
    gaps: Counter[str] = Counter()
    start = time.monotonic()
    deadline = start + args.duration if args.duration is not None else None
    topic = args.topic.encode("utf-8")
    recorder = FrameRecorder(max_batches=args.count)
    sub: Any
    sources: list[RecordingSource] = []
    # The sockets open first: an endpoint that cannot be opened leaves OUTPUT untouched.
    if from_jetstream:
        sub = open_jetstream_subscriber(list(args.endpoints), args.stream)
    else:
        try:
            for i, ep in enumerate(args.endpoints):
                sources.append(RecordingSource(ep, recorder, topic, replay[i] if replay else None))
        except BaseException:
            for src in sources:
                src.close()
            raise
        sub = Subscriber(sources)
    written = 0
    try:
        with CaptureWriter(
            args.output, meta=meta, append=args.append, overwrite=args.force
        ) as writer:
            recorder.writer = writer
            with stop_on_signals(stop):
                draining = False
                while True:
                    now = time.monotonic()
                    if recorder.full:
                        # --count reached: report the anomalies the frames already read
                        # brought; read nothing more
                        item = None if from_jetstream else sub.take()
                        if item is None:
                            break
                    elif draining or stop.is_set() or (deadline is not None and now >= deadline):
                        draining = True  # keep what the sockets already hold
                        item = sub.receive(timeout=0)
                        if item is None:
                            break
                    else:
                        wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - now))
                        item = sub.receive(timeout=wait)
                    if from_jetstream and isinstance(item, ReceivedBatch):
                        # no raw socket to tap: the batch as delivered
                        writer.write(
                            item.source,
                            item.topic,
                            item.seq,
                            item.payload,
                            recv_ts=item.recv_ts,
                            replayed=item.replayed,
                        )
                        recorder.batches += 1
                        recorder.events += len(item.batch.events)
                    elif isinstance(item, Anomaly):
                        gaps[item.kind] += 1
                        if not args.quiet:
                            status.done()
                            print_anomaly(item, sys.stderr)
                    elapsed = max(time.monotonic() - start, 1e-9)
                    status.update(
                        f"recording {args.output}: {recorder.batches} batches, "
                        f"{recorder.events} events, {gaps['gap']} gaps "
                        f"({sub.stats.replayed_batches} replayed, {sub.stats.lost_batches} "
                        f"lost), {recorder.events / elapsed:,.0f} events/s"
                    )
            written = writer.records_written
    finally:
        sub.close()
        status.done()
    elapsed = time.monotonic() - start
    if not from_jetstream:
        silent = [src for src in sources if not src.frames]
        if silent and len(silent) == len(sources) and not any(s.connected for s in silent):
            # nothing at all: say so, exit 1, and leave no empty capture behind
            if not args.append and written == 0:
                os.remove(args.output)
            what = ", ".join(
                f"{s.endpoint} ({_why_silent(s.endpoint, args.listen)})" for s in silent
            )
            left = f"nothing written to {args.output}" if written == 0 else f"{args.output} kept"
            verb = "no engine connected to" if args.listen else "no publisher was heard on"
            print(f"kvevents: error: {verb} {what} in {elapsed:.1f} s; {left}", file=sys.stderr)
            return 1
        for src in silent:
            if src.connected:
                print(
                    f"kvevents: warning: {src.endpoint} connected but sent nothing in "
                    f"{elapsed:.1f} s (an idle engine publishes only when its KV cache changes)",
                    file=sys.stderr,
                )
            else:
                verb = "no engine connected to" if args.listen else "no publisher was heard on"
                print(
                    f"kvevents: warning: {verb} {src.endpoint} in {elapsed:.1f} s "
                    f"({_why_silent(src.endpoint, args.listen)})",
                    file=sys.stderr,
                )
    anomalies = ", ".join(f"{k} x{n}" for k, n in sorted(gaps.items())) or "none"
    kept = []
    if recorder.copies:
        kept.append(f"{recorder.copies} copies of batches already written")
    if recorder.undecodable:
        kept.append(f"{recorder.undecodable} undecodable frame(s) kept")
    if recorder.malformed:
        kept.append(f"{recorder.malformed} malformed message(s) kept")
    print(
        f"recorded {written} records ({recorder.batches} batches, {recorder.events} events"
        + "".join(", " + k for k in kept)
        + f") from {len(args.endpoints)} endpoint(s) in {elapsed:.1f} s to {args.output}; "
        f"anomalies: {anomalies}",
        file=sys.stderr,
    )
    return 0


def _why_silent(endpoint: str, listening: bool) -> str:
    """Why an endpoint may have stayed silent, as far as this host can tell."""
    if listening:
        return "nothing connected"
    host = endpoint.partition("://")[2].rpartition(":")[0].strip("[]")
    if endpoint.startswith("tcp://") and host and host != "*":
        try:
            socket.getaddrinfo(host, None)
        except (OSError, UnicodeError):
            return "the host name does not resolve"
    return "no connection was made"
