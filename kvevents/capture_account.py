"""Accounting for a capture: every byte and every batch of the file, once.

One job: tell a batch's first arrival from a copy of it, and add up what a capture holds.

:class:`SeqLedger` follows each worker's seqs as the records come, in file order: a
record whose seq was already seen in the worker's current life with the same payload is a
*copy* (a replay returning a batch the live stream also brought, or the reverse); any
other seq is a *new* batch, the first arrival of that seq, wherever it falls (a
catch-up replay brings earlier seqs after later ones); a seq seen before with another
payload, or a live seq going back to one never seen, starts a new *life* (a publisher
restart).  Per life it keeps the spans of seqs seen, so the seqs missing between the
lowest and the highest are known, and where in the file the records around them were.

:class:`CaptureAccount` reads a capture through a :class:`~kvevents.capture.CaptureReader`
and adds it up: bytes (header + intact records + damaged ranges = the file's size) and
records (batches + copies + undecodable + malformed + replay ends), and for each damaged
byte range the seqs missing around it (what it held, as far as the records around it
tell).  ``kvevents inspect --summary`` and ``kvevents replay --into-index`` print the
same :meth:`CaptureAccount.lines`.

Imports only :mod:`kvevents.capture` and the codec.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvevents.capture import CaptureReader, CaptureRecord, SkippedRange
from kvevents.codec import BatchDecoder
from kvevents.errors import DecodeError

__all__ = [
    "COPY",
    "NEW",
    "RESTART",
    "CaptureAccount",
    "Damage",
    "Hole",
    "SeqLedger",
    "account_capture",
]

NEW = "new"
COPY = "copy"
RESTART = "restart"

_WINDOW = 1 << 18
"""Seqs per worker whose payload fingerprint is remembered (a replay ring is far smaller)."""


@dataclass(frozen=True)
class Hole:
    """Seqs ``first..last`` of ``worker`` missing from the capture between two it holds;
    ``after`` and ``before`` are the file offsets of the records around them."""

    worker: str
    first: int
    last: int
    after: int
    before: int

    @property
    def count(self) -> int:
        return self.last - self.first + 1

    def seqs(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}..{self.last}"


class _Life:
    """One life of one worker: payload fingerprints by seq (windowed) and the spans seen,
    each ``[lo, hi, offset of lo's record, offset of hi's record]``."""

    __slots__ = ("high_live", "los", "seen", "spans")

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}
        self.spans: list[list[int]] = []
        self.los: list[int] = []
        self.high_live = -1

    def add(self, seq: int, offset: int) -> None:
        spans = self.spans
        if spans and seq == spans[-1][1] + 1:  # the in-order fast path
            spans[-1][1], spans[-1][3] = seq, offset
            return
        i = bisect.bisect_left(self.los, seq)
        left = spans[i - 1] if i > 0 and spans[i - 1][1] + 1 == seq else None
        right = spans[i] if i < len(spans) and spans[i][0] == seq + 1 else None
        if left is not None and right is not None:
            left[1], left[3] = right[1], right[3]
            del spans[i], self.los[i]
        elif left is not None:
            left[1], left[3] = seq, offset
        elif right is not None:
            right[0], right[2] = seq, offset
            self.los[i] = seq
        else:
            spans.insert(i, [seq, seq, offset, offset])
            self.los.insert(i, seq)

    def remember(self, seq: int, fingerprint: int) -> None:
        self.seen[seq] = fingerprint
        if len(self.seen) > 2 * _WINDOW:
            floor = max(self.seen) - _WINDOW
            self.seen = {s: f for s, f in self.seen.items() if s >= floor}

    def holes(self, worker: str) -> Iterator[Hole]:
        for a, b in zip(self.spans, self.spans[1:]):
            yield Hole(worker, a[1] + 1, b[0] - 1, a[3], b[2])


class SeqLedger:
    """New batches, copies and restarts per worker (see the module docstring)."""

    def __init__(self) -> None:
        self._lives: dict[str, _Life] = {}
        self._ended: list[tuple[str, _Life]] = []
        self.restarts = 0

    def observe(
        self, worker: str, seq: int, fingerprint: int, replayed: bool, offset: int = 0
    ) -> str:
        """Classify one record: :data:`NEW`, :data:`COPY` or :data:`RESTART` (a new batch
        that starts a new life of the worker)."""
        life = self._lives.get(worker)
        verdict = NEW
        if life is None:
            life = self._lives[worker] = _Life()
        else:
            seen = life.seen.get(seq)
            if seen == fingerprint:
                return COPY
            if seen is not None or (not replayed and seq < life.high_live):
                self._ended.append((worker, life))
                life = self._lives[worker] = _Life()
                self.restarts += 1
                verdict = RESTART
        if not replayed:
            life.high_live = max(life.high_live, seq)
        life.remember(seq, fingerprint)
        life.add(seq, offset)
        return verdict

    def holes(self) -> list[Hole]:
        """The seqs missing between the lowest and highest of each life, by worker."""
        out: list[Hole] = []
        for worker, life in [*self._ended, *self._lives.items()]:
            out.extend(life.holes(worker))
        return out

    def spans(self) -> dict[str, list[tuple[int, int]]]:
        """Per worker, the seq range of each life (lowest, highest seen)."""
        out: dict[str, list[tuple[int, int]]] = {}
        for worker, life in [*self._ended, *self._lives.items()]:
            if life.spans:
                out.setdefault(worker, []).append((life.spans[0][0], life.spans[-1][1]))
        return out


@dataclass
class Damage:
    """One damaged byte range and the seqs missing around it."""

    skipped: SkippedRange
    held: list[Hole] = field(default_factory=list)


@dataclass
class CaptureAccount:
    """What a capture holds, added up (see the module docstring).  Use
    :meth:`observe` for each record a reader yields, then :meth:`finish` with the reader."""

    file_bytes: int = 0
    header_bytes: int = 0
    record_bytes: int = 0
    damaged_bytes: int = 0
    records: int = 0
    batches: int = 0
    copies: int = 0
    undecodable: int = 0
    malformed: int = 0
    replay_ends: int = 0
    damage: list[Damage] = field(default_factory=list)
    gaps: list[Hole] = field(default_factory=list)
    """Seqs missing with no damaged range between the records around them: never recorded."""
    ledger: SeqLedger = field(default_factory=SeqLedger)
    _decoder: BatchDecoder = field(default_factory=BatchDecoder)

    def observe(self, rec: CaptureRecord, offset: int, rank: int | None = None) -> str | None:
        """Count record ``rec`` ending at file ``offset``; returns its verdict (:data:`NEW`,
        :data:`COPY`, :data:`RESTART`) or None for a record that is not a batch.  ``rank``
        is the batch's DP rank when the caller decoded it already."""
        self.records += 1
        if rec.replay_end:
            self.replay_ends += 1
            return None
        if rec.malformed:
            self.malformed += 1
            return None
        if rank is None:
            try:
                rank = self._decoder.decode(rec.payload).data_parallel_rank or 0
            except DecodeError:
                self.undecodable += 1
                return None
        if rec.seq < 0:
            self.batches += 1
            return NEW
        verdict = self.ledger.observe(
            f"{rec.source}#{rank}", rec.seq, hash(rec.payload), rec.replayed, offset
        )
        if verdict == COPY:
            self.copies += 1
        else:
            self.batches += 1
        return verdict

    def start(self, reader: CaptureReader) -> None:
        """Note where the records start (call before reading any)."""
        self.header_bytes = reader.good_bytes

    def finish(self, reader: CaptureReader) -> CaptureAccount:
        """Add the damaged ranges and attribute each hole to the range between the
        records around it (or to no range: never recorded)."""
        self.file_bytes = os.path.getsize(reader.path)
        self.damage = [Damage(r) for r in reader.skipped]
        self.damaged_bytes = sum(r.end - r.start for r in reader.skipped)
        self.record_bytes = self.file_bytes - self.header_bytes - self.damaged_bytes
        for hole in self.ledger.holes():
            lo, hi = sorted((hole.after, hole.before))
            for d in self.damage:
                if lo <= d.skipped.start < hi:
                    d.held.append(hole)
                    break
            else:
                self.gaps.append(hole)
        return self

    @property
    def missing_in_damage(self) -> int:
        return sum(h.count for d in self.damage for h in d.held)

    @property
    def missing_never_recorded(self) -> int:
        return sum(h.count for h in self.gaps)

    def lines(self) -> list[str]:
        """The accounting in a few lines (the same in ``inspect`` and ``replay``)."""
        out = [
            f"file {self.file_bytes:,} bytes = header {self.header_bytes:,} + "
            f"{self.records:,} intact records {self.record_bytes:,} + "
            f"{len(self.damage)} damaged range(s) {self.damaged_bytes:,}",
            f"records {self.records:,} = {self.batches:,} batches + {self.copies:,} copies"
            f" + {self.undecodable} undecodable + {self.malformed} malformed"
            f" + {self.replay_ends} replay ends",
        ]
        if self.damage or self.gaps:
            out.append(
                f"seqs missing: {self.missing_in_damage:,} around damaged ranges, "
                f"{self.missing_never_recorded:,} never recorded"
            )
        for d in self.damage:
            r = d.skipped
            held = "; ".join(f"{h.worker} seq {h.seqs()}" for h in d.held)
            tail = " (the end of the file)" if r.end == self.file_bytes else ""
            out.append(
                f"damaged bytes {r.start}..{r.end}{tail}: {r.reason}; "
                + (f"missing around it: {held}" if held else "no seq missing around it")
            )
        for h in self.gaps:
            out.append(f"never recorded: {h.worker} seq {h.seqs()}")
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "file_bytes": self.file_bytes,
            "header_bytes": self.header_bytes,
            "record_bytes": self.record_bytes,
            "damaged_bytes": self.damaged_bytes,
            "records": self.records,
            "batches": self.batches,
            "copies": self.copies,
            "undecodable": self.undecodable,
            "malformed": self.malformed,
            "replay_ends": self.replay_ends,
            "damage": [
                {
                    "start": d.skipped.start,
                    "end": d.skipped.end,
                    "reason": d.skipped.reason,
                    "missing": [[h.worker, h.first, h.last] for h in d.held],
                }
                for d in self.damage
            ],
            "never_recorded": [[h.worker, h.first, h.last] for h in self.gaps],
        }


def account_capture(path: str | os.PathLike[str]) -> CaptureAccount:
    """Read capture ``path`` once and add it up."""
    acc = CaptureAccount()
    with CaptureReader(path) as reader:
        acc.start(reader)
        for rec in reader:
            acc.observe(rec, reader.good_bytes)
        return acc.finish(reader)
