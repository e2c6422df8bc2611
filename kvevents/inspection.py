"""Human- and machine-readable views of captured frames, and a capture summary.

Used by ``kvevents inspect``; usable on its own for notebooks and scripts.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvevents.capture import CaptureRecord, unpack_parts
from kvevents.capture_account import COPY, CaptureAccount
from kvevents.codec import BatchDecoder, describe_payload
from kvevents.errors import CaptureError, ConfigError, DecodeError
from kvevents.events import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

__all__ = [
    "EVENT_TYPES",
    "CaptureSummary",
    "CaptureValues",
    "DecodedEvent",
    "EventFilter",
    "describe_malformed",
    "dumps_event",
    "event_to_json",
    "format_event",
    "iter_events",
    "summarize",
]


@dataclass(frozen=True)
class DecodedEvent:
    """One event with where it came from."""

    record: CaptureRecord
    batch: KVEventBatch
    index: int
    event: KVEvent

    @property
    def worker(self) -> str:
        rank = self.batch.data_parallel_rank or 0
        return f"{self.record.source}#{rank}"


EVENT_TYPES: tuple[str, ...] = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
"""The event types a filter can name."""


@dataclass(frozen=True)
class EventFilter:
    """Which events to keep; ``None`` keeps all.  Matching is exact (case-insensitive
    for ``type`` and ``medium``); ``worker`` matches ``source`` or ``source#rank``."""

    type: str | None = None
    medium: str | None = None
    group: int | None = None
    worker: str | None = None

    def __post_init__(self) -> None:
        """Reject values no capture can hold (:class:`ConfigError` naming the valid ones)."""
        if self.type is not None and self.type.lower() not in {t.lower() for t in EVENT_TYPES}:
            raise ConfigError(f"unknown --type {self.type!r}; valid: {', '.join(EVENT_TYPES)}")
        if self.medium is not None and not self.medium.strip():
            raise ConfigError("--medium needs a medium such as GPU, CPU or STORAGE")
        if self.group is not None and self.group < 0:
            raise ConfigError(f"--group must be a group index >= 0, got {self.group}")
        if self.worker is not None and not self.worker.strip():
            raise ConfigError("--worker needs a source or source#rank")

    @property
    def active(self) -> bool:
        """Whether any field filters."""
        return any(v is not None for v in (self.type, self.medium, self.group, self.worker))

    def matches(self, ev: DecodedEvent) -> bool:
        e = ev.event
        if self.type is not None and type(e).__name__.lower() != self.type.lower():
            return False
        medium = _medium(e)
        if self.medium is not None and (medium or "").upper() != self.medium.upper():
            return False
        if self.group is not None and getattr(e, "group_idx", None) != self.group:
            return False
        return not (self.worker is not None and self.worker not in (ev.record.source, ev.worker))


def _listing(values: Iterable[str], limit: int = 12) -> str:
    items = sorted(values)
    if not items:
        return "none (the capture has no events)"
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


@dataclass
class CaptureValues:
    """The values a capture's events hold for each filter field, gathered while reading
    (before filtering), to tell a filter that matches nothing from a mistyped one."""

    types: set[str] = field(default_factory=set)
    media: set[str] = field(default_factory=set)
    groups: set[int] = field(default_factory=set)
    workers: set[str] = field(default_factory=set)
    sources: set[str] = field(default_factory=set)

    def observe(self, ev: DecodedEvent) -> None:
        e = ev.event
        self.types.add(type(e).__name__)
        medium = _medium(e)
        if medium is not None:
            self.media.add(medium.upper())
        group = getattr(e, "group_idx", None)
        if group is not None:
            self.groups.add(group)
        self.sources.add(ev.record.source)
        self.workers.add(ev.worker)

    def check(self, flt: EventFilter) -> None:
        """Raise :class:`ConfigError` for the first filter value the capture does not
        hold, naming the values it does hold."""
        if flt.type is not None and flt.type.lower() not in {t.lower() for t in self.types}:
            raise ConfigError(
                f"--type {flt.type}: the capture holds no such event; types in it: "
                + _listing(self.types)
            )
        if flt.medium is not None and flt.medium.upper() not in self.media:
            raise ConfigError(
                f"--medium {flt.medium}: no event of the capture has it; media in it: "
                + _listing(self.media)
            )
        if flt.group is not None and flt.group not in self.groups:
            raise ConfigError(
                f"--group {flt.group}: the capture has no such KV-cache group; groups in it: "
                + _listing(str(g) for g in self.groups)
            )
        if flt.worker is not None and flt.worker not in self.sources | self.workers:
            raise ConfigError(
                f"--worker {flt.worker}: no such worker in the capture; workers in it "
                "(source#rank, or the source alone): " + _listing(self.workers)
            )


def _medium(e: KVEvent) -> str | None:
    if isinstance(e, (BlockStored, BlockRemoved)):
        return e.medium if e.medium is not None else MEDIUM_GPU
    return None


def iter_events(
    records: Iterable[CaptureRecord],
    decoder: BatchDecoder | None = None,
    errors: list[tuple[CaptureRecord, str]] | None = None,
) -> Iterator[DecodedEvent]:
    """Decode each record's payload and yield its events in order.

    Undecodable payloads and malformed messages (:attr:`CaptureRecord.malformed`) are
    skipped; when ``errors`` is given they are appended to it with the reason.  Recorded
    replay ends (:attr:`CaptureRecord.replay_end`) hold no events and are skipped.
    """
    dec = decoder or BatchDecoder()
    for rec in records:
        if rec.replay_end:
            continue
        if rec.malformed:
            if errors is not None:
                errors.append((rec, describe_malformed(rec)))
            continue
        try:
            batch = dec.decode(rec.payload)
        except DecodeError as exc:
            if errors is not None:
                errors.append((rec, str(exc)))
            continue
        for i, e in enumerate(batch.events):
            yield DecodedEvent(rec, batch, i, e)


def describe_malformed(rec: CaptureRecord) -> str:
    """Why a :attr:`~kvevents.capture.CaptureRecord.malformed` record is not a batch, in
    one line."""
    try:
        parts = unpack_parts(rec.payload)
    except CaptureError:
        return "malformed message (its parts were not kept)"
    if not parts:  # recorded by an older kvevents, which kept no bytes of a bad reply
        return "malformed replay reply (its parts were not kept)"
    if len(parts) == 3 and not rec.replayed:
        return f"malformed message: its seq part has {len(parts[1])} bytes, expected 8"
    sizes = ", ".join(f"{len(p)}" for p in parts[:6]) + (", ..." if len(parts) > 6 else "")
    if rec.replayed:
        return (
            f"malformed replay reply: {len(parts)} part(s) of {sizes} bytes, expected "
            "[b'', (topic,) seq (8 bytes), payload]"
        )
    return (
        f"malformed message: {len(parts)} part(s) of {sizes} bytes, expected 3 "
        "[topic, seq, payload]"
    )


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def event_to_json(ev: DecodedEvent) -> dict[str, Any]:
    """A flat JSON-ready dict: record context, then ``type`` and every event field."""
    out: dict[str, Any] = {
        "recv_ts": ev.record.recv_ts,
        "source": ev.record.source,
        "topic": ev.record.topic.decode("utf-8", "replace"),
        "seq": ev.record.seq,
        "replayed": ev.record.replayed,
        "ts": ev.batch.ts,
        "dp_rank": ev.batch.data_parallel_rank,
        "type": type(ev.event).__name__,
    }
    for name in ev.event.__struct_fields__:
        out[name] = _jsonable(getattr(ev.event, name))
    return out


def _short(h: Any) -> str:
    return h.hex()[:12] if isinstance(h, bytes) else str(h)


def _hashes(hs: list[Any]) -> str:
    if len(hs) <= 3:
        return "[" + ", ".join(_short(h) for h in hs) + "]"
    return f"[{_short(hs[0])}, ... {_short(hs[-1])}] ({len(hs)})"


def format_event(ev: DecodedEvent) -> str:
    """One readable line per event."""
    e = ev.event
    head = f"seq={ev.record.seq:<6} {ev.worker:<28} "
    if isinstance(e, BlockStored):
        parts = [
            f"BlockStored  {_medium(e):<7}",
            f"group={e.group_idx}",
            f"hashes={_hashes(e.block_hashes)}",
            f"parent={_short(e.parent_block_hash) if e.parent_block_hash is not None else '-'}",
            f"block_size={e.block_size}",
            f"tokens={len(e.token_ids)}",
        ]
        if e.block_size == 0 and not e.token_ids:
            parts.append("(placeholder)")
        if e.kv_cache_spec_kind:
            parts.append(f"kind={e.kv_cache_spec_kind}")
        if e.lora_name:
            parts.append(f"lora={e.lora_name}")
        if e.locality or e.ownership:
            parts.append(f"locality={e.locality} ownership={e.ownership}")
        return head + " ".join(parts)
    if isinstance(e, BlockRemoved):
        return head + (
            f"BlockRemoved {_medium(e):<7} group={e.group_idx} hashes={_hashes(e.block_hashes)}"
        )
    return head + "AllBlocksCleared"


@dataclass
class CaptureSummary:
    """Counts over a capture: what ``kvevents inspect --summary`` prints."""

    records: int = 0
    batches: int = 0
    events: int = 0
    by_type: Counter[str] = field(default_factory=Counter)
    by_medium: Counter[str] = field(default_factory=Counter)
    by_group: Counter[str] = field(default_factory=Counter)
    by_worker: Counter[str] = field(default_factory=Counter)
    producer_versions: Counter[str] = field(default_factory=Counter)
    seq_gaps: int = 0
    seq_missing: int = 0
    seq_duplicates: int = 0
    seq_restarts: int = 0
    undecodable: int = 0
    malformed: int = 0
    """Records of messages without the ``[topic, seq, payload]`` shape (kept, flagged)."""
    replay_ends: int = 0
    """Recorded ends of replays (no batch)."""
    unknown_tags: Counter[str] = field(default_factory=Counter)
    placeholders: int = 0
    placeholders_joined: int = 0
    replayed: int = 0
    first_recv_ts: float | None = None
    last_recv_ts: float | None = None
    tail_error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    """The capture header's metadata (set by the caller that has the reader)."""
    account: CaptureAccount | None = None
    """The whole file added up (set by the caller that has the reader; never filtered)."""

    def to_json(self) -> dict[str, Any]:
        out = {
            k: (dict(v) if isinstance(v, Counter) else v)
            for k, v in self.__dict__.items()
            if k != "account"
        }
        out["account"] = self.account.to_json() if self.account is not None else None
        return out

    def to_text(self) -> str:
        lines = [
            f"records {self.records}  batches {self.batches}  events {self.events}",
            f"seq gaps {self.seq_gaps} (missing {self.seq_missing})  duplicates {self.seq_duplicates}"
            f"  restarts {self.seq_restarts}  undecodable {self.undecodable}"
            + (f"  malformed {self.malformed}" if self.malformed else "")
            + (f"  replay ends {self.replay_ends}" if self.replay_ends else ""),
            f"CPU/STORAGE placeholders {self.placeholders}, joined to a GPU store "
            f"{self.placeholders_joined}",
        ]
        if self.first_recv_ts is not None and self.last_recv_ts is not None:
            lines.append(
                f"received over {self.last_recv_ts - self.first_recv_ts:.1f} s "
                f"(from {_utc(self.first_recv_ts)}); {self.replayed} record(s) came by replay"
            )
        if self.meta.get("recorder") or self.meta.get("endpoints"):
            by = self.meta.get("recorder", self.meta.get("tool", "?"))
            endpoints = self.meta.get("endpoints") or []
            lines.append(
                f"recorded by {by}"
                + (" from " + ", ".join(str(e) for e in endpoints) if endpoints else "")
            )
        for title, counter in (
            ("type", self.by_type),
            ("medium", self.by_medium),
            ("group", self.by_group),
            ("worker", self.by_worker),
            ("producer (vLLM)", self.producer_versions),
            ("unknown tags", self.unknown_tags),
        ):
            if counter:
                lines.append(f"by {title}:")
                width = max(len(k) for k in counter)
                lines.extend(f"  {k:<{width}}  {n:>9}" for k, n in counter.most_common())
        if self.tail_error:
            lines.append(f"capture tail: {self.tail_error}")
        if self.account is not None:
            lines.extend(self.account.lines())
        return "\n".join(lines)


def summarize(
    records: Iterable[CaptureRecord],
    event_filter: EventFilter | None = None,
    values: CaptureValues | None = None,
    *,
    account: CaptureAccount | None = None,
    offset: Callable[[], int] | None = None,
) -> CaptureSummary:
    """Count batches, events, copies, seq gaps and placeholder joins over ``records``.

    Seqs are followed per ``(source, dp_rank)`` by a
    :class:`~kvevents.capture_account.SeqLedger`: the first arrival of a seq is a batch,
    wherever it falls in the file (a catch-up replay brings earlier seqs after later
    ones) and its events are counted; a copy of a batch already seen (same seq, same
    payload) is a duplicate, its events not counted again; a seq seen with another
    payload, or a live seq going back, is a restart.  Seqs missing between the lowest
    and the highest of a life are the gaps.

    With ``event_filter`` only the matching events are counted, and with its ``worker``
    only that worker's records and batches; a placeholder counts as joined when a GPU
    store of its (worker, group, hash) came earlier in the capture, whether or not that
    store matches the filter.  ``values``, when given, observes every event before
    filtering.  ``account`` (with ``offset``, the file offset after the record just
    read) is fed every record, so the caller can add the file up in the same pass.
    """
    s = CaptureSummary()
    dec = BatchDecoder()
    acc = account if account is not None else CaptureAccount()
    only = event_filter.worker if event_filter is not None else None
    gpu_keys: set[tuple[str, int | None, Any]] = set()
    for rec in records:
        end = offset() if offset is not None else 0
        batch: KVEventBatch | None = None
        rank: int | None = None
        if not (rec.replay_end or rec.malformed):
            try:
                batch = dec.decode(rec.payload)
                rank = batch.data_parallel_rank or 0
            except DecodeError:
                batch = None
        verdict = acc.observe(rec, end, rank) if batch is not None else acc.observe(rec, end)
        worker = f"{rec.source}#{rank if rank is not None else 0}"
        if only is not None and only not in (rec.source, worker):
            if values is not None and batch is not None and verdict != COPY:
                for i, e in enumerate(batch.events):  # the values a filter could name
                    values.observe(DecodedEvent(rec, batch, i, e))
            continue
        s.records += 1
        s.replayed += rec.replayed
        if s.first_recv_ts is None:
            s.first_recv_ts = rec.recv_ts
        s.last_recv_ts = rec.recv_ts
        if rec.replay_end:
            s.replay_ends += 1
            continue
        if rec.malformed:
            s.malformed += 1
            continue
        if batch is None:
            s.undecodable += 1
            continue
        if verdict == COPY:
            s.seq_duplicates += 1
            continue  # its events were counted with the first arrival
        s.batches += 1
        try:
            shape = describe_payload(rec.payload)
            s.producer_versions[shape.vllm_versions or "unknown"] += 1
        except DecodeError:  # pragma: no cover - decode above already succeeded
            pass
        for i, e in enumerate(batch.events):
            ev = DecodedEvent(rec, batch, i, e)
            if values is not None:
                values.observe(ev)
            is_gpu_store = False
            if isinstance(e, BlockStored) and (e.medium or MEDIUM_GPU) == MEDIUM_GPU:
                is_gpu_store = True  # joins see every GPU store, filtered or not
                gpu_keys.update((worker, e.group_idx, h) for h in e.block_hashes)
            if event_filter is not None and not event_filter.matches(ev):
                continue
            s.events += 1
            s.by_type[type(e).__name__] += 1
            s.by_worker[worker] += 1
            if isinstance(e, (BlockStored, BlockRemoved)):
                medium = _medium(e) or MEDIUM_GPU
                s.by_medium[medium] += 1
                s.by_group[str(e.group_idx)] += 1
            if (
                isinstance(e, BlockStored)
                and not is_gpu_store
                and e.block_size == 0
                and not e.token_ids
            ):
                s.placeholders += 1
                if all((worker, e.group_idx, h) in gpu_keys for h in e.block_hashes):
                    s.placeholders_joined += 1
    for hole in acc.ledger.holes():
        if only is None or only in (hole.worker, hole.worker.rpartition("#")[0]):
            s.seq_gaps += 1
            s.seq_missing += hole.count
    s.seq_restarts = sum(
        len(lives) - 1
        for worker, lives in acc.ledger.spans().items()
        if only is None or only in (worker, worker.rpartition("#")[0])
    )
    s.unknown_tags = dec.stats.unknown_tags
    return s


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def dumps_event(ev: DecodedEvent) -> str:
    """``event_to_json`` as one JSON line."""
    return json.dumps(event_to_json(ev), separators=(",", ":"))
