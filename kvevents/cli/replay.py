"""``kvevents replay``: feed a capture into a block index (``--into-index``) or republish
it over ZMQ at the recorded pace (``--publish``), or append it to a JetStream stream.

May import the consumers (index, subscriber, capture source), the publishers, the codec,
:mod:`kvevents.jetstream.cli` (all lazily) and the CLI's shared helpers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from typing import Any

from xxhash import xxh3_64_intdigest

from kvevents.cli.common import print_anomaly, skipped_json, stop_on_signals, warn_skipped
from kvevents.cli.progress import StatusLine, progress
from kvevents.errors import ConfigError

__all__ = ["cmd_replay"]

# How many sent seqs per publisher ``replay --publish`` remembers to recognise a
# replayed copy of a batch it already sent.
_SENT_WINDOW = 1 << 16


def cmd_replay(args: argparse.Namespace) -> int:
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
    from kvevents.capture_account import account_capture
    from kvevents.consumers import Anomaly, BlockIndex, CaptureSource, ReceivedBatch, Subscriber

    source = CaptureSource(args.file, name=f"capture:{args.file}")
    sub = Subscriber([source])
    index = BlockIndex(blocks_per_chunk=args.blocks_per_chunk)
    anomalies: list[Any] = []
    try:
        total = os.path.getsize(args.file)
    except OSError:
        total = 0
    bar = progress(total, "replaying", unit="B", disable=args.quiet)
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
    warn_skipped(args.file, source.skipped, "replayed")
    # the file added up as `inspect --summary` does (a second, plain read of the file)
    account = account_capture(args.file)
    if args.json:
        out = _index_json(index, summary, anomalies, source.tail_error)
        out["skipped_ranges"] = skipped_json(source.skipped)
        out["account"] = account.to_json()
        print(json.dumps(out))
        return 0
    print(_index_text(index, summary, sub.stats))
    if anomalies:
        print(f"anomalies ({len(anomalies)}):")
        for a in anomalies:
            print_anomaly(a, sys.stdout)
    else:
        print("anomalies: none")
    dropped = ", ".join(f"{k} {n}" for k, n in sorted(sub.stats.dropped.items())) or "none"
    print(
        f"the index applied {index.stats.batches:,} of the capture's {account.batches:,} "
        f"batches (records the subscriber dropped: {dropped})"
    )
    print("\n".join(account.lines()))
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
    # Messages kept by the recorder without the [topic, seq, payload] shape are never
    # batches: counted as skipped, and no publisher is made for them.
    malformed = sum(r.malformed for r in records)
    records = [r for r in records if not r.malformed]
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
    # (source, rank) -> {seq: payload fingerprint} of the batches sent, the newest
    # _SENT_WINDOW per publisher: a record is a duplicate only when the same seq with the
    # same bytes was sent already (a replayed copy); a seq filled late by a replay, or
    # reused after a publisher restart with other content, is sent.
    sent_seqs: dict[tuple[str, int], dict[int, int]] = {}
    stop = threading.Event()
    status = StatusLine(sys.stderr, enabled=not args.quiet)
    sent = events = 0
    skipped = malformed
    skip_reasons: Counter[str] = Counter({"malformed": malformed} if malformed else {})
    first_ts = records[0].recv_ts if records else 0.0
    start = time.monotonic()
    # The schedule: record i is due at anchor + (recv_ts_i - first_ts) / speed.  The anchor
    # is set when the first batch goes out, and moves by every --wait-subscribers pause
    # taken later, so the waits never eat into the recorded gaps.
    anchor: float | None = None
    try:
        with stop_on_signals(stop):
            for rec in records:
                if stop.is_set():
                    break
                if rec.replay_end:
                    continue  # a recorded end-of-replay marker: nothing to send
                try:
                    batch = decoder.decode(rec.payload)
                except DecodeError:
                    skipped += 1
                    skip_reasons["undecodable"] += 1
                    continue
                rank = batch.data_parallel_rank or 0
                key = (rec.source, rank)
                if rec.seq >= 0:
                    seen = sent_seqs.setdefault(key, {})
                    fp = xxh3_64_intdigest(rec.payload)
                    if seen.get(rec.seq) == fp:
                        skipped += 1
                        skip_reasons["duplicate"] += 1
                        continue
                    seen.pop(rec.seq, None)  # (re)inserted as the newest
                    seen[rec.seq] = fp
                    if len(seen) > _SENT_WINDOW:
                        del seen[next(iter(seen))]
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
    warn_skipped(args.file, skipped_ranges, "sent")
    return 0
