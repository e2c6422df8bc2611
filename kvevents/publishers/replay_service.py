"""The publisher's replay service: a ROUTER socket answering "send me seq N onwards".

One job: take replay requests off the ROUTER, refuse what is over a bound (counted by
reason), and serve each accepted request from a snapshot of the replay buffer a slice
at a time, never blocking: a peer whose queue is full is retried and abandoned after
``stall_timeout_s`` without progress; a peer that disconnected is dropped.  The
ZmqEventPublisher's sender thread drives it (:meth:`ReplayService.accept_requests`,
:meth:`ReplayService.serve`) between bursts of live messages; it owns no thread.

Imports pyzmq, the frame helpers of :mod:`kvevents.codec`, the stats and the rate-limited
log (and the errors); nothing else of ``publishers``.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvevents.codec import (
    pack_replay_end,
    pack_replay_reply,
    parse_replay_request,
    unpack_seq,
)
from kvevents.errors import FrameError
from kvevents.publishers.publisher_stats import PublisherStats
from kvevents.ratelimit import RateLimitedLog

__all__ = ["ReplayCursor", "ReplayPeer", "ReplayService"]


@dataclass
class ReplayCursor:
    """One replay in progress: a snapshot of the buffer and the next index to send."""

    identity: bytes
    snapshot: list[tuple[int, bytes]]
    position: int
    end_sent: bool = False
    stalled_since_s: float | None = None

    @property
    def remaining(self) -> int:
        """Replies not yet sent, the end marker included."""
        return len(self.snapshot) - self.position + (0 if self.end_sent else 1)


@dataclass
class ReplayPeer:
    """A replay peer: its pending replays and the bytes ZeroMQ still holds for it.

    ``inflight`` is a FIFO of ``(tracker, bytes, messages)``, one per slice sent: the
    tracker of a slice's last payload is done once ZeroMQ let go of it (written to the
    peer's connection, or the peer is gone), and then so are the earlier ones.
    """

    cursors: deque[ReplayCursor] = field(default_factory=deque)
    inflight: deque[tuple[Any, int, int]] = field(default_factory=deque)
    inflight_bytes: int = 0
    inflight_messages: int = 0
    carry_bytes: int = 0  # sent untracked (a slice cut short), released with the next
    carry_messages: int = 0


def _seq_of(entry: tuple[int, bytes]) -> int:
    return entry[0]


class ReplayService:
    """Serves replay requests arriving on ``router`` from ``buffer``.

    ``buffer`` is the publisher's ring of ``(seq, payload)`` in increasing seq order (the
    sender appends to it; this class only reads it).  ``monitor`` is the ROUTER's
    disconnect-event socket (or ``None``).  Limits (all ``>= 1``): ``slice_replies``
    replies per peer per :meth:`serve`; ``max_pending`` requests in progress;
    ``max_clients`` peers served at once; ``max_reply_bytes`` payload bytes per reply;
    ``max_client_bytes`` / ``max_bytes_in_flight`` payload bytes handed to ZeroMQ and not
    yet written, per peer / in total; ``sndhwm_messages`` the ROUTER's send HWM.
    Counters go to ``stats``.  Single-threaded: only the sender thread calls it.
    """

    def __init__(
        self,
        router: zmq.Socket[Any],
        monitor: zmq.Socket[Any] | None,
        buffer: deque[tuple[int, bytes]],
        stats: PublisherStats,
        topic_frame: bytes,
        *,
        slice_replies: int,
        stall_timeout_s: float,
        max_pending: int,
        max_clients: int,
        max_reply_bytes: int,
        max_client_bytes: int,
        max_bytes_in_flight: int,
        sndhwm_messages: int,
        request_log: RateLimitedLog,
        error_log: RateLimitedLog,
    ) -> None:
        self.router = router
        self.monitor = monitor
        self.buffer = buffer
        self.stats = stats
        self.topic_frame = topic_frame
        self.slice_replies = slice_replies
        self.stall_timeout_s = stall_timeout_s
        self.max_pending = max_pending
        self.max_clients = max_clients
        self.max_reply_bytes = max_reply_bytes
        self.max_client_bytes = max_client_bytes
        self.max_bytes_in_flight = max_bytes_in_flight
        self.sndhwm_messages = sndhwm_messages
        self.request_log = request_log
        self.error_log = error_log
        self.peers: dict[bytes, ReplayPeer] = {}
        self.pending = 0
        """Replays accepted and not finished or abandoned (cursors over all peers)."""
        self.inflight_total = 0
        """Replay payload bytes handed to ZeroMQ and not yet written out (all peers)."""
        self.stalled = False
        """Whether no peer accepted a reply in the last :meth:`serve` (retry later)."""

    # --- requests ---------------------------------------------------------------------

    def _refuse(self, reason: str, detail: str) -> None:
        self.stats.replay_refusals[reason] += 1
        if reason in ("bad_frame_count", "bad_start_frame"):
            self.stats.malformed_requests += 1
        else:
            self.stats.replay_requests_refused += 1
        self.request_log.warning("request", "refused a replay request (%s): %s", reason, detail)

    def accept_requests(self) -> None:
        """Read up to ``max_pending`` requests without blocking; accept or refuse each."""
        router = self.router
        self._count_disconnects()
        for _ in range(self.max_pending):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            try:
                identity, _ = parse_replay_request(frames)
            except FrameError as exc:
                self._refuse("bad_frame_count", str(exc))
                continue
            try:
                # Stricter than vLLM, which reads a start of any length.
                start = unpack_seq(frames[2])
            except FrameError as exc:
                self._refuse("bad_start_frame", f"start {exc}")
                continue
            self.stats.replay_requests += 1
            peer = self.peers.get(identity)
            serving = sum(1 for p in self.peers.values() if p.cursors)
            if self.pending >= self.max_pending:
                self._refuse("too_many_pending", f"{self.pending} replays in progress")
                continue
            if (peer is None or not peer.cursors) and serving >= self.max_clients:
                self._refuse("too_many_clients", f"{serving} clients being served")
                continue
            if peer is not None and peer.inflight_bytes >= self.max_client_bytes:
                self._refuse(
                    "client_backlog",
                    f"{peer.inflight_bytes} bytes not yet taken by this client",
                )
                continue
            if self.inflight_total >= self.max_bytes_in_flight:
                self._refuse("memory", f"{self.inflight_total} replay bytes in flight")
                continue
            if peer is None:
                peer = self.peers[identity] = ReplayPeer()
            peer.cursors.append(ReplayCursor(identity, self._snapshot(start), 0))
            self.pending += 1

    def _snapshot(self, start: int) -> list[tuple[int, bytes]]:
        """The buffered batches from ``start`` on, cut at ``max_reply_bytes``."""
        buffer = self.buffer
        if not buffer or start > buffer[-1][0]:
            return []
        # Seqs in the buffer are increasing but may have holes (drops): search by seq.
        entries = list(buffer)
        position = bisect.bisect_left(entries, start, key=_seq_of)
        out: list[tuple[int, bytes]] = []
        total = 0
        for entry in entries[position:]:
            size = len(entry[1])
            if out and total + size > self.max_reply_bytes:
                self.stats.replays_truncated += 1
                break
            out.append(entry)
            total += size
        return out

    def _count_disconnects(self) -> None:
        monitor = self.monitor
        if monitor is None:
            return
        while True:
            try:
                monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.stats.replay_peer_disconnects += 1

    # --- serving ----------------------------------------------------------------------

    def serve(self) -> bool:
        """Send at most ``slice_replies`` replies to each peer with a replay pending.

        Returns whether any peer accepted a reply (False: every peer was full); the
        same answer, negated, is kept in :attr:`stalled`.
        """
        router = self.router
        now = time.monotonic()
        progressed = False
        for identity in list(self.peers):
            peer = self.peers[identity]
            self._settle_inflight(peer)
            cursors = peer.cursors
            if cursors:
                cursor = cursors[0]
                outcome = self._advance(router, peer, cursor)
                if outcome == "progress":
                    progressed = True
                    cursor.stalled_since_s = None
                elif outcome == "stalled":
                    if cursor.stalled_since_s is None:
                        cursor.stalled_since_s = now
                    elif now - cursor.stalled_since_s >= self.stall_timeout_s:
                        # Its later requests would stall behind this one: drop them all.
                        while cursors:
                            self.abandon(cursors.popleft(), "client_stalled")
                elif outcome == "gone":
                    progressed = True
                    while cursors:
                        self.abandon(cursors.popleft(), "client_gone")
                if cursors and cursors[0] is cursor and cursor.end_sent:
                    cursors.popleft()
                    self.pending -= 1
            if not peer.cursors and not peer.inflight and not peer.carry_bytes:
                del self.peers[identity]
        self.stalled = not progressed
        return progressed

    def _settle_inflight(self, peer: ReplayPeer) -> None:
        inflight = peer.inflight
        while inflight and inflight[0][0].done:
            _, size, messages = inflight.popleft()
            peer.inflight_bytes -= size
            peer.inflight_messages -= messages
            self.inflight_total -= size

    def _forget_inflight(self, peer: ReplayPeer) -> None:
        """The peer is gone: ZeroMQ dropped its queue, so nothing is held for it."""
        self.inflight_total -= peer.inflight_bytes
        peer.inflight.clear()
        peer.inflight_bytes = peer.inflight_messages = 0
        peer.carry_bytes = peer.carry_messages = 0

    def _plan(self, peer: ReplayPeer, cursor: ReplayCursor, room: int) -> list[tuple[int, bytes]]:
        """The next entries of ``cursor`` that fit ``room`` messages and both byte caps.

        A batch larger than a cap goes alone, when nothing is held.
        """
        snapshot = cursor.snapshot
        size = 0
        plan: list[tuple[int, bytes]] = []
        while cursor.position + len(plan) < len(snapshot) and len(plan) < min(
            self.slice_replies, room
        ):
            entry = snapshot[cursor.position + len(plan)]
            mine = peer.inflight_bytes + size
            everyone = self.inflight_total + size
            if not (
                (mine + len(entry[1]) <= self.max_client_bytes or mine == 0)
                and (everyone + len(entry[1]) <= self.max_bytes_in_flight or everyone == 0)
            ):
                break
            plan.append(entry)
            size += len(entry[1])
        return plan

    def _advance(self, router: zmq.Socket[Any], peer: ReplayPeer, cursor: ReplayCursor) -> str:
        """Send up to one slice for ``cursor``: ``progress``, ``stalled`` or ``gone``.

        Keeps the peer's unconfirmed messages below ``sndhwm_messages`` (so ZeroMQ never
        refuses part of a slice) and its bytes below the per-peer and total caps.  The
        slice's last payload is tracked; when ZeroMQ is done with it, the slice's bytes
        are released.
        """
        room = self.sndhwm_messages - 1 - peer.inflight_messages  # one left for the end marker
        plan = self._plan(peer, cursor, room)
        sent = size = 0
        try:
            for k, (seq, payload) in enumerate(plan):
                frames = pack_replay_reply(cursor.identity, self.topic_frame, seq, payload)
                router.send_multipart(frames[:-1], zmq.SNDMORE | zmq.NOBLOCK)
                if k + 1 == len(plan):
                    tracker = router.send(
                        zmq.Frame(payload, track=True, copy=False),
                        zmq.NOBLOCK,
                        copy=False,
                        track=True,
                    )
                    size += len(payload)
                    # Earlier sends cut short are released with this one (FIFO).
                    peer.inflight.append(
                        (tracker, size + peer.carry_bytes, len(plan) + peer.carry_messages)
                    )
                    peer.inflight_bytes += size
                    peer.inflight_messages += len(plan)
                    self.inflight_total += size
                    peer.carry_bytes = peer.carry_messages = 0
                    size = 0
                else:
                    router.send(payload, zmq.NOBLOCK)
                    size += len(payload)
                cursor.position += 1
                sent += 1
                self.stats.replay_batches_sent += 1
            if cursor.position >= len(cursor.snapshot) and room - sent >= 0 and not cursor.end_sent:
                router.send_multipart(pack_replay_end(cursor.identity), zmq.NOBLOCK)
                cursor.end_sent = True
                self.stats.replays_completed += 1
        except zmq.Again:
            # Not expected (the peer's queue is kept below its HWM); retried later.  Bytes
            # of untracked sends stay counted until the peer's next tracked one is done.
            if size:
                peer.carry_bytes += size
                peer.carry_messages += sent
                peer.inflight_bytes += size
                peer.inflight_messages += sent
                self.inflight_total += size
            return "progress" if sent else "stalled"
        except zmq.ZMQError as exc:
            self._forget_inflight(peer)
            if exc.errno == zmq.EHOSTUNREACH:
                return "gone"
            self.stats.send_errors += 1
            self.error_log.warning("error", "replay send failed: %s", exc)
            return "gone"
        return "progress" if sent or cursor.end_sent else "stalled"

    def abandon(self, cursor: ReplayCursor, reason: str) -> None:
        """Drop ``cursor`` (already taken off its peer), counting its unsent replies."""
        self.pending -= 1
        self.stats.replay_batches_dropped += cursor.remaining
        self.stats.replay_drop_reasons[reason] += cursor.remaining
        self.request_log.warning(
            "request", "abandoned a replay (%s) with %d replies unsent", reason, cursor.remaining
        )

    def abandon_all(self, reason: str) -> None:
        """Drop every replay in progress (at shutdown), counting their unsent replies."""
        for peer in self.peers.values():
            while peer.cursors:
                self.abandon(peer.cursors.popleft(), reason)
