"""The ``kvevents relay`` command (argument parsing and the run loop)."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

from kvevents.engines import parse_engine_spec
from kvevents.errors import ConfigError
from kvevents.jetstream.naming import DEFAULT_STREAM

__all__ = ["add_relay_parser", "run_relay"]


def add_relay_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``relay`` to the ``kvevents`` subcommands; returns its parser."""
    p = sub.add_parser(
        "relay",
        help="follow engines and append their batches to a NATS JetStream stream",
        description="Subscribe to engines (catch-up from the oldest seq each still holds, gap "
        "replay, restart detection) and append every batch's raw payload, unchanged, to a "
        "JetStream stream (created if missing), subject kvevents.<engine>.<rank>.  A relay "
        "restarted later, or a second relay for redundancy, never duplicates a batch.",
    )
    p.add_argument(
        "--nats", required=True, metavar="URL", help="NATS server, e.g. nats://127.0.0.1:4222"
    )
    p.add_argument(
        "--engine",
        action="append",
        required=True,
        metavar="SPEC",
        help="NAME=[HTTP_URL,]EVENTS_ENDPOINT[,REPLAY_ENDPOINT][;dp=N][;topic=T] (repeatable; "
        "the HTTP URL is accepted and ignored)",
    )
    p.add_argument(
        "--stream", default=DEFAULT_STREAM, help=f"JetStream stream (default {DEFAULT_STREAM})"
    )
    p.add_argument(
        "--max-age", type=float, metavar="S", help="drop stored batches older than S seconds"
    )
    p.add_argument("--max-bytes", type=int, metavar="N", help="keep at most N bytes in the stream")
    p.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    p.add_argument("-q", "--quiet", action="store_true", help="no status line")
    return p


def run_relay(args: argparse.Namespace, stop: threading.Event) -> int:
    """Run ``kvevents relay`` until ``stop`` is set or ``--duration`` passes."""
    try:
        import nats  # noqa: F401
    except ImportError:
        raise ConfigError("kvevents relay needs nats-py: pip install 'kvevents[nats]'") from None
    from kvevents.jetstream.relay import JetStreamRelay

    if args.max_age is not None and args.max_age <= 0:
        raise ConfigError("--max-age must be > 0 seconds")
    if args.max_bytes is not None and args.max_bytes <= 0:
        raise ConfigError("--max-bytes must be > 0")
    engines = [parse_engine_spec(s, require_events=True) for s in args.engine]
    logging.basicConfig(level=logging.WARNING, format="kvevents relay: %(message)s")
    relay = JetStreamRelay(
        args.nats, engines, stream=args.stream, max_age_s=args.max_age, max_bytes=args.max_bytes
    )
    names = ", ".join(e.name for e in engines)
    print(f"relaying {names} into {args.stream} at {args.nats}", file=sys.stderr, flush=True)
    if args.duration is not None:
        timer = threading.Timer(args.duration, stop.set)
        timer.daemon = True
        timer.start()
    worker = threading.Thread(target=relay.run, args=(stop,), name="kvevents-relay", daemon=True)
    worker.start()
    last = 0.0
    try:
        while worker.is_alive() and not stop.wait(0.5):
            if not args.quiet and sys.stderr.isatty() and time.monotonic() - last > 1.0:
                last = time.monotonic()
                s = relay.stats
                sys.stderr.write(
                    f"\rappended {s.appended:,}  skipped {s.skipped:,}  epochs {s.epochs}  "
                )
                sys.stderr.flush()
    finally:
        stop.set()
        worker.join(10)
        relay.close()
    s = relay.stats
    print(
        f"\nrelayed {s.appended:,} batches ({s.duplicates:,} already stored, {s.skipped:,} "
        f"skipped, {s.retries} resends, {s.epochs} new epochs)",
        file=sys.stderr,
    )
    return 0
