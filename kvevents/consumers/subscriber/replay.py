"""Replay scheduling: every request a stream's tracker makes goes through one
:class:`ReplayScheduler`, which queues it per replay channel, sends at most
``max_concurrent_replays`` at once, routes the replies back to the streams they answer,
enforces ``replay_timeout_s`` and ``replay_cooldown_s``, and resends or fails requests
whose connection dropped.  The start-up catch-up (the whole ring of every channel) runs
here too.  Replies are routed by :mod:`~kvevents.consumers.subscriber.replies`.

One job: :class:`ReplayScheduler`.  May import the subscriber's items, tables, outbox,
stream table and in-band rooms, and the source protocol.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

from kvevents.consumers.source_protocol import Source
from kvevents.consumers.subscriber.inband import InbandReplays
from kvevents.consumers.subscriber.items import REPLAY_TIMEOUT, Anomaly
from kvevents.consumers.subscriber.outbox import Outbox
from kvevents.consumers.subscriber.streams import (
    ChannelKey,
    HeldBatch,
    ReplayJob,
    StreamKey,
    cancel_replay,
    replay_channels,
    request_replay,
)
from kvevents.consumers.subscriber.table import StreamTable
from kvevents.errors import KVEventsError
from kvevents.seqtrack import StartReplay, TrackerAction

__all__ = ["RESENDS", "ReplayScheduler"]

logger = logging.getLogger(__name__)

RESENDS = 2
"""How many times a replay request is resent after its connection dropped."""


class ReplayScheduler:
    """Replay requests of the streams in ``table``, over ``sources``.

    ``replay_timeout_s`` bounds how long a request may wait without progress (to start,
    including queueing, and between two replies); ``max_concurrent_replays`` bounds the
    requests in flight; ``replay_cooldown_s`` is how long a channel that timed out is not
    asked again; ``max_replay_batches`` bounds the replies to one request.  Times are
    ``time.monotonic()`` seconds."""

    def __init__(
        self,
        sources: Sequence[Source],
        table: StreamTable,
        outbox: Outbox,
        inband: InbandReplays,
        *,
        replay_timeout_s: float,
        max_concurrent_replays: int,
        replay_cooldown_s: float,
        max_replay_batches: int,
    ) -> None:
        self.sources = sources
        self.table = table
        self.streams = table.streams
        self.outbox = outbox
        self.inband = inband
        self.replay_timeout_s = replay_timeout_s
        self.max_concurrent_replays = max_concurrent_replays
        self.replay_cooldown_s = replay_cooldown_s
        self.max_replay_batches = max_replay_batches
        self.queues: dict[ChannelKey, deque[ReplayJob]] = {}
        self.in_flight = 0
        """Requests sent and not finished."""
        self._cooldown_until: dict[ChannelKey, float] = {}
        self.cut_channels: set[ChannelKey] = set()
        """The channels closed during the current read (:meth:`new_read` empties it)."""
        self._by_name = {src.name: src for src in sources}
        self._resume_on_connect: dict[str, list[StreamKey]] = {}
        """Per source name, the streams seeded with a resume point whose check waits for
        the live socket to connect (it replaces that source's first catch-up)."""
        self.touched: list[Source] = []
        """Sources asked for a replay or told to drop one since the last
        :meth:`take_touched` (read only)."""

    def take_touched(self) -> list[Source]:
        """The sources asked for a replay or told to drop one since the last call (their
        sockets' state changed: the caller settles them before waiting)."""
        touched = self.touched
        self.touched = []
        return touched

    def check_on_connect(self, src: Source, key: StreamKey) -> None:
        """Check stream ``key``'s resume point (:meth:`StreamTracker.check_resume`) once
        ``src``'s live socket connects, instead of catching ``src`` up."""
        self._resume_on_connect.setdefault(src.name, []).append(key)

    def resumed_on_connect(self, src: Source) -> list[StreamKey] | None:
        """The streams of ``src`` waiting for its connection to check their resume
        points (None: none were; they are forgotten here, once asked)."""
        return self._resume_on_connect.pop(src.name, None)

    def new_read(self) -> None:
        """A new read of one source begins (replies of a DEALER closed during the
        previous read are stale no more: they cannot be read again)."""
        self.cut_channels.clear()

    def next_deadline_s(self, now: float) -> float | None:
        """Seconds until the next request deadline (may be negative), None if none."""
        if not self.queues:
            return None
        deadlines = [job.deadline for queue in self.queues.values() for job in queue]
        return min(deadlines) - now if deadlines else None

    # --- requests -------------------------------------------------------------------
    def apply(self, key: StreamKey, actions: list[TrackerAction[HeldBatch]]) -> None:
        """Carry out ``actions`` of stream ``key``'s tracker: the outbox turns them into
        items, and the replay they ask for (if any) is scheduled after them."""
        request = self.outbox.apply(key, actions)
        if request is not None:
            self.schedule(key, request)

    def schedule(self, key: StreamKey, req: StartReplay, *, probe: bool = False) -> None:
        """Queue ``req`` of stream ``key`` (``probe``: a liveness probe, whose timeout
        is not reported), or fail it at once when it cannot be made."""
        st = self.streams[key]
        src = st.src
        tracker = st.tracker
        now = time.monotonic()
        if src.replay_inband:
            self.inband.start(key, st, req)
            return
        if st.channel is None:
            self.outbox.stats.replays["unavailable"] += 1
            self.apply(key, tracker.replay_failed(req.replay_id, "no replay endpoint"))
            return
        ck = (src.name, st.channel)
        if now < self._cooldown_until.get(ck, 0.0):
            self.outbox.stats.replays["cooldown"] += 1
            detail = "replay endpoint timed out recently (cooldown)"
            self.apply(key, tracker.replay_failed(req.replay_id, detail))
            return
        queue = self.queues.setdefault(ck, deque())
        if (
            req.start == 0
            and tracker.last is None  # (a catch-up, not a check of an applied seq 0)
            and self._join_catch_up(queue, key, st.topic, req.replay_id)
        ):
            return
        deadline = now + self.replay_timeout_s
        queue.append(ReplayJob(key, ck, st.topic, req.start, req.replay_id, deadline, probe=probe))
        self.pump(now)

    def _join_catch_up(
        self, queue: deque[ReplayJob], key: StreamKey, topic: bytes, replay_id: int
    ) -> bool:
        """Let stream ``key``'s request from seq 0 (its catch-up) ride on a catch-up of
        the whole ring already asked of its channel, instead of asking for the ring a
        second time: True when it joined one.  A catch-up not yet sent takes it in any
        case; one in flight only when it has handed this stream nothing yet (its replies
        come in seq order, so the stream still gets the ring from its oldest seq)."""
        for job in queue:
            joined = job.catch_up
            if joined is None or (job.topic and job.topic != topic):
                continue
            if job.sent and (key in joined or key in job.declined):
                continue
            joined[key] = replay_id
            self.outbox.stats.replays["joined"] += 1
            return True
        return False

    def catch_up_sources(self) -> None:
        """Ask every replay channel for its whole ring at once, so a subscriber catches
        up even on idle engines.  A source that reports connection events is asked when
        its live socket connects instead (and again after each reconnect), so nothing
        published before the connection is missed."""
        now = time.monotonic()
        for src in self.sources:
            if not getattr(src, "monitored", False):
                self.catch_up_source(src, now)

    def catch_up_source(self, src: Source, now: float) -> None:
        """Ask ``src``'s channels for their whole ring, once per channel: the replies
        create the streams they belong to (the rank is in each batch, the topic in the
        reply or the channel).  A channel is not asked again when it already has a
        catch-up queued or in flight (a request from seq 0 answers the whole ring: it
        becomes that catch-up), or when it already has streams: each of them checks its
        identity by a replay from its last applied seq, and a replay of the whole ring
        would bring them nothing but copies."""
        if src.replay_inband or not src.can_replay:
            return
        known = {st.channel for st in self.streams.values() if st.src is src}
        for channel, topic in replay_channels(src).items():
            ck = (src.name, channel)
            queue = self.queues.setdefault(ck, deque())
            if channel in known or any(j.catch_up is not None for j in queue):
                continue
            whole = next((j for j in queue if j.start == 0), None)
            if whole is not None:
                whole.catch_up = {whole.stream: whole.replay_id}
                self.outbox.stats.replays["catch_up"] += 1
                continue
            self.outbox.stats.replays["catch_up"] += 1
            deadline = now + self.replay_timeout_s
            queue.append(ReplayJob((src.name, -1), ck, topic, 0, 0, deadline, catch_up={}))
        self.pump(now)

    # --- seams for the reply router ---------------------------------------------------
    def in_flight_job(self, ck: ChannelKey) -> ReplayJob | None:
        """The request in flight on channel ``ck`` whose replies are being read, None when
        there is none (or its DEALER was closed during this read: what was read from it
        answers nothing now)."""
        if ck in self.cut_channels:
            return None
        queue = self.queues.get(ck)
        return queue[0] if queue and queue[0].sent else None

    def complete(self, ck: ChannelKey) -> ReplayJob:
        """Take the request in flight on ``ck`` off its queue (its end marker came; the
        caller checks :meth:`in_flight_job` first and calls :meth:`pump` after applying
        the end to its streams)."""
        job = self.queues[ck].popleft()
        self.in_flight -= 1
        self.outbox.stats.replays["completed"] += 1
        return job

    def resend_in_flight(self, src: Source) -> None:
        """``src``'s live connection came back: requests in flight on its channels went to
        a connection that is gone, so they are sent again (their channels' cooldowns are
        lifted too).  Call :meth:`pump` after."""
        for ck, queue in self.queues.items():
            if ck[0] == src.name and queue and queue[0].sent:
                job = queue[0]
                self._cut(src, ck, job.topic)
                job.sent = False
                self.in_flight -= 1
                self.outbox.stats.replays["resent"] += 1
            self._cooldown_until.pop(ck, None)

    def replay_disconnected(
        self, src: Source, channel: str, now: float, *, publisher_gone: bool
    ) -> None:
        """A replay DEALER lost its connection: the request in flight (if any) is lost.
        It is resent (at most :data:`RESENDS` times, then failed), or dropped when the
        publisher is gone (``publisher_gone``: its live connection dropped too) and it was
        a catch-up, which the reconnect asks for again after checking every stream."""
        queue = self.queues.get((src.name, channel))
        if not queue or not queue[0].sent:
            return
        job = queue[0]
        self._cut(src, (src.name, channel), job.topic)
        job.sent = False
        self.in_flight -= 1
        stats = self.outbox.stats
        if publisher_gone and job.catch_up is not None:
            queue.popleft()
            stats.replays["superseded"] += 1
            return
        job.resends += 1
        if job.resends > RESENDS:
            queue.popleft()
            stats.replays["connection_lost"] += 1
            self._fail_job(
                job,
                f"replay connection to {channel} dropped {job.resends} times "
                "(publisher gone, or a reply over max_message_size_bytes)",
                conclusive=False,
            )
        else:
            stats.replays["resent"] += 1
        self.pump(now)

    # --- deadlines ------------------------------------------------------------------
    def check_deadlines(self, now: float) -> None:
        """Time out the requests past their deadline: a request in flight closes its
        channel for ``replay_cooldown_s`` and fails every request queued on it; a queued
        one that could not start in time fails alone."""
        expired = False
        queues = self.queues
        for ck, queue in list(queues.items()):
            if not queue:
                # Forget idle channels, so that this pass (once a step) and the next
                # deadline's cost follow the channels with requests, not all of them.
                if queues.get(ck) is queue:
                    del queues[ck]
                continue
            if all(job.deadline > now for job in queue):
                continue
            expired = True
            head = queue[0]
            if head.sent and head.deadline <= now:
                self._time_out(ck, queue, now)
                continue
            keep: deque[ReplayJob] = deque()
            for job in queue:
                if not job.sent and job.deadline <= now:
                    self.outbox.stats.replays["queue_timeout"] += 1
                    self._fail_job(
                        job,
                        f"replay could not start within {self.replay_timeout_s:g} s "
                        f"({self.max_concurrent_replays} already running)",
                    )
                else:
                    keep.append(job)
            queue.clear()
            queue.extend(keep)
        if expired:
            self.pump(now)

    def _time_out(self, ck: ChannelKey, queue: deque[ReplayJob], now: float) -> None:
        # The endpoint is dead or too slow: drop the request in flight, fail every
        # request queued for this channel, and leave it alone for a while.
        head = queue[0]
        self._cut(self._by_name[ck[0]], ck, head.topic)
        self.in_flight -= 1
        self._cooldown_until[ck] = now + self.replay_cooldown_s
        self.outbox.stats.replays["timed_out"] += 1
        detail = (
            f"replay from seq {head.start} got no end marker within "
            f"{self.replay_timeout_s:g} s ({head.replies} repl(ies))"
        )
        if not head.probe:
            self.outbox.log.warning(f"replay_timeout:{ck}", "%s: %s", ck[1], detail)
            rank = None if head.catch_up is not None else head.stream[1]
            self.outbox.emit(
                Anomaly(REPLAY_TIMEOUT, head.stream[0], rank, head.start, None, detail)
            )
        jobs = list(queue)
        queue.clear()
        for job in jobs:
            self._fail_job(job, detail)

    # --- internals ------------------------------------------------------------------
    def pump(self, now: float) -> None:
        """Send queued requests while fewer than ``max_concurrent_replays`` are in flight
        (one per channel at a time: replies on a DEALER carry no request id)."""
        for ck, queue in self.queues.items():
            while queue and not queue[0].sent:
                job = queue[0]
                st = self.streams.get(job.stream)
                if job.catch_up is None and (
                    st is None or not st.tracker.replaying or st.tracker.replay_id != job.replay_id
                ):
                    queue.popleft()
                    self.outbox.stats.replays["superseded"] += 1
                    continue
                if self.in_flight >= self.max_concurrent_replays:
                    break
                src = self._by_name[ck[0]]
                try:
                    request_replay(src, job.start, job.topic)
                except KVEventsError as exc:  # (e.g. CURVE keys no longer readable)
                    queue.popleft()
                    self.outbox.stats.replays["request_failed"] += 1
                    detail = f"replay request failed: {exc}"
                    self.outbox.log.warning(f"request_failed:{ck}", "%s: %s", ck[1], detail)
                    self._fail_job(job, detail, conclusive=False)
                    continue
                self.touched.append(src)
                job.sent = True
                job.deadline = now + self.replay_timeout_s
                self.in_flight += 1
                self.outbox.stats.replays["requested"] += 1
                logger.debug("%s: replay from seq %d requested on %s", src.name, job.start, ck[1])
            if self.in_flight >= self.max_concurrent_replays:
                return

    def _fail_job(self, job: ReplayJob, detail: str, *, conclusive: bool = True) -> None:
        for key, replay_id in job.streams():
            tracker = self.streams[key].tracker
            self.apply(key, tracker.replay_failed(replay_id, detail, conclusive=conclusive))

    def _cut(self, src: Source, ck: ChannelKey, topic: bytes) -> None:
        """Close ``ck``'s DEALER; replies of it already read in this batch are stale."""
        cancel_replay(src, topic)
        self.touched.append(src)
        self.cut_channels.add(ck)

    def abandon(self, ck: ChannelKey, detail: str) -> None:
        """Drop the replay in flight on ``ck`` (its DEALER is closed: no reply to it can
        arrive any more); with ``detail``, its streams are told it failed."""
        queue = self.queues[ck]
        job = queue.popleft()
        self._cut(self._by_name[ck[0]], ck, job.topic)
        self.in_flight -= 1
        self.outbox.stats.replays["abandoned"] += 1
        if detail:
            self.outbox.log.warning(f"abandoned:{ck}", "%s: %s", ck[1], detail)
            self._fail_job(job, detail)
        self.pump(time.monotonic())
