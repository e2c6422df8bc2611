"""The ``kvevents`` command line: ``record``, ``inspect``, ``replay`` and ``demo``.

Each subcommand imports what it needs lazily, so ``kvevents inspect`` starts fast and
never imports torch.  Exit status: 0 on success, 2 for a usage or input error (with a
one-line ``kvevents: error: ...`` on stderr), 130 when interrupted where a command has
nothing to save.  Progress (a bar or a status line) goes to stderr, and only when stderr
is a terminal.  Also runnable as ``python -m kvevents``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import IO, Any

from kvevents.errors import ConfigError, KVEventsError, require_module

__all__ = ["build_parser", "main"]


# --- shared helpers ----------------------------------------------------------------------
@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Set ``stop`` on SIGINT/SIGTERM while the block runs (main thread only), so a
    long-running command can finish cleanly instead of dying mid-write."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


class _StatusLine:
    """A single self-overwriting status line (a live counter) on a terminal; silent when
    the stream is not a terminal."""

    def __init__(self, stream: IO[str], interval_s: float = 0.5, enabled: bool = True) -> None:
        self.stream = stream
        self.interval_s = interval_s
        self.tty = _is_tty(stream)
        self.enabled = enabled and self.tty
        self._last = 0.0
        self._width = 0

    def update(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < self.interval_s):
            return
        self._last = now
        pad = max(0, self._width - len(text))
        self.stream.write("\r" + text + " " * pad)
        self._width = len(text)
        self.stream.flush()

    def done(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


def _json_default(value: Any) -> Any:
    """JSON for what ``json`` cannot encode itself (bytes in capture metadata)."""
    if isinstance(value, (bytes, bytearray)):
        return {"hex": bytes(value).hex()}
    return str(value)


def _print_anomaly(anomaly: Any, stream: IO[str]) -> None:
    rank = "?" if anomaly.dp_rank is None else anomaly.dp_rank
    span = ""
    if anomaly.first_seq is not None:
        span = f" seq {anomaly.first_seq}"
        if anomaly.last_seq is not None and anomaly.last_seq != anomaly.first_seq:
            span += f"..{anomaly.last_seq}"
    detail = f": {anomaly.detail}" if anomaly.detail else ""
    print(f"anomaly {anomaly.kind} {anomaly.source}#{rank}{span}{detail}", file=stream)


# --- record ------------------------------------------------------------------------------
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


def _cmd_record(args: argparse.Namespace) -> int:
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
    status = _StatusLine(sys.stderr, enabled=not args.quiet)
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
            _stop_on_signals(stop),
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
                        _print_anomaly(item, sys.stderr)
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


# --- inspect -----------------------------------------------------------------------------
def _cmd_inspect(args: argparse.Namespace) -> int:
    from kvevents.capture import CaptureReader
    from kvevents.inspection import (
        CaptureValues,
        EventFilter,
        dumps_event,
        format_event,
        iter_events,
        summarize,
    )

    flt = EventFilter(type=args.type, medium=args.medium, group=args.group, worker=args.worker)
    values = CaptureValues()
    with CaptureReader(args.file) as reader:
        if args.summary:
            records = _with_byte_progress(reader, args.file, "summarizing")
            summary = summarize(records, flt, values if flt.active else None)
            summary.tail_error = reader.tail_error
            summary.meta = dict(reader.meta)
            if flt.active and summary.events == 0:
                values.check(flt)  # a value the capture does not hold: say which it holds
            if args.json:
                out = summary.to_json()
                out["skipped_ranges"] = _skipped_json(reader.skipped)
                print(json.dumps(out, default=_json_default))
            else:
                print(summary.to_text())
            shown = summary.events
        else:
            errors: list[Any] = []
            shown = 0
            for ev in iter_events(reader, errors=errors):
                if flt.active:
                    values.observe(ev)
                    if not flt.matches(ev):
                        continue
                print(dumps_event(ev) if args.json else format_event(ev))
                shown += 1
                if args.limit is not None and shown >= args.limit:
                    break
            for rec, reason in errors:
                print(
                    f"undecodable frame seq={rec.seq} from {rec.source}: {reason}", file=sys.stderr
                )
        _warn_skipped(args.file, reader.skipped, "read")
    if flt.active and shown == 0:
        values.check(flt)
        print("no event matched all the filters together", file=sys.stderr)
    return 0


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"want a whole number >= 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a number of seconds > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"want a number of seconds > 0, got {value:g}")
    return value


def _group_index(text: str) -> int:
    """argparse type: a KV-cache group index (an integer >= 0)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a group index (0, 1, ...), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"want a group index (0, 1, ...), got {value}")
    return value


def _with_byte_progress(reader: Any, path: str, desc: str) -> Iterator[Any]:
    """``reader``'s records, with a progress bar over the file's bytes on a terminal."""
    try:
        total = os.path.getsize(path)
    except OSError:
        total = 0
    bar = _progress(total, desc, unit="B", disable=False)
    done = reader.good_bytes
    bar.update(done)
    try:
        for i, rec in enumerate(reader):
            if i % 256 == 0:
                bar.update(reader.good_bytes - done)
                done = reader.good_bytes
            yield rec
        bar.update(reader.good_bytes - done)
    finally:
        bar.close()


def _warn_skipped(path: str, skipped: Sequence[Any], verb: str) -> None:
    """One warning line per damaged byte range a reader skipped."""
    for rng in skipped:
        print(
            f"warning: {path}: skipped bytes {rng.start}..{rng.end} ({rng.reason}); "
            f"the records around it were {verb}",
            file=sys.stderr,
        )


def _skipped_json(skipped: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"start": r.start, "end": r.end, "reason": r.reason} for r in skipped]


# --- replay ------------------------------------------------------------------------------
def _cmd_replay(args: argparse.Namespace) -> int:
    if args.into_index == bool(args.publish):
        raise ConfigError("replay needs exactly one of --into-index or --publish ENDPOINT")
    if args.into_index:
        return _replay_into_index(args)
    from kvevents.jetstream.cli import is_nats_url, publish_capture

    if any(is_nats_url(t) for t in args.publish):
        if len(args.publish) != 1:
            raise ConfigError("--publish nats://URL takes one URL (the stream holds every engine)")
        appended, dups = publish_capture(args.file, args.publish[0], args.stream, args.source)
        print(
            f"appended {appended} batches to {args.stream} at {args.publish[0]} "
            f"({dups} already stored)",
            file=sys.stderr,
        )
        return 0
    return _replay_publish(args)


def _replay_into_index(args: argparse.Namespace) -> int:
    from kvevents.consumers import Anomaly, BlockIndex, CaptureSource, ReceivedBatch, Subscriber

    source = CaptureSource(args.file, name=f"capture:{args.file}")
    sub = Subscriber([source])
    index = BlockIndex(blocks_per_chunk=args.blocks_per_chunk)
    anomalies: list[Any] = []
    try:
        total = os.path.getsize(args.file)
    except OSError:
        total = 0
    bar = _progress(total, "replaying", unit="B", disable=args.quiet)
    done = n = 0
    try:
        while True:
            item = sub.receive(timeout=1.0)
            if item is None:
                if source.exhausted:
                    break
                continue
            n += 1
            if n % 256 == 0:
                bar.update(source.bytes_read - done)
                done = source.bytes_read
            if isinstance(item, ReceivedBatch):
                index.apply(item.source, item.dp_rank, item.batch)
            elif isinstance(item, Anomaly):
                anomalies.append(item)
                if item.needs_reset:
                    index.reset_worker((item.source, item.dp_rank or 0))
    finally:
        bar.close()
        sub.close()
    summary = index.summary()
    _warn_skipped(args.file, source.skipped, "replayed")
    if args.json:
        out = _index_json(index, summary, anomalies, source.tail_error)
        out["skipped_ranges"] = _skipped_json(source.skipped)
        print(json.dumps(out))
        return 0
    print(_index_text(index, summary, sub.stats))
    if anomalies:
        print(f"anomalies ({len(anomalies)}):")
        for a in anomalies:
            _print_anomaly(a, sys.stdout)
    else:
        print("anomalies: none")
    return 0


def _index_text(index: Any, summary: dict[Any, Any], sub_stats: Any) -> str:
    st = index.stats
    lines = [
        f"index: {len(summary)} worker(s), {st.batches} batches, "
        f"{getattr(st, 'applied', getattr(st, 'events', 0))} events applied; "
        f"{sub_stats.replayed_batches} replayed, {sub_stats.lost_batches} lost",
        f"{'worker':<40} {'tier':<8} {'entries':>9} {'tokens':>10}",
    ]
    for wid, ws in summary.items():
        name = f"{wid[0]}#{wid[1]}"
        for tier, ts in ws.tiers.items():
            lines.append(f"{name:<40} {tier:<8} {ts.entries:>9,} {ts.tokens:>10,}")
            name = ""
        bpc = ws.blocks_per_chunk if ws.blocks_per_chunk is not None else "?"
        lines.append(
            f"{'':<40} groups {ws.groups}, blocks_per_chunk {bpc}, "
            f"metadata kept {ws.retained_metadata:,}"
        )
    lines.append(
        f"joins: {st.joined} CPU/STORAGE chunks joined to GPU metadata ({st.joined_late} late), "
        f"{sum(st.unjoined.values())} unjoined" + (f" {dict(st.unjoined)}" if st.unjoined else "")
    )
    if st.unknown_removals:
        lines.append(f"removals of unknown hashes: {dict(st.unknown_removals)}")
    if st.skipped:
        lines.append(f"skipped: {dict(st.skipped)}")
    return "\n".join(lines)


def _index_json(
    index: Any, summary: dict[Any, Any], anomalies: list[Any], tail_error: str | None
) -> dict[str, Any]:
    st = index.stats
    return {
        "workers": [
            {
                "source": wid[0],
                "dp_rank": wid[1],
                "groups": ws.groups,
                "blocks_per_chunk": ws.blocks_per_chunk,
                "tiers": {
                    t: {"entries": s.entries, "tokens": s.tokens} for t, s in ws.tiers.items()
                },
                "retained_metadata": ws.retained_metadata,
            }
            for wid, ws in summary.items()
        ],
        "stats": {k: (dict(v) if isinstance(v, Counter) else v) for k, v in vars(st).items()},
        "anomalies": [
            {
                "kind": a.kind,
                "source": a.source,
                "dp_rank": a.dp_rank,
                "first_seq": a.first_seq,
                "last_seq": a.last_seq,
                "detail": a.detail,
            }
            for a in anomalies
        ],
        "tail_error": tail_error,
    }


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, *, unit: str = "batch", disable: bool) -> Any:
    """A tqdm bar on stderr, or a no-op when disabled or stderr is not a terminal."""
    if disable or not _is_tty(sys.stderr):
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # a core dependency; a trimmed install just has no bar
        return _NoBar()
    return tqdm(
        total=total or None,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        file=sys.stderr,
        leave=False,
    )


def _replay_publish(args: argparse.Namespace) -> int:
    from kvevents.capture import CaptureReader
    from kvevents.codec import BatchDecoder
    from kvevents.endpoints import require_bind
    from kvevents.errors import DecodeError
    from kvevents.publishers import KVEventsConfig, create_publisher

    if args.speed is not None and not args.speed > 0:
        raise ConfigError(f"--speed must be a number > 0, got {args.speed:g}")
    for flag, value in (("--wait-subscribers", args.wait_subscribers), ("--hold", args.hold)):
        if not value >= 0:
            raise ConfigError(f"{flag} must be a number of seconds >= 0, got {value:g}")
    for endpoint in args.publish:
        require_bind(endpoint, "kvevents replay --publish")
    with CaptureReader(args.file) as reader:
        records = list(reader)
        skipped_ranges = list(reader.skipped)
    if args.source is not None:
        recorded = sorted({r.source for r in records})
        records = [r for r in records if r.source == args.source]
        if not records:
            raise ConfigError(
                f"--source {args.source}: no such publisher in the capture; recorded: "
                + (", ".join(recorded) or "none (the capture is empty)")
            )
    sources: list[str] = []
    for r in records:
        if r.source not in sources:
            sources.append(r.source)
    if len(sources) > len(args.publish):
        listing = "\n  ".join(sources)
        raise ConfigError(
            f"the capture holds {len(sources)} publishers; give one --publish endpoint each "
            f"(in this order) or pick one with --source:\n  {listing}"
        )
    replay_eps = args.replay_endpoint or []
    if replay_eps and len(replay_eps) != len(args.publish):
        raise ConfigError("give one --replay-endpoint per --publish endpoint")
    decoder = BatchDecoder()
    publishers: dict[tuple[str, int], Any] = {}
    last_seq: dict[tuple[str, int], int] = {}
    stop = threading.Event()
    status = _StatusLine(sys.stderr, enabled=not args.quiet)
    sent = skipped = events = 0
    skip_reasons: Counter[str] = Counter()
    first_ts = records[0].recv_ts if records else 0.0
    start = time.monotonic()
    # The schedule: record i is due at anchor + (recv_ts_i - first_ts) / speed.  The anchor
    # is set when the first batch goes out, and moves by every --wait-subscribers pause
    # taken later, so the waits never eat into the recorded gaps.
    anchor: float | None = None
    try:
        with _stop_on_signals(stop):
            for rec in records:
                if stop.is_set():
                    break
                try:
                    batch = decoder.decode(rec.payload)
                except DecodeError:
                    skipped += 1
                    skip_reasons["undecodable"] += 1
                    continue
                rank = batch.data_parallel_rank or 0
                key = (rec.source, rank)
                if rec.seq >= 0 and rec.seq <= last_seq.get(key, -1):
                    skipped += 1
                    skip_reasons["duplicate"] += 1
                    continue
                last_seq[key] = rec.seq
                pub = publishers.get(key)
                if pub is None:
                    i = sources.index(rec.source)
                    cfg = KVEventsConfig(
                        enable_kv_cache_events=True,
                        publisher="zmq",
                        endpoint=args.publish[i],
                        replay_endpoint=replay_eps[i] if replay_eps else None,
                        buffer_steps=args.buffer_steps,
                        topic=rec.topic.decode("utf-8", "replace"),
                    )
                    pub = publishers[key] = create_publisher(cfg, data_parallel_rank=rank)
                    if not args.quiet:
                        status.done()
                        rep = getattr(pub, "replay_endpoint", None)
                        print(
                            f"publishing {rec.source}#{rank} on {getattr(pub, 'endpoint', '?')}"
                            + (f" (replay {rep})" if rep else ""),
                            file=sys.stderr,
                        )
                    if args.wait_subscribers > 0:
                        waited = time.monotonic()
                        stop.wait(args.wait_subscribers)
                        if anchor is not None:
                            anchor += time.monotonic() - waited
                if anchor is None:
                    anchor = time.monotonic()
                if not args.max_rate:
                    due = (rec.recv_ts - first_ts) / (args.speed or 1.0)
                    delay = anchor + due - time.monotonic()
                    if delay > 0 and stop.wait(delay):
                        break
                pub.publish(batch)
                sent += 1
                events += len(batch.events)
                elapsed = max(time.monotonic() - anchor, 1e-9)
                status.update(
                    f"replaying {args.file}: {sent}/{len(records)} batches, {events} events, "
                    f"{events / elapsed:,.0f} events/s"
                )
            if args.hold > 0 and publishers and not stop.is_set():
                status.done()
                if not args.quiet:
                    print(f"holding the replay buffers for {args.hold:g} s", file=sys.stderr)
                stop.wait(args.hold)
    finally:
        status.done()
        for pub in publishers.values():
            pub.shutdown()
    reasons = ", ".join(f"{k} x{n}" for k, n in sorted(skip_reasons.items()))
    print(
        f"republished {sent} batches ({events} events) from {args.file} in "
        f"{time.monotonic() - start:.1f} s"
        + (f"; skipped {skipped} ({reasons})" if skipped else ""),
        file=sys.stderr,
    )
    _warn_skipped(args.file, skipped_ranges, "sent")
    return 0


# --- demo --------------------------------------------------------------------------------
def _demo_engine(args: argparse.Namespace, default: Any) -> Any:
    """The demo's engine shape with the command-line overrides, or None if none given."""
    from dataclasses import replace

    from kvevents.sim import KVCacheGroupSpec

    changes: dict[str, Any] = {}
    if args.block_sizes:
        try:
            sizes = [int(x) for x in args.block_sizes.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(
                f"--block-sizes wants integers like 16,32, got {args.block_sizes!r}"
            ) from None
        if not sizes:
            raise ConfigError("--block-sizes needs at least one block size")
        changes["groups"] = tuple(KVCacheGroupSpec(b) for b in sizes)
    for flag, name in (
        ("gpu_blocks", "num_gpu_blocks"),
        ("cpu_chunks", "num_cpu_chunks"),
        ("blocks_per_chunk", "blocks_per_chunk"),
        ("cpu_policy", "cpu_cache_policy"),
    ):
        value = getattr(args, flag)
        if value is not None:
            changes[name] = value
    if not changes:
        return None
    engine = replace(default, **changes)
    engine.validate()
    return engine


def _cmd_demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvevents.demo import (
        DemoConfig,
        format_report,
        report_to_json,
        run_demo,
        write_plot,
    )

    base = DemoConfig.quick() if args.quick else DemoConfig()
    overrides: dict[str, Any] = {}
    for name in ("engines", "requests", "seed", "dp_ranks"):
        value = getattr(args, name)
        if value is not None:
            overrides[name] = value
    if args.policy:
        overrides["policies"] = tuple(dict.fromkeys(args.policy))
    if args.endpoint and args.host is not None:
        raise ConfigError("give --endpoint (its host included) or --host, not both")
    if args.endpoint:
        overrides["bind"] = args.endpoint
    else:
        host = "127.0.0.1" if args.host is None else args.host.strip() or "*"
        overrides["bind"] = f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"
    if args.device:
        dev = args.device
        if dev != "cpu" and dev != "cuda" and not (dev[5:].isdigit() and dev[:5] == "cuda:"):
            raise ConfigError(f"--device wants cpu, cuda or cuda:N, got {dev!r}")
        overrides["device"] = args.device
        if args.device != "cpu":
            require_module("torch", "offload", f"--device {args.device}")
    plot_dir = os.path.dirname(args.plot) if args.plot else ""
    if plot_dir and not os.path.isdir(plot_dir):  # fail before the run, not after it
        raise ConfigError(f"--plot {args.plot}: directory {plot_dir} does not exist")
    if args.record:
        overrides["record_path"] = args.record
    engine = _demo_engine(args, base.engine_config())
    if engine is not None:
        overrides["engine"] = engine
    hold = args.hold if args.hold is not None else (2.0 if args.endpoint else 0.0)
    if hold < 0:
        raise ConfigError("--hold must be >= 0")
    overrides["hold_s"] = hold
    config = replace(base, **overrides)
    status = _StatusLine(sys.stderr, enabled=not args.quiet)

    def progress(policy: str, done: int, total: int) -> None:
        status.update(f"demo: {policy}: {done}/{total} requests routed", force=done == total)

    def on_start(policy: str, cluster: Any) -> None:
        if args.quiet:
            return
        status.done()
        print(f"demo: {policy}: {len(cluster.workers)} engine rank(s) publishing:", file=sys.stderr)
        for w in cluster.workers:
            print(
                f"  {w.engine.name:<14} {w.endpoint}  replay {w.replay_endpoint}",
                file=sys.stderr,
            )

    try:
        report = run_demo(config, progress=progress, on_start=on_start)
    finally:
        status.done()
    if importlib.util.find_spec("torch") is None and report.engine.num_cpu_chunks:
        report.notes.append(
            "CPU tier without byte copies: torch is not installed (hit rates and events are "
            "the same; pip install 'kvevents[offload]' to move real bytes)"
        )
    # The results come first: a plot that cannot be written loses nothing.
    why_not: str | None = "no --plot file"
    plot_error: str | None = None
    if args.json:
        if args.plot:
            why_not, plot_error = _write_plot(write_plot, report, args.plot)
        out = report_to_json(report)
        out["plot"] = None if why_not else args.plot
        print(json.dumps(out), flush=True)
    else:
        print(format_report(report), flush=True)
        if args.plot:
            why_not, plot_error = _write_plot(write_plot, report, args.plot)
            if plot_error is None:
                print(f"plot skipped: {why_not}" if why_not else f"plot written to {args.plot}")
    if plot_error is not None:
        print(f"kvevents: error: {plot_error}", file=sys.stderr)
        return 2
    return 0


def _write_plot(write_plot: Any, report: Any, path: str) -> tuple[str | None, str | None]:
    """Write the demo's plot: (why it was skipped or None, an error line or None)."""
    try:
        return write_plot(report, path), None
    except Exception as exc:  # unwritable path, a format matplotlib lacks, ...: the
        # results are already computed (and printed in text mode), so one line suffices
        return "not written", f"--plot {path}: the plot was not written: {exc}"


def _cmd_relay(args: argparse.Namespace) -> int:
    from kvevents.jetstream.cli import run_relay

    stop = threading.Event()
    with _stop_on_signals(stop):
        return run_relay(args, stop)


# --- parser ------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (``kvevents inspect: error: ...``) instead of the
    usage block; ``--help`` still shows the usage."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from kvevents import __version__

    parser = _Parser(
        prog="kvevents",
        description="Record, inspect and replay vLLM KV-cache event streams; run the demo.",
    )
    parser.add_argument("--version", action="version", version=f"kvevents {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser(
        "record",
        help="subscribe to publishers and write a capture file",
        description="Subscribe to one or more publishers (gaps are repaired by replay when a "
        "replay endpoint is given) and write every batch to a capture file (a frame that "
        "does not decode is kept too, flagged).  Stops on "
        "Ctrl-C / SIGTERM, after --duration seconds or --count batches; the file is "
        "always left complete.",
    )
    p.add_argument(
        "endpoints",
        nargs="+",
        metavar="ENDPOINT",
        help="publisher PUB endpoint(s) to connect to, e.g. tcp://ENGINE_HOST:5557 "
        "(an engine with vLLM's default tcp://*:5557 binds there)",
    )
    p.add_argument(
        "--listen",
        action="store_true",
        help="listen on the ENDPOINT(s) (tcp://*:PORT) for engines whose endpoint connects "
        "out (tcp://THIS_HOST:PORT) instead of connecting to engines that bind",
    )
    p.add_argument("-o", "--output", required=True, help="capture file to write (.kvcap)")
    p.add_argument(
        "--append",
        action="store_true",
        help="continue an existing capture at its end (intact records are never cut; only "
        "an incomplete last record is)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUTPUT if it exists (without --force or --append, an existing file "
        "is refused and left untouched)",
    )
    p.add_argument(
        "--replay-endpoint",
        action="append",
        metavar="ENDPOINT",
        help="replay (ROUTER) endpoint, once per ENDPOINT in the same order",
    )
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    p.add_argument(
        "--stream",
        default="KV_EVENTS",
        help="JetStream stream to read when ENDPOINT is nats://HOST:PORT (default KV_EVENTS)",
    )
    p.add_argument(
        "--from-start",
        action="store_true",
        help="fetch each publisher's buffered history from seq 0 when first seen "
        "(now always done; kept for compatibility)",
    )
    stop = p.add_mutually_exclusive_group()
    stop.add_argument(
        "--duration", type=_positive_seconds, metavar="S", help="stop after S seconds"
    )
    stop.add_argument("--count", type=_positive_int, metavar="N", help="stop after N batches")
    p.add_argument("-q", "--quiet", action="store_true", help="no status line")
    p.set_defaults(func=_cmd_record)

    p = sub.add_parser("inspect", help="print the events of a capture file")
    p.add_argument("file", help="capture file (.kvcap)")
    p.add_argument("--json", action="store_true", help="JSON lines instead of text")
    p.add_argument("--summary", action="store_true", help="counts by type, medium, group, worker")
    p.add_argument(
        "--type", help="only this event type (BlockStored, BlockRemoved, AllBlocksCleared)"
    )
    p.add_argument("--medium", help="only this medium (GPU, CPU, STORAGE)")
    p.add_argument("--group", type=_group_index, help="only this KV-cache group (0, 1, ...)")
    p.add_argument("--worker", help="only this source, or source#rank")
    p.add_argument("--limit", type=_positive_int, metavar="N", help="stop after N events (N >= 1)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "replay",
        help="feed a capture into a block index, or republish it over ZMQ",
        description="--into-index: apply the capture to a BlockIndex (as a live subscriber "
        "would) and print what it holds per worker and tier, and every anomaly.  "
        "--publish: republish it with the ZMQ publisher (with replay) at the recorded "
        "pace, --speed times faster, or --max-rate.",
    )
    p.add_argument("file", help="capture file (.kvcap)")
    p.add_argument("--into-index", action="store_true", help="replay into a BlockIndex")
    p.add_argument(
        "--blocks-per-chunk",
        type=int,
        metavar="N",
        help="GPU blocks per CPU chunk of the engines (default: learned from the stream)",
    )
    p.add_argument("--json", action="store_true", help="--into-index: print JSON")
    p.add_argument(
        "--publish",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="PUB endpoint to listen on, e.g. tcp://*:6700 (once per publisher in the "
        "capture; DP ranks use vLLM's port offsets)",
    )
    p.add_argument(
        "--replay-endpoint",
        action="append",
        metavar="ENDPOINT",
        help="replay ROUTER endpoint, once per --publish",
    )
    p.add_argument("--source", help="republish only this recorded publisher")
    p.add_argument(
        "--stream",
        default="KV_EVENTS",
        help="JetStream stream to append to when --publish is nats://HOST:PORT",
    )
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--speed", type=float, metavar="X", help="X times the recorded pace")
    pace.add_argument("--max-rate", action="store_true", help="as fast as possible")
    p.add_argument(
        "--buffer-steps", type=_positive_int, default=10_000, help="replay buffer length (batches)"
    )
    p.add_argument(
        "--wait-subscribers",
        type=float,
        default=0.5,
        metavar="S",
        help="pause S seconds after binding each publisher so subscribers can connect (not "
        "part of the pace: the first batch goes out after it)",
    )
    p.add_argument(
        "--hold",
        type=float,
        default=0.0,
        metavar="S",
        help="keep the publishers (and their replay buffers) up S seconds after the last batch",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser(
        "demo",
        help="simulated engines behind kvevents serve: compare routing policies over HTTP",
        description="Run simulated engines on loopback (OpenAI HTTP fronts, KV-event "
        "publishers), put kvevents serve in front with each policy (the KV-aware router, "
        "the same router fed GPU events only, round-robin, random) and send a seeded "
        "multi-turn chat workload through it with the load generator; print hit rates per "
        "tier, time to first token and throughput, and write a plot.",
    )
    p.add_argument("--quick", action="store_true", help="a few-second run")
    p.add_argument("--engines", type=_positive_int, help="number of engines")
    p.add_argument("--dp-ranks", type=_positive_int, help="data-parallel ranks per engine")
    p.add_argument("--requests", type=_positive_int, help="requests in the workload")
    p.add_argument("--seed", type=int, help="workload seed")
    p.add_argument(
        "--policy",
        action="append",
        choices=["kv-aware", "kv-aware-gpu", "round-robin", "random"],
        help="run only this policy (repeatable; default: all four; kv-aware-gpu: a "
        "KV-aware router fed GPU events only)",
    )
    p.add_argument(
        "--endpoint",
        metavar="ENDPOINT",
        help="PUB endpoint of engine 0, e.g. tcp://127.0.0.1:5557 (engine i, rank r: port + "
        "i*ranks + r; replay: port + 100 + ...); default: ephemeral ports on --host",
    )
    p.add_argument(
        "--host",
        metavar="HOST",
        help="address the engines bind (ephemeral ports): default 127.0.0.1 (loopback "
        "only); 0.0.0.0 or '*' for all interfaces",
    )
    p.add_argument(
        "--device",
        help="where the engines' simulated KV cache lives: cpu (default) or cuda",
    )
    p.add_argument(
        "--block-sizes",
        metavar="B[,B...]",
        help="KV-cache groups by block size in tokens, e.g. 16 or 16,32 (hybrid; default 16)",
    )
    p.add_argument("--gpu-blocks", type=int, metavar="N", help="GPU blocks per engine (96)")
    p.add_argument(
        "--cpu-chunks", type=int, metavar="N", help="CPU offload chunks per engine (128; 0: off)"
    )
    p.add_argument("--blocks-per-chunk", type=int, metavar="N", help="GPU blocks per CPU chunk (4)")
    p.add_argument("--cpu-policy", choices=["lru", "arc"], help="CPU cache policy (lru)")
    p.add_argument(
        "--hold",
        type=float,
        metavar="S",
        help="keep each policy's engines up S seconds before and after routing, so "
        "`kvevents record` can join and replay (default: 2 with --endpoint, else 0)",
    )
    p.add_argument(
        "--plot",
        default="kvevents-demo.png",
        metavar="FILE",
        help="PNG to write (default kvevents-demo.png; '' for none)",
    )
    p.add_argument(
        "--record",
        metavar="FILE",
        help="also write every batch the demo's subscriber receives to this capture file",
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=_cmd_demo)

    from kvevents.serve.cli import add_parsers as _add_serve_parsers

    _add_serve_parsers(sub)

    from kvevents.jetstream.cli import add_relay_parser

    add_relay_parser(sub).set_defaults(func=_cmd_relay)
    return parser


class _NotAnAnomaly(logging.Filter):
    """Drops the subscriber's own warnings: each is an ``Anomaly`` that the commands print
    (or count) themselves, so logging it too would show every anomaly twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith("kvevents.consumers.subscriber")


@contextmanager
def _cli_logging() -> Iterator[None]:
    """kvevents' warnings as ``kvevents: warning: ...`` lines on stderr, anomalies once."""
    log = logging.getLogger("kvevents")
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("kvevents: warning: %(message)s"))
    handler.addFilter(_NotAnAnomaly())
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvevents`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        with _cli_logging():
            return int(args.func(args))
    except KVEventsError as exc:
        print(f"kvevents: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `kvevents inspect f | head`
        return 0
    except OSError as exc:  # e.g. an output directory that does not exist
        print(f"kvevents: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
