"""The ``kvevents relay`` command (argument parsing and the run loop), and the JetStream
ends of ``kvevents record`` and ``kvevents replay``.

May import the core and :mod:`kvevents.jetstream`; nats-py is imported only when a command
connects (it is an optional extra).
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from typing import Any

from kvevents.capture import CaptureReader
from kvevents.codec import decode_batch
from kvevents.engines import parse_engine_spec
from kvevents.errors import ConfigError, DecodeError, KVEventsError
from kvevents.jetstream.connection import connect_jetstream
from kvevents.jetstream.loop import LoopThread
from kvevents.jetstream.naming import DEFAULT_STREAM, BatchHeaders, subject_for
from kvevents.jetstream.reader import JetStreamSubscriber
from kvevents.jetstream.relay import JetStreamRelay, ensure_stream
from kvevents.jetstream.snapshots import Snapshotter

__all__ = [
    "add_relay_parser",
    "is_nats_url",
    "open_jetstream_subscriber",
    "publish_capture",
    "run_relay",
]


def is_nats_url(text: str) -> bool:
    """True for ``nats://`` (and ``tls://``) server URLs."""
    return text.startswith(("nats://", "tls://"))


def open_jetstream_subscriber(urls: list[str], stream: str) -> JetStreamSubscriber:
    """A :class:`~kvevents.jetstream.JetStreamSubscriber` for ``kvevents record nats://...``."""
    if len(urls) != 1:
        raise ConfigError(
            "record from JetStream takes one nats:// URL (the stream holds every engine)"
        )
    try:
        import nats  # noqa: F401
    except ImportError:
        raise ConfigError("reading JetStream needs nats-py: pip install 'kvevents[nats]'") from None

    return JetStreamSubscriber(urls[0], stream)


def _engine_name(source: str) -> str:
    """A capture's source as a NATS subject token (``tcp://h:5557`` → ``tcp___h_5557``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", source) or "engine"


def publish_capture(
    path: str, url: str, stream: str, only_source: str | None = None
) -> tuple[int, int]:
    """Append the batches of capture ``path`` to JetStream stream ``stream`` at ``url``,
    as the relay would have: raw payloads, headers, epochs (a seq that goes back in the
    capture starts a new epoch) and message ids.  Returns ``(appended, duplicates)``."""
    try:
        import nats  # noqa: F401
    except ImportError:
        raise ConfigError(
            "publishing to JetStream needs nats-py: pip install 'kvevents[nats]'"
        ) from None

    last: dict[tuple[str, int], tuple[int, int]] = {}
    msgs: list[tuple[str, bytes, dict[str, str]]] = []
    with CaptureReader(path) as reader:
        for rec in reader:
            if rec.seq < 0 or (only_source is not None and rec.source != only_source):
                continue
            try:
                rank = decode_batch(rec.payload).data_parallel_rank or 0
            except DecodeError:
                continue
            name = _engine_name(rec.source)
            epoch, prev = last.get((name, rank), (0, -1))
            if rec.seq == prev:
                continue  # a recorded duplicate (replay overlap)
            if rec.seq < prev:
                epoch += 1
            last[(name, rank)] = (epoch, rec.seq)
            h = BatchHeaders(name, rec.topic, rank, rec.seq, epoch)
            msgs.append((subject_for(name, rank), rec.payload, h.to_nats()))

    async def send() -> tuple[int, int]:
        link = await connect_jetstream(url)
        nc = link.nc
        try:
            js = nc.jetstream()
            await ensure_stream(js, stream)
            appended = dups = 0
            for i in range(0, len(msgs), 512):
                futs = [await js.publish_async(s, p, headers=h) for s, p, h in msgs[i : i + 512]]
                for f in futs:
                    ack = await f
                    if getattr(ack, "duplicate", False):
                        dups += 1
                    else:
                        appended += 1
            return appended, dups
        finally:
            await link.close()

    loop = LoopThread("kvevents-replay-jetstream")
    try:
        return loop.run(send())
    finally:
        loop.close()


def add_relay_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``relay`` to the ``kvevents`` subcommands; returns its parser."""
    p: argparse.ArgumentParser = sub.add_parser(
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
        help="NAME=[HTTP_URL,]EVENTS_ENDPOINT[,REPLAY_ENDPOINT][;dp=N][;rank=R][;topic=T] "
        "(repeatable; N data-parallel ranks from global rank R, default 1 from 0; the HTTP "
        "URL is accepted and ignored)",
    )
    p.add_argument(
        "--stream", default=DEFAULT_STREAM, help=f"JetStream stream (default {DEFAULT_STREAM})"
    )
    p.add_argument(
        "--max-age", type=float, metavar="S", help="drop stored batches older than S seconds"
    )
    p.add_argument("--max-bytes", type=int, metavar="N", help="keep at most N bytes in the stream")
    p.add_argument(
        "--snapshot-every",
        type=int,
        metavar="N",
        help="also follow the stream with an index and store a snapshot of it every N "
        "batches in the JetStream object store KV_SNAPSHOTS (late routers load the newest)",
    )
    p.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    p.add_argument("-q", "--quiet", action="store_true", help="no status line")
    return p


def run_relay(args: argparse.Namespace, stop: threading.Event) -> int:
    """Run ``kvevents relay`` until ``stop`` is set or ``--duration`` passes."""
    try:
        import nats  # noqa: F401
    except ImportError:
        raise ConfigError("kvevents relay needs nats-py: pip install 'kvevents[nats]'") from None

    if args.max_age is not None and args.max_age <= 0:
        raise ConfigError("--max-age must be > 0 seconds")
    if args.max_bytes is not None and args.max_bytes <= 0:
        raise ConfigError("--max-bytes must be > 0")
    engines = [parse_engine_spec(s, require_events=True) for s in args.engine]
    relay = JetStreamRelay(
        args.nats, engines, stream=args.stream, max_age_s=args.max_age, max_bytes=args.max_bytes
    )
    names = ", ".join(e.name for e in engines)
    print(f"relaying {names} into {args.stream} at {args.nats}", file=sys.stderr, flush=True)
    if args.duration is not None:
        timer = threading.Timer(args.duration, stop.set)
        timer.daemon = True
        timer.start()
    failed: list[BaseException] = []

    def guarded(target: Any) -> None:
        try:
            target(stop)
        except BaseException as exc:  # reported by the main thread as one line
            failed.append(exc)
            stop.set()

    worker = threading.Thread(target=guarded, args=(relay.run,), name="kvevents-relay", daemon=True)
    worker.start()
    snapper_thread = None
    if args.snapshot_every is not None:
        snapper = Snapshotter(args.nats, args.snapshot_every, stream=args.stream)
        snapper_thread = threading.Thread(
            target=guarded, args=(snapper.run,), name="kvevents-snapshots", daemon=True
        )
        snapper_thread.start()
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
        if snapper_thread is not None:
            snapper_thread.join(10)
        relay.close()
    s = relay.stats
    if not args.quiet and sys.stderr.isatty():
        sys.stderr.write("\n")
    print(
        f"relayed {s.appended:,} batches ({s.duplicates:,} already stored, {s.skipped:,} "
        f"skipped, {s.retries} resends, {s.epochs} new epochs)",
        file=sys.stderr,
    )
    if failed:
        exc = failed[0]
        if isinstance(exc, KVEventsError):
            raise exc
        raise ConfigError(f"the relay stopped: {exc or type(exc).__name__}") from exc
    return 0
