"""Pure sequence tracking for one publisher stream (one ``(endpoint, topic, dp_rank)``).

One job: :class:`StreamTracker`.  Imports only :mod:`kvevents.errors` and the
package's :mod:`~kvevents.seqtrack.actions` and :mod:`~kvevents.seqtrack.history`.

A :class:`StreamTracker` is fed what arrived (live batches, replayed batches, the end of
a replay, a failed replay) and answers with *actions* for its caller, in the order the
caller must apply them (:mod:`kvevents.seqtrack.actions`: ``Deliver``,
``Report``, ``Drop``, ``StartReplay``).  It does no I/O and reads no
clock, so it can be tested exhaustively (see the property tests); timeouts, concurrency,
socket events and liveness belong to the caller, which reports a replay that cannot be
done or did not finish with :meth:`StreamTracker.replay_failed`.  What it remembers of
the past is a :class:`~kvevents.seqtrack.history.SeqHistory`.

The rules:

* **Every seq is delivered or reported lost, never both.**  ``next`` is the lowest seq not
  yet resolved; everything below it was delivered or reported lost.  A batch arriving
  with a seq below ``next`` is a ``duplicate`` (same fingerprint as the batch delivered
  with that seq), ``late`` (its seq was reported lost: dropped, no reset, no second
  loss), or suspect (anything else: see restarts).
* **Gaps are repaired by replay.**  A live ``seq > next`` is buffered and a replay is
  requested.  Every replay starts at the *last applied seq* (``last``), not after it, so
  its first reply also checks the stream's identity.  Replayed batches contiguous with
  ``next`` are delivered; live batches buffered meanwhile are released in seq order.
* **Unrecoverable means the ring said so.**  A replay that skips from ``next`` to a
  higher seq ``r`` proves the ring no longer holds ``next..r-1``; of those, the seqs the
  live path has already passed (at or below the newest live seq seen) can never arrive
  and are reported lost.  Seqs above it may still be queued on the live path (a backlog
  deeper than the ring): they are left to it, and replayed batches beyond them are
  dropped as ``replay_ahead``.  When the live path has been quiet since a liveness
  :meth:`probe` (nothing can be in flight), every seq the ring skipped is lost.  At the
  end of a replay, holes it covered are lost; holes above what it covered (live traffic
  lost after the request) start another round.
* **Restarts are detected by fingerprint, not by seq order.**  A replay from ``last``
  whose first reply is ``last`` with another fingerprint, or that holds nothing at all
  from ``last`` on (a publisher's seq never goes back, so the process that published
  ``last`` would still hold it or newer ones), proves a new publisher process: a
  ``publisher_restart`` is reported (reset the worker), the buffered batches are
  discarded and the new stream is caught up from its start.  A replay whose first reply
  is above ``last`` (the ring moved on) cannot tell, and is not taken as a restart.  A
  suspect live batch, or a reconnect the caller saw (:meth:`verify`), triggers such a
  replay and holds live delivery until it answers.  Without a replay endpoint
  (``replayable=False``) nothing can be checked and a suspect seq is taken as a restart,
  as vLLM's own rule says.
* **A jump is vouched for before it is applied** (``vouch_jumps``, for a stream whose
  replay endpoint answers requests).  A live batch more than one seq beyond the live
  seqs seen (a *jump*: live loss, or a frame the publisher never sent), one inside the
  range seen (filling a hole) and one that follows a held batch are *held*: never
  released on their own.  A reply under a held seq vouches for it (same payload: the
  live copy is delivered) or disowns it (another payload); a replay asked after it
  arrived that brings nothing new and ends below it disowns it too (the publisher had
  not sent it when it answered).  Held batches that arrived while a replay ran and
  follow the newest seq it covered without a hole are the stream going on.  Only live
  seqs that arrived in order (or were vouched for) count as passed by the live path, so
  a forged seq far ahead never makes the seqs below it lost.  A batch contradicting an
  applied seq is checked by a replay from ``last``: when that shows the same stream it
  is disowned, and when the check gets no answer it is not taken as a restart (a
  :meth:`verify` after a reconnect still is).  Disowned batches are reported
  ``disowned_seq``, dropped, and never reset anything.  When no replay can answer (it
  failed, or rounds ran out), held batches are released unchecked.  A forged batch
  under the next seq the live path expects, sent before the publisher's own (or under a
  seq the publisher sends within one replay round trip), cannot be told apart and is
  applied: authenticate the publisher (CURVE) where that matters.
* **Catch-up.**  A new stream is replayed from seq 0: the ring answers from its oldest
  seq; what it no longer has is reported as ``history_missed`` (the index starts
  incomplete; nothing to reset).  With ``catch_up=False`` (or no replay endpoint) the
  stream is followed from its first seen seq and the seqs before it are reported as
  ``history_missed`` at once.  Holes before the first delivery of a stream lifetime are
  ``history_missed``; holes after it are ``unrecoverable_loss``.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

from kvevents.errors import ConfigError
from kvevents.seqtrack.actions import (
    DISOWNED_SEQ,
    DUPLICATE,
    GAP,
    HISTORY_MISSED,
    PUBLISHER_RESTART,
    UNRECOVERABLE_LOSS,
    Deliver,
    Drop,
    Report,
    StartReplay,
    TrackerAction,
)
from kvevents.seqtrack.history import SeqHistory

__all__ = ["StreamTracker"]

T = TypeVar("T")

_NEVER = 1 << 62
_NOT_IN_RING = "not in the publisher's replay buffer"
_MAX_ROUNDS = 8
"""Replay rounds in a row that may each leave holes above what they covered."""

_NEAR_JUMP = 1024
"""A jump at most this far ahead of the live seqs seen (live loss, usually) lets the
batches that follow it count as in order; a farther one (a forged seq far ahead, say)
does not, so it cannot make a forged seq below it look in order."""

_Pending = tuple[T, Hashable, bool]  # (item, fingerprint, replayed)


class StreamTracker(Generic[T]):
    """Sequence state of one publisher stream.  See the module docstring for the rules.

    ``replayable``: the stream has a replay endpoint (gaps, catch-up and identity checks
    go through it; otherwise gaps are lost at once).  ``catch_up``: replay a new stream
    from seq 0 (the default).  ``history`` is how many delivered seqs keep a fingerprint
    (and how far back lost ranges are remembered for ``late``); ``max_pending`` bounds
    the live batches buffered during a replay: beyond it the replay is abandoned, its
    holes are reported lost and the buffer is released.  ``vouch_jumps``: a live seq
    that jumps ahead waits for a replay to vouch for it (see the module docstring; for a
    stream whose replay endpoint answers requests, not a capture).  Raises
    :class:`~kvevents.errors.ConfigError` (a ``ValueError``) for a bound below 1.
    """

    def __init__(
        self,
        *,
        replayable: bool = True,
        catch_up: bool = True,
        history: int = 4096,
        max_pending: int = 100_000,
        vouch_jumps: bool = False,
    ) -> None:
        if history < 1 or max_pending < 1:
            raise ConfigError(f"history and max_pending must be >= 1, got {history}, {max_pending}")
        self._replayable = replayable
        self._vouch = vouch_jumps and replayable
        self._catch_up = catch_up
        self._history = history
        self._max_pending = max_pending
        self._replay_id = 0
        self._reset_epoch()

    def _reset_epoch(self) -> None:
        self.last: int | None = None
        """The last delivered seq, None before the first delivery (and after a restart)."""
        self._next: int | None = None
        self._past = SeqHistory(self._history)
        self._ring = self._past.ring
        self._pending: dict[int, _Pending[T]] = {}
        self._heap: list[int] = []
        self._front = -1  # newest live seq that arrived in order, or was vouched for
        self._raw = -1  # newest live seq seen, far jumps excluded
        self._unvouched: dict[int, int] = {}  # held seq -> replay id when it came
        self._suspects: list[int] = []  # seqs that raised the running identity check
        self._quiet = False
        self._replaying = False
        self._check: int | None = None  # seq whose fingerprint the running replay checks
        self._check_fp: Hashable | None = None
        self._suspect_item: tuple[int, T, Hashable] | None = None
        self._before_hold: set[int] = set()  # buffered before the check began
        self._hold = False  # buffer live batches until the check is answered
        self._strict = False  # a check that fails to answer is taken as a restart
        self._covered = -1  # newest seq this replay has answered
        self._replies = 0
        self._progress = 0
        self._req_front = -1
        self._ahead = _NEVER
        self._rounds = 0

    # --- state ----------------------------------------------------------------------
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
        """Live batches buffered while a replay runs."""
        return len(self._pending)

    @property
    def next_seq(self) -> int | None:
        """The lowest seq not yet delivered or reported lost (None before the start)."""
        return self._next

    # --- requests from the caller ---------------------------------------------------
    def catch_up(self) -> StartReplay | None:
        """Start following a fresh stream by replay from seq 0, before any live batch.

        Returns the request to make, or None if the stream is already being followed
        (or replayed).  Replies, the end marker or a failure then go through
        :meth:`replayed`, :meth:`replay_end` and :meth:`replay_failed` as usual."""
        if self._next is not None or self._replaying:
            return None
        self._next = 0
        return self._begin(0, check=None)

    def resume_at(self, seq: int, fingerprint: Hashable) -> None:
        """Follow a fresh stream from a resume point: as if ``seq`` (whose payload had
        ``fingerprint``) were the last batch applied (an index restored from a snapshot
        taken there).  Call :meth:`check_resume` next (once the live socket is
        connected).  Raises :class:`~kvevents.errors.ConfigError` for a negative seq or
        a stream already followed."""
        if seq < 0:
            raise ConfigError(f"a resume point is a seq >= 0, got {seq}")
        if self._next is not None or self._replaying:
            raise ConfigError("the stream is already followed: resume_at comes first")
        self._advance(seq, fingerprint)
        self._front = seq

    def check_resume(self) -> StartReplay | None:
        """Check the resume point :meth:`resume_at` set, by replay from it, before
        anything new is applied (live batches are held): its first reply must be that
        seq with the same fingerprint, and the replay goes on with what followed.  A
        fingerprint that differs, or a ring that holds nothing from it on, is a
        ``publisher_restart`` (the new stream is caught up from its start); a ring that
        moved past it reports what it no longer holds as ``unrecoverable_loss`` (reset
        the worker).  None without a replay endpoint (nothing can be checked)."""
        if not self._replayable or self.last is None or self._replaying:
            return None
        req = self._begin(self.last, check=self.last)
        self._hold = True
        self._strict = True
        self._before_hold = set(self._pending)
        self._quiet = True  # nothing older than the resume point is in flight for us
        return req

    def verify(self) -> list[TrackerAction[T]]:
        """Check the stream's identity (the caller saw its connection drop and come
        back, or it resumed after a silence): replay from ``last`` and compare its
        fingerprint; hold live delivery until the answer.  A replay already running is
        superseded.  Nothing to do for a stream without replay or without a delivery."""
        if not self._replayable or self._next is None:
            return []
        if self.last is None:
            # Nothing applied yet: start the catch-up again on the (maybe new) stream.
            replay_id = self._replay_id
            self._reset_epoch()
            self._replay_id = replay_id
            self._next = 0
            return [self._begin(0, check=None)]
        out: list[TrackerAction[T]] = [self._begin(self.last, check=self.last)]
        self._hold = True
        self._strict = True
        self._before_hold = set(self._pending)
        return out

    def probe(self) -> StartReplay | None:
        """A liveness probe after a silence: replay from ``last`` (its end marker is the
        answer; its first reply checks identity; anything newer was lost on the quiet
        live path and is delivered).  None if a replay already runs or nothing can be
        asked."""
        if not self._replayable or self.last is None or self._replaying:
            return None
        req = self._begin(self.last, check=self.last)
        self._quiet = True
        return req

    # --- inputs ---------------------------------------------------------------------
    def live_in_order(self, seq: int, fingerprint: Hashable) -> bool:
        """The usual live batch, taken without building actions: when ``seq`` is the next
        one expected and nothing is held or buffered, record it as delivered and return
        True (the caller delivers it: exactly ``live``'s single ``Deliver``).  Otherwise
        change nothing and return False (call :meth:`live`)."""
        if seq != self._next or self._hold or self._heap:
            return False
        self._quiet = False
        if seq > self._front:
            self._front = seq
        # (_advance, inline: this runs once per batch)
        self.last = seq
        self._next = seq + 1
        self._ring[seq % self._history] = (seq, fingerprint)
        return True

    def live(self, seq: int, item: T, fingerprint: Hashable) -> list[TrackerAction[T]]:
        """A batch arrived on the live stream."""
        self._quiet = False
        nxt = self._next
        if nxt is None:
            return self._first_live(seq, item, fingerprint)
        if seq < nxt:
            return self._old(seq, item, fingerprint)
        front = self._front
        raw = self._raw if self._raw > front else front
        vouch = self._vouch
        jump = vouch and seq > raw + 1
        # Held for a replay's word: a jump, a batch inside the range seen (a reordered
        # batch filling a hole, or one the publisher never sent), or one that follows a
        # batch held.
        held = jump or (vouch and (seq < raw or (seq == raw + 1 and raw in self._unvouched)))
        if seq > raw and (not jump or seq - raw <= _NEAR_JUMP):
            self._raw = seq  # (live batches that follow a near jump are no jumps)
        if not held and seq > front:
            self._front = seq
        entry = self._pending.get(seq)
        if entry is not None:
            if entry[1] == fingerprint:
                return [Report(DUPLICATE, seq, seq, "already buffered; dropped")]
            return self._suspect(seq, item, fingerprint, "seq already buffered with other content")
        if seq == nxt and not self._hold:
            out: list[TrackerAction[T]] = [self._deliver(seq, item, fingerprint, False)]
            self._release(out)
            return out
        self._buffer(seq, item, fingerprint, False)
        if held:
            self._unvouched[seq] = self._replay_id
        if self._replaying:
            if len(self._pending) > self._max_pending:
                return self.replay_failed(
                    self._replay_id, f"replay abandoned: over {self._max_pending} batches buffered"
                )
            return []
        gap = Report(GAP, nxt, seq - 1, f"live seq {seq} while expecting {nxt}")
        if not self._replayable:
            out = [gap]
            self._resolve(seq - 1, "no replay endpoint", out)
            self._release(out)
            return out
        start = self.last if self.last is not None else 0
        return [gap, self._begin(start, check=self.last)]

    def replayed(
        self, replay_id: int, seq: int, item: T, fingerprint: Hashable
    ) -> list[TrackerAction[T]]:
        """A batch arrived in reply to replay ``replay_id``."""
        if not self._replaying or replay_id != self._replay_id:
            return [Drop(seq, "stale_replay")]
        self._replies += 1
        out: list[TrackerAction[T]] = []
        check = self._check
        if check is not None:
            self._check = None
            if seq == check:
                if fingerprint != self._check_fp:
                    return self._restart(
                        None, f"the replayed batch {seq} differs from the one applied"
                    )
                self._unhold(out)
                self._covered = max(self._covered, seq)
                out.append(Drop(seq, "replay_overlap"))
                for s in self._suspects:
                    out.append(
                        Report(
                            DISOWNED_SEQ,
                            s,
                            s,
                            f"contradicts applied seqs, and the replay shows seq {seq} unchanged",
                        )
                    )
                self._suspects.clear()
                return out
            self._suspects.clear()
            self._unhold(out)  # the ring moved past ``last``: identity cannot be checked
        self._covered = max(self._covered, seq)
        nxt = self._next
        assert nxt is not None
        if seq < nxt:
            out.append(Drop(seq, "replay_overlap"))
            return out
        if seq > nxt:
            # The ring skipped next..seq-1 (except what this replay already offered and
            # was left to the live path); what the live path already passed is gone
            # (near jumps count: a reply of this ring vouches for them or disowns them).
            front = max(self._front, self._raw)
            front = front if front >= 0 and not self._quiet else seq - 1
            self._resolve(min(seq - 1, front, self._ahead - 1), _NOT_IN_RING, out)
            nxt = self._next
            assert nxt is not None
        if seq != nxt:
            out.append(Drop(seq, "replay_ahead"))
            self._ahead = min(self._ahead, seq)
            return out
        entry = self._pending.pop(seq, None)
        if entry is not None:
            self._heap.remove(seq)
            heapq.heapify(self._heap)
            jumped = self._unvouched.pop(seq, None) is not None
            if entry[1] == fingerprint:
                out.append(Drop(seq, "replay_overlap"))
                if jumped and seq > self._front:
                    self._front = seq  # a jump vouched for: the live path passed it
                if jumped and seq > self._raw:
                    self._raw = seq
                if jumped:  # the live copy, vouched for (the same bytes), as it came
                    out.append(self._deliver(seq, entry[0], fingerprint, entry[2]))
                    self._release(out)
                    return out
            else:
                out.append(Drop(seq, "replay_mismatch"))
                out.append(
                    Report(
                        DISOWNED_SEQ,
                        seq,
                        seq,
                        "the publisher's replay holds another batch under this seq",
                    )
                )
        out.append(self._deliver(seq, item, fingerprint, True))
        self._progress += 1
        self._release(out)
        return out

    def replay_end(self, replay_id: int) -> list[TrackerAction[T]]:
        """The end marker of replay ``replay_id`` arrived."""
        if not self._replaying or replay_id != self._replay_id:
            return [Drop(None, "stale_replay_end")]
        if self._check is not None:
            # Nothing at all from ``last`` on: the process that published it would still
            # hold it (or newer seqs).  A new publisher process.
            return self._restart(
                None, f"the replay holds nothing from the applied seq {self._check} on"
            )
        out: list[TrackerAction[T]] = []
        self._unhold(out)
        if self._unvouched:
            # A reply that brought nothing new holds nothing more: a held seq asked about
            # and above what it covered was never sent.  (One that did may have been cut
            # short: the next round asks again.  An empty answer to a catch-up may predate
            # the stream's first batch: the next round asks again too.)
            answered = self._replies > 0 or self.last is not None
            if answered and not self._progress:
                self._disown(out)
            self._continued()
        covered = self._covered
        if self._replies == 0 and self.last is None:
            covered = self._front  # an empty ring: the history before the first seq is gone
        elif covered < self._req_front and not self._progress:
            # A ring holds every seq it sent (the live path showed ``_req_front`` before the
            # request), so a reply stream stopping short of it without bringing anything
            # new holds nothing more for the holes.
            covered = self._req_front
        self._resolve(min(covered, self._front, self._ahead - 1), _NOT_IN_RING, out)
        self._release(out)
        if not self._heap or self._rounds >= _MAX_ROUNDS:
            if self._heap:
                self._disown(out)
                # (no round left to ask: what no reply vouched for is not applied; a real
                # batch among them shows as a gap again on the live path)
                for seq in sorted(self._unvouched):
                    del self._pending[seq]
                    out.append(Drop(seq, "unvouched"))
                self._unvouched.clear()
                self._heap = sorted(self._pending)
                if self._heap:
                    self._resolve(self._heap[0] - 1, "replay rounds exhausted", out)
                    self._release(out)
            self._end_replay()
            return out
        nxt = self._next
        # Live traffic lost after the request was made, or a reply stream cut short
        # (a publisher bounding replies per request): ask again from where it stopped.
        self._rounds += 1
        assert nxt is not None
        if self._req_front < nxt < self._heap[0]:
            # (a buffered seq right at ``nxt`` is no hole: it only waits for a reply to
            # vouch for it, as when the ring answered before that live batch reached it)
            out.append(Report(GAP, nxt, self._heap[0] - 1, "live batches lost during a replay"))
        out.append(self._begin(self.last if self.last is not None else 0, check=None))
        return out

    def replay_failed(
        self, replay_id: int, detail: str, *, conclusive: bool = True
    ) -> list[TrackerAction[T]]:
        """Replay ``replay_id`` cannot be done or did not finish: report every hole below
        the buffered batches as lost (with ``detail``) and release them in order.

        When the replay was an identity check after a reconnect (or a contradicting
        batch) and it got no answer at all (``conclusive``: a timeout), the stream is
        taken as restarted.  ``conclusive=False`` (the endpoint answered but its
        connection kept dropping, e.g. a reply over the size limit) releases the check
        without a restart."""
        if not self._replaying or replay_id != self._replay_id:
            return []
        if self._hold and self._strict and conclusive:
            return self._unverified(detail)
        out: list[TrackerAction[T]] = []
        self._check = None
        self._hold = False
        self._suspect_item = None
        self._suspects.clear()
        # Nothing can vouch for the held batches now: released unchecked (the stream falls
        # back to seq order alone, as without a replay endpoint).
        self._unvouched.clear()
        if self._heap:
            self._resolve(max(self._pending) - 1, detail, out)
        self._release(out)
        self._end_replay()
        return out

    # --- internals ------------------------------------------------------------------
    def _first_live(self, seq: int, item: T, fingerprint: Hashable) -> list[TrackerAction[T]]:
        self._next = 0
        if seq == 0:
            self._front = seq
            return [self._deliver(seq, item, fingerprint, False)]
        if self._catch_up and self._replayable:
            self._buffer(seq, item, fingerprint, False)
            if self._vouch:  # the catch-up vouches for it (or disowns it)
                self._unvouched[seq] = self._replay_id
            else:
                self._front = seq
            return [self._begin(0, check=None)]
        self._front = seq
        why = "catch-up is off" if self._replayable else "no replay endpoint"
        out: list[TrackerAction[T]] = []
        self._resolve(seq - 1, f"joined at seq {seq} ({why})", out)
        out.append(self._deliver(seq, item, fingerprint, False))
        return out

    def _begin(self, start: int, *, check: int | None) -> StartReplay:
        self._replaying = True
        self._replay_id += 1
        self._check = check
        self._check_fp = None if check is None else self._past.fingerprint(check)
        self._covered = -1
        self._replies = 0
        self._progress = 0
        self._req_front = self._front
        self._ahead = _NEVER  # lowest seq this replay offered ahead of the live path
        self._quiet = False
        return StartReplay(start, self._replay_id)

    def _end_replay(self) -> None:
        """The replay in progress is over (ended or failed): its replies and end marker,
        should they still come, are stale, and the next replay starts a new round count."""
        self._replaying = False
        self._replay_id += 1
        self._rounds = 0
        self._quiet = False

    def _buffer(self, seq: int, item: T, fingerprint: Hashable, replayed: bool) -> None:
        self._pending[seq] = (item, fingerprint, replayed)
        heapq.heappush(self._heap, seq)

    def _unhold(self, out: list[TrackerAction[T]]) -> None:
        self._suspect_item = None
        if self._hold:
            self._hold = False
            self._release(out)

    def _deliver(self, seq: int, item: T, fingerprint: Hashable, replayed: bool) -> Deliver[T]:
        self._advance(seq, fingerprint)
        return Deliver(seq, item, replayed)

    def _advance(self, seq: int, fingerprint: Hashable) -> None:
        """``seq`` (with ``fingerprint``) is delivered: it is the last applied seq."""
        self.last = seq
        self._next = seq + 1
        self._ring[seq % self._history] = (seq, fingerprint)

    def _release(self, out: list[TrackerAction[T]]) -> None:
        """Deliver the buffered run contiguous with ``next`` (unless held)."""
        heap = self._heap
        jumps = self._unvouched
        while heap and heap[0] == self._next and not self._hold and heap[0] not in jumps:
            seq = heapq.heappop(heap)
            item, fingerprint, replayed = self._pending.pop(seq)
            out.append(self._deliver(seq, item, fingerprint, replayed))

    def _resolve(self, upto: int, detail: str, out: list[TrackerAction[T]]) -> None:
        """Every seq from ``next`` to ``upto`` that is not buffered is gone: report the
        holes (``history_missed`` before the first delivery, else ``unrecoverable_loss``)
        and deliver the buffered batches among them, in order."""
        nxt = self._next
        assert nxt is not None
        heap = self._heap
        held = self._unvouched
        while nxt <= upto:
            if heap and heap[0] <= upto:
                seq = heap[0]
                if seq > nxt:
                    self._report_lost(nxt, seq - 1, detail, out)
                heapq.heappop(heap)
                item, fingerprint, replayed = self._pending.pop(seq)
                # (a held batch among seqs the ring no longer holds: nothing can vouch for
                # it, and it is the live path's, so it is applied as it came)
                held.pop(seq, None)
                out.append(self._deliver(seq, item, fingerprint, replayed))
                nxt = seq + 1
            else:
                self._report_lost(nxt, upto, detail, out)
                nxt = upto + 1
                self._next = nxt
                break

    def _report_lost(self, lo: int, hi: int, detail: str, out: list[TrackerAction[T]]) -> None:
        kind = HISTORY_MISSED if self.last is None else UNRECOVERABLE_LOSS
        out.append(Report(kind, lo, hi, detail))
        self._past.add_lost(lo, hi)

    def _old(self, seq: int, item: T, fingerprint: Hashable) -> list[TrackerAction[T]]:
        past = self._past
        if past.is_lost(seq):
            return [Drop(seq, "late")]
        if past.seen(seq, fingerprint):
            if seq > self._front:
                # Never seen live: a replay delivered it first (a catch-up can answer
                # with batches whose live copies are still on their way), so this live
                # copy is the expected overlap, not a second send.
                self._front = seq
                return [Drop(seq, "replay_overlap")]
            return [Report(DUPLICATE, seq, seq, "already delivered; dropped")]
        known = past.known(seq)
        return self._suspect(
            seq, item, fingerprint, f"seq {seq} below the next expected {self._next}", known
        )

    def _suspect(
        self, seq: int, item: T, fingerprint: Hashable, detail: str, known: bool = True
    ) -> list[TrackerAction[T]]:
        """A batch that contradicts what was applied: a new publisher process, or a
        forged / corrupted / reordered one.  Checked by replay when possible (the batch
        itself is dropped: a new process's replay has it); without replay it starts the
        new stream, as vLLM's rule says."""
        if not self._replayable:
            restart = self._restart(seq, detail)
            restart.extend(self._first_live(seq, item, fingerprint))
            return restart
        out: list[TrackerAction[T]] = [Drop(seq, "mismatch")]
        if not (self._replaying and self._check is not None):
            out.extend(self.verify())
            self._strict = known and not self._vouch
        if self._check is not None and seq < (self._next or 0):
            self._suspects.append(seq)
        if self._hold and known:
            # (vouch_jumps: a frame alone never resets; only the replay's answer does)
            if not self._vouch:
                self._strict = True
            self._suspect_item = (seq, item, fingerprint)
        return out

    def _continued(self) -> None:
        """At the end of a replay: the held batches that arrived while it ran and follow
        the newest seq it covered without a hole are the stream going on after the ring's
        snapshot (a frame there would have to guess the publisher's next seq)."""
        rid = self._replay_id
        seq = self._covered + 1
        held = self._unvouched
        while seq > 0 and held.get(seq) == rid:
            del held[seq]
            if seq > self._front:
                self._front = seq
            if seq > self._raw:
                self._raw = seq
            seq += 1

    def _disown(self, out: list[TrackerAction[T]]) -> None:
        """The replay that just ended brought nothing new: every jump buffered before it
        was asked for and above what it covered is a seq the publisher had not sent when
        it answered.  Report and discard them."""
        rid = self._replay_id
        covered = self._covered
        gone = [s for s, came in self._unvouched.items() if came < rid and s > covered]
        if not gone:
            return
        newest = f"newest {covered}" if covered >= 0 else "nothing"
        for seq in sorted(gone):
            del self._unvouched[seq]
            del self._pending[seq]
            out.append(
                Report(
                    DISOWNED_SEQ,
                    seq,
                    seq,
                    f"beyond what the publisher's replay holds ({newest}) after it arrived",
                )
            )
        self._heap = sorted(self._pending)
        held = self._unvouched
        self._raw = max([self._front, *(s for s in self._heap if s not in held)])

    def _unverified(self, detail: str) -> list[TrackerAction[T]]:
        """An identity check failed to answer: reset (a reset is safe, continuing a
        stream that may belong to another process is not) and follow what arrived since
        the check began (and the batch that raised it) as the new stream's start."""
        held = self._unvouched
        batches = {
            s: b for s, b in self._pending.items() if s not in self._before_hold and s not in held
        }
        if self._suspect_item is not None:
            seq, item, fingerprint = self._suspect_item
            batches.setdefault(seq, (item, fingerprint, False))
        old_last = self.last
        self._reset_epoch()
        self._replay_id += 1
        out: list[TrackerAction[T]] = [
            Report(
                PUBLISHER_RESTART,
                None,
                old_last,
                f"the stream's identity could not be checked ({detail}); taken as a restart",
            )
        ]
        if batches:
            self._next = 0
            for seq, (item, fingerprint, replayed) in batches.items():
                self._buffer(seq, item, fingerprint, replayed)
            self._front = max(batches)
            self._resolve(self._front, f"unknown: {detail}", out)
        return out

    def _restart(self, seq: int | None, detail: str) -> list[TrackerAction[T]]:
        old_last = self.last
        dropped = len(self._pending)
        self._reset_epoch()
        if dropped:
            detail += f"; {dropped} buffered batch(es) discarded"
        out: list[TrackerAction[T]] = [Report(PUBLISHER_RESTART, seq, old_last, detail)]
        if self._replayable:
            self._next = 0
            out.append(self._begin(0, check=None))
        return out
