"""Pure sequence tracking for one publisher stream (one ``(source, dp_rank)``).

A :class:`StreamTracker` is fed what arrived (live batches, replayed batches, the end of
a replay, a failed replay) and answers with *actions* for its caller, in the order the
caller must apply them:

* :class:`Deliver` - hand this batch to the application (strictly increasing ``seq``;
  nothing is delivered twice between two resets);
* :class:`Report` - an anomaly the application must see (``gap``, ``duplicate``,
  ``publisher_restart``, ``unrecoverable_loss``);
* :class:`Drop` - something was discarded for a benign reason (count it, do not report);
* :class:`StartReplay` - ask the publisher's replay endpoint for every batch from
  ``start`` on (C§2.2).

It does no I/O and reads no clock, so it can be tested exhaustively (see the
property tests); timeouts, concurrency and cooldown belong to the caller, which reports
a replay that cannot be done or did not finish with :meth:`StreamTracker.replay_failed`.

The rules (DESIGN §4, C§6.3, C§9.6):

* ``seq == last + 1`` is delivered.
* ``seq > last + 1`` is a gap: it is reported, the live batch is buffered and a replay
  from ``last + 1`` is requested.  While a replay runs, live batches are buffered; replayed
  and buffered batches are released in seq order, so nothing is applied twice or out of
  order.  A replayed seq ``s`` proves every seq below ``s`` that neither the replay nor the
  live stream supplied is gone: it is reported as ``unrecoverable_loss`` (this covers
  "first replayed seq > requested" as well as holes the publisher never buffered).
* At the end of a replay every hole at or below the newest seq known to be published
  before the request is reported lost; a hole above it (live traffic lost after the
  request) starts another replay.
* ``seq <= last`` (or, during a replay, below the newest live seq buffered) is a
  *duplicate* if it carries the same fingerprint as the batch
  delivered with that seq (the caller uses a hash of the payload bytes: a resent batch is
  byte-identical); otherwise the seq went backwards because the publisher restarted.  A
  restart is reported, every buffered batch of the old stream is discarded (named in the
  report), and the new stream is followed; when its first seen seq is above 0 its start is
  replayed (or reported lost).  Fingerprints are kept for the last ``history`` delivered
  seqs; an older seq is taken as a restart (a reset is safe, a silent drop is not).
* A fresh stream is followed from its first seen seq, or, with ``replay_from_start``,
  caught up by replaying from 0.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar, Union

__all__ = [
    "DUPLICATE",
    "GAP",
    "PUBLISHER_RESTART",
    "UNRECOVERABLE_LOSS",
    "Deliver",
    "Drop",
    "Report",
    "StartReplay",
    "StreamTracker",
    "TrackerAction",
]

T = TypeVar("T")

GAP = "gap"
DUPLICATE = "duplicate"
PUBLISHER_RESTART = "publisher_restart"
UNRECOVERABLE_LOSS = "unrecoverable_loss"


@dataclass(frozen=True, slots=True)
class Deliver(Generic[T]):
    """Apply ``item`` (seq ``seq``); ``replayed`` is true if it came through replay."""

    seq: int
    item: T
    replayed: bool


@dataclass(frozen=True, slots=True)
class Report:
    """An anomaly to report.  ``first_seq``..``last_seq`` (inclusive) is the seq range it
    concerns; for ``publisher_restart`` ``first_seq`` is the new stream's first seen seq and
    ``last_seq`` the old stream's last delivered seq (None if none)."""

    kind: str
    first_seq: int | None
    last_seq: int | None
    detail: str


@dataclass(frozen=True, slots=True)
class Drop:
    """A batch or reply discarded for a benign, expected reason (count it by ``reason``)."""

    seq: int | None
    reason: str


@dataclass(frozen=True, slots=True)
class StartReplay:
    """Request a replay of every buffered seq ``>= start``.  Replies and the end marker
    are passed back with ``replay_id``; a newer request supersedes an older one."""

    start: int
    replay_id: int


TrackerAction = Union[Deliver[T], Report, Drop, StartReplay]

_Pending = tuple[T, Hashable, bool]  # (item, fingerprint, replayed)


class StreamTracker(Generic[T]):
    """Sequence state of one publisher stream.  See the module docstring for the rules.

    ``history`` is how many delivered seqs keep a fingerprint (duplicate vs restart);
    ``max_pending`` bounds the live batches buffered during a replay: beyond it the replay
    is abandoned, its holes are reported lost and the buffer is released.
    """

    def __init__(
        self, *, replay_from_start: bool = False, history: int = 4096, max_pending: int = 100_000
    ) -> None:
        if history < 1 or max_pending < 1:
            raise ValueError("history and max_pending must be >= 1")
        self.last: int | None = None
        """The last delivered seq, None before the first delivery (and after a restart)."""
        self._history = history
        self._max_pending = max_pending
        self._ring: list[tuple[int, Hashable] | None] = [None] * history
        self._want_start = replay_from_start
        self._replaying = False
        self._replay_id = 0
        self._next = 0
        self._pending: dict[int, _Pending[T]] = {}
        self._heap: list[int] = []
        self._watermark = -1
        self._newest_live = -1

    @property
    def replaying(self) -> bool:
        """True while a replay is wanted (requested, queued or running)."""
        return self._replaying

    @property
    def replay_id(self) -> int:
        """The id of the current (or last) replay request."""
        return self._replay_id

    @property
    def pending(self) -> int:
        """Batches buffered while a replay runs."""
        return len(self._pending)

    def catch_up(self) -> StartReplay | None:
        """Start following a fresh stream by replay from seq 0, before any live batch.

        Returns the request to make, or None if the stream is already being followed
        (or replayed).  Replies, the end marker or a failure then go through
        :meth:`replayed`, :meth:`replay_end` and :meth:`replay_failed` as usual."""
        if self.last is not None or self._replaying:
            return None
        self._replaying = True
        self._replay_id += 1
        self._next = 0
        self._pending = {}
        self._heap = []
        self._watermark = -1
        self._newest_live = -1
        return StartReplay(0, self._replay_id)

    # --- inputs ---------------------------------------------------------------------
    def live(self, seq: int, item: T, fingerprint: Hashable) -> list[TrackerAction[T]]:
        """A batch arrived on the live stream."""
        last = self.last
        if self._replaying:
            return self._live_during_replay(seq, item, fingerprint)
        if last is None:
            if seq == 0 or not self._want_start:
                return [self._deliver(seq, item, fingerprint, False)]
            return self._begin_replay(0, seq, item, fingerprint, [])
        if seq == last + 1:
            return [self._deliver(seq, item, fingerprint, False)]
        if seq > last + 1:
            gap = Report(GAP, last + 1, seq - 1, f"live seq {seq} after {last}")
            return self._begin_replay(last + 1, seq, item, fingerprint, [gap])
        if self._seen(seq, fingerprint):
            return [Report(DUPLICATE, seq, seq, "already delivered; dropped")]
        return self._restart(seq, item, fingerprint)

    def replayed(
        self, replay_id: int, seq: int, item: T, fingerprint: Hashable
    ) -> list[TrackerAction[T]]:
        """A batch arrived in reply to replay ``replay_id``."""
        if not self._replaying or replay_id != self._replay_id:
            return [Drop(seq, "stale_replay")]
        if self.last is not None and seq <= self.last:
            return [Drop(seq, "replay_overlap")]
        self._watermark = max(self._watermark, seq)
        entry = self._pending.get(seq)
        if entry is None:
            self._pending[seq] = (item, fingerprint, True)
            heapq.heappush(self._heap, seq)
            return self._release(seq, "not in the publisher's replay buffer")
        if entry[1] != fingerprint:
            return [Drop(seq, "replay_mismatch")]
        return [
            Drop(seq, "replay_overlap"),
            *self._release(seq, "not in the publisher's replay buffer"),
        ]

    def replay_end(self, replay_id: int) -> list[TrackerAction[T]]:
        """The end marker of replay ``replay_id`` arrived."""
        if not self._replaying or replay_id != self._replay_id:
            return [Drop(None, "stale_replay_end")]
        out = self._release(self._watermark, "not in the publisher's replay buffer")
        if not self._heap:
            self._replaying = False
            return out
        # Live traffic lost after the request was made: ask again.
        nxt = self._next
        out.append(Report(GAP, nxt, self._heap[0] - 1, "live batches lost during a replay"))
        self._replay_id += 1
        self._watermark = max(self._pending)
        out.append(StartReplay(nxt, self._replay_id))
        return out

    def replay_failed(self, replay_id: int, detail: str) -> list[TrackerAction[T]]:
        """Replay ``replay_id`` cannot be done or did not finish: report every hole as lost
        (with ``detail``) and release the buffered batches in order."""
        if not self._replaying or replay_id != self._replay_id:
            return []
        out = self._release(max(self._pending) if self._pending else -1, detail)
        self._replaying = False
        self._replay_id += 1
        return out

    # --- internals ------------------------------------------------------------------
    def _deliver(self, seq: int, item: T, fingerprint: Hashable, replayed: bool) -> Deliver[T]:
        self.last = seq
        self._next = seq + 1
        self._ring[seq % self._history] = (seq, fingerprint)
        return Deliver(seq, item, replayed)

    def _seen(self, seq: int, fingerprint: Hashable) -> bool:
        entry = self._ring[seq % self._history]
        return entry is not None and entry[0] == seq and entry[1] == fingerprint

    def _begin_replay(
        self,
        start: int,
        seq: int,
        item: T,
        fingerprint: Hashable,
        out: list[TrackerAction[T]],
    ) -> list[TrackerAction[T]]:
        self._replaying = True
        self._replay_id += 1
        self._next = start
        self._pending = {seq: (item, fingerprint, False)}
        self._newest_live = seq
        self._heap = [seq]
        self._watermark = seq
        out.append(StartReplay(start, self._replay_id))
        return out

    def _live_during_replay(
        self, seq: int, item: T, fingerprint: Hashable
    ) -> list[TrackerAction[T]]:
        if self.last is not None and seq <= self.last:
            if self._seen(seq, fingerprint):
                return [Report(DUPLICATE, seq, seq, "already delivered; dropped")]
            return self._restart(seq, item, fingerprint)
        entry = self._pending.get(seq)
        if entry is not None:
            if entry[1] != fingerprint:
                return self._restart(seq, item, fingerprint)
            if entry[2]:
                return [Drop(seq, "replay_overlap")]
            return [Report(DUPLICATE, seq, seq, "already buffered; dropped")]
        if seq < self._newest_live:
            # Live traffic of one publisher never goes backwards: a new process.
            return self._restart(seq, item, fingerprint)
        self._newest_live = seq
        self._pending[seq] = (item, fingerprint, False)
        heapq.heappush(self._heap, seq)
        if len(self._pending) > self._max_pending:
            return self.replay_failed(
                self._replay_id, f"replay abandoned: over {self._max_pending} batches buffered"
            )
        # A live batch may extend the run just released.
        if seq == self._next:
            return self._release(-1, "")
        return []

    def _release(self, upto: int, detail: str) -> list[TrackerAction[T]]:
        """Deliver buffered seqs in order: every one ``<= upto`` (holes before them are
        reported lost with ``detail``), then any run contiguous with the last delivered."""
        out: list[TrackerAction[T]] = []
        heap = self._heap
        while heap:
            seq = heap[0]
            if seq > upto and seq != self._next:
                break
            heapq.heappop(heap)
            item, fingerprint, replayed = self._pending.pop(seq)
            if seq > self._next:
                out.append(Report(UNRECOVERABLE_LOSS, self._next, seq - 1, detail))
            out.append(self._deliver(seq, item, fingerprint, replayed))
        return out

    def _restart(self, seq: int, item: T, fingerprint: Hashable) -> list[TrackerAction[T]]:
        old_last = self.last
        dropped = len(self._pending)
        self.last = None
        self._ring = [None] * self._history
        self._pending = {}
        self._heap = []
        self._replaying = False
        self._replay_id += 1
        self._next = 0
        detail = f"seq went back to {seq} after {old_last}"
        if dropped:
            detail += f"; {dropped} buffered batch(es) of the old stream discarded"
        out: list[TrackerAction[T]] = [Report(PUBLISHER_RESTART, seq, old_last, detail)]
        if seq == 0:
            out.append(self._deliver(seq, item, fingerprint, False))
            return out
        return self._begin_replay(0, seq, item, fingerprint, out)
