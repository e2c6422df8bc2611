"""Routing what a replay channel answers, and what the live connection reports, to the
streams concerned: :class:`ReplyRouter`.

One job: replies, end markers and connection events in; tracker inputs and scheduler
calls out.  After the live socket of a source reconnects, every stream of it is checked
(by replay) before anything new is applied, and replies are ignored while the live
connection is down (the endpoint may already be a new process).  May import the
subscriber's tables, outbox, stream table, liveness and replay scheduler.
"""

from __future__ import annotations

from kvevents.consumers.source_protocol import Source, SourceMessage
from kvevents.consumers.subscriber.liveness import Liveness
from kvevents.consumers.subscriber.outbox import Outbox
from kvevents.consumers.subscriber.replay import ReplayScheduler
from kvevents.consumers.subscriber.streams import HeldBatch, fingerprint
from kvevents.consumers.subscriber.table import StreamTable

__all__ = ["ReplyRouter"]


class ReplyRouter:
    """Routes replies of ``scheduler``'s requests to the streams of ``table``.  Times are
    ``time.monotonic()`` seconds."""

    def __init__(
        self,
        table: StreamTable,
        outbox: Outbox,
        liveness: Liveness,
        scheduler: ReplayScheduler,
    ) -> None:
        self.table = table
        self.streams = table.streams
        self.outbox = outbox
        self.liveness = liveness
        self.scheduler = scheduler
        self.dropped: set[str] = set()
        """Sources whose live connection dropped and has not come back."""

    def reply(self, src: Source, msg: SourceMessage, origin: str, now: float) -> None:
        """A replayed batch from ``src`` (``origin``: the publisher it names)."""
        stats = self.outbox.stats
        sched = self.scheduler
        ck = (src.name, msg.channel)
        job = sched.in_flight_job(ck)
        if job is None:
            stats.dropped["stale_replay"] += 1
            return
        if src.name in self.dropped:
            # The live connection dropped and has not come back: the replay endpoint
            # may already be a new process, whose batches must not extend the old
            # streams before the identity check the reconnect runs.
            stats.dropped["unverified_replay"] += 1
            return
        job.replies += 1
        # The timeout bounds a replay without progress: every reply renews it.
        job.deadline = now + sched.replay_timeout_s
        table = self.table
        decoded = table.decode(origin, msg)
        if decoded is None:
            return
        # A reply without a topic frame (vLLM before 0.26) on a channel serving any
        # topic: the stream it answers, else the source's last live topic.
        topic = msg.topic or (job.topic if job.catch_up is None else table.last_topic(src.name))
        key = (table.worker_source(origin, topic), decoded.data_parallel_rank or 0)
        item = HeldBatch(topic, msg.payload, decoded, msg.recv_ts, True)
        if job.catch_up is not None:
            replay_id = job.catch_up.get(key)
            if replay_id is None:
                st = table.open(key, src, topic, now)
                start = None if key in job.declined else st.tracker.catch_up()
                if start is None:  # already following: live traffic got there first
                    job.declined.add(key)
                    stats.dropped["catch_up_overlap"] += 1
                    return
                replay_id = job.catch_up[key] = start.replay_id
        elif key != job.stream:
            stats.dropped["replay_other_stream"] += 1
            return
        else:
            replay_id = job.replay_id
        st = self.streams[key]
        self.liveness.heard(st, now)
        self.scheduler.apply(
            key, st.tracker.replayed(replay_id, msg.seq, item, fingerprint(msg.payload))
        )
        if job.replies > sched.max_replay_batches:
            sched.abandon(ck, f"replay sent over {sched.max_replay_batches} batches")
        elif job.catch_up is None and (
            not st.tracker.replaying or st.tracker.replay_id != job.replay_id
        ):
            # The stream gave this replay up (too much buffered, a restart): stop
            # reading a reply stream nobody waits for.
            sched.abandon(ck, "")

    def end(self, src: Source, msg: SourceMessage, now: float) -> None:
        """The end marker of the request in flight on ``msg``'s channel."""
        ck = (src.name, msg.channel)
        sched = self.scheduler
        if sched.in_flight_job(ck) is None:
            self.outbox.stats.dropped["stale_replay_end"] += 1
            return
        job = sched.complete(ck)
        for key, replay_id in job.streams():
            st = self.streams[key]
            self.liveness.heard(st, now)
            self.scheduler.apply(key, st.tracker.replay_end(replay_id))
        sched.pump(now)

    def disconnected(self, src: Source) -> None:
        """The live socket of ``src`` dropped (counted and logged)."""
        self.outbox.stats.connections["disconnected"] += 1
        self.dropped.add(src.name)
        self.outbox.log.warning(
            "disconnected:" + src.name,
            "%s: live connection dropped (peer gone, or a frame over max_message_size_bytes)",
            src.name,
        )

    def connected(self, src: Source, now: float, *, catch_up: bool) -> None:
        """The live socket of ``src`` connected.  After a drop, requests in flight are
        resent and every stream's identity is checked before anything the new
        connection delivers is applied; with ``catch_up`` the channels with no stream
        known yet are asked for their ring (what was published before the connection
        never arrives live)."""
        self.outbox.stats.connections["connected"] += 1
        sched = self.scheduler
        if src.name in self.dropped:
            self.dropped.discard(src.name)
            sched.resend_in_flight(src)
            for key, st in list(self.streams.items()):
                if st.src is src:
                    self.scheduler.apply(key, st.tracker.verify())
            sched.pump(now)
        seeded = sched.resumed_on_connect(src)
        if seeded is not None:
            # Streams resumed from a snapshot: checked from their resume points instead
            # of a catch-up of the whole ring.
            for key in seeded:
                req = self.streams[key].tracker.check_resume()
                if req is not None:
                    sched.schedule(key, req)
        elif catch_up:
            sched.catch_up_source(src, now)

    def replay_disconnected(self, src: Source, channel: str, now: float) -> None:
        """A replay DEALER of ``src`` (``channel``) lost its connection."""
        self.outbox.stats.connections["replay_disconnected"] += 1
        publisher_gone = src.name in self.dropped
        self.scheduler.replay_disconnected(src, channel, now, publisher_gone=publisher_gone)
