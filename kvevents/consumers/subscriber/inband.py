"""Replays answered in band: a capture file cannot be asked for a replay, but the
replayed records it holds after a gap are the replay that answered it.

One job: :class:`InbandReplays`.  The replays its streams' trackers ask for are awaited
here too (a capture's streams are replayed in band only).  A capture records frames in
the order they were read, so live records interleave with a replay's replies (as they did
on the recorder's two sockets).  A recorded replay ends at its recorded end marker, or
when ``inband_window`` live records followed its start without it (a capture that holds
no end markers; a gap never repaired is then reported lost).  A stream whose first
record is a replayed one was caught up by the recorder: that catch-up is awaited in band
too.  May import the subscriber's tables and outbox.
"""

from __future__ import annotations

from kvevents.consumers.source_protocol import Source, SourceMessage
from kvevents.consumers.subscriber.outbox import Outbox
from kvevents.consumers.subscriber.streams import HeldBatch, ReplayJob, Stream, StreamKey
from kvevents.seqtrack import StartReplay, StreamTracker, TrackerAction

__all__ = ["InbandReplays"]


class InbandReplays:
    """The in-band replays waiting for their records, one per stream of ``streams``.
    ``inband_window``: live records a gap may be followed by before it is given up."""

    def __init__(
        self, streams: dict[StreamKey, Stream], outbox: Outbox, inband_window: int
    ) -> None:
        self.streams = streams
        self.outbox = outbox
        self.inband_window = inband_window
        self.jobs: dict[StreamKey, ReplayJob] = {}

    @property
    def idle(self) -> bool:
        """No recorded replay is awaited."""
        return not self.jobs

    def start(self, key: StreamKey, st: Stream, req: StartReplay) -> None:
        """Await the recorded replay answering ``req`` of stream ``key``."""
        self.outbox.stats.replays["inband"] += 1
        self.jobs[key] = ReplayJob(
            key, (st.src.name, ""), st.topic, req.start, req.replay_id, float("inf"), True
        )

    def live(
        self,
        key: StreamKey,
        tracker: StreamTracker[HeldBatch],
        msg: SourceMessage,
        item: HeldBatch,
        fingerprint: int,
    ) -> bool:
        """Route a capture's record of stream ``key``: True when it was consumed (a
        recorded reply, or a stale replayed record dropped); False when the caller
        applies it as a live batch."""
        job = self.jobs.get(key)
        if job is None and msg.replayed and tracker.last is None:
            # the recorder's catch-up of a stream it joined: its live records may come
            # before the catch-up's end marker, as they did when it was recorded
            req = tracker.catch_up()
            if req is not None:
                self.start(key, self.streams[key], req)
                job = self.jobs[key]
        if job is not None:
            if msg.replayed:
                job.replies += 1
                self._apply(key, tracker.replayed(job.replay_id, msg.seq, item, fingerprint))
                return True
            job.waited += 1
            if job.waited > self.inband_window:
                self.end_job(key, job)
        elif msg.replayed and tracker.last is not None and msg.seq <= tracker.last:
            self.outbox.stats.dropped["stale_replay"] += 1
            return True
        return False

    def end_job(self, key: StreamKey, job: ReplayJob, *, marker: bool = False) -> None:
        """The recorded replay of ``key`` is over: it ended (at its recorded end
        ``marker``, or as live records followed its replies), or never came."""
        del self.jobs[key]
        tracker = self.streams[key].tracker
        if job.replies or marker:
            self._apply(key, tracker.replay_end(job.replay_id))
        else:  # a recording without the replay that answered: nothing to check it by
            self._apply(key, tracker.replay_failed(job.replay_id, "not in the capture"))

    def end(self, src: Source, *, everything: bool, origin: str = "") -> None:
        """A recorded end marker of ``origin`` (or, with ``everything``, the end of the
        file ``src``): end the replays it answers; at the end of the file, whatever is
        still waiting on a replay the file never held is lost."""
        for key, job in list(self.jobs.items()):
            st = self.streams.get(key)
            owned = st is not None and st.src is src
            mine = everything or key[0] == origin or key[0].startswith(origin + "#")
            if owned and mine and key in self.jobs:
                self.end_job(key, job, marker=not everything)
        if everything:
            for key, job in list(self.jobs.items()):
                if self.streams[key].src is src:
                    del self.jobs[key]
                    self._apply(
                        key,
                        self.streams[key].tracker.replay_failed(job.replay_id, "capture ended"),
                    )

    def _apply(self, key: StreamKey, actions: list[TrackerAction[HeldBatch]]) -> None:
        """Carry out ``actions`` of stream ``key``'s tracker; the replay they ask for is
        awaited in band (what the replay scheduler does for a capture's stream)."""
        request = self.outbox.apply(key, actions)
        if request is not None:
            self.start(key, self.streams[key], request)
