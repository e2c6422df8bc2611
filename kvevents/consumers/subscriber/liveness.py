"""Liveness: which workers are silent, when to probe them, when they are stale.

Idle engines publish nothing, so silence alone proves nothing.  After a third of
``stale_after_s`` without a batch, a worker's replay endpoint is probed (a request from
its last seq: the end marker answers); a worker with neither a batch nor an answer for
``stale_after_s`` is reported ``stale`` and ``live`` again when heard from.  A worker
without a replay endpoint is never made stale by silence.

One job: :class:`Liveness`.  May import the subscriber's items, tables and outbox.
"""

from __future__ import annotations

from collections.abc import Callable

from kvevents.consumers.subscriber.items import LIVE_AGAIN, STALE, Anomaly
from kvevents.consumers.subscriber.outbox import Outbox
from kvevents.consumers.subscriber.streams import Stream, StreamKey
from kvevents.seqtrack import StartReplay

__all__ = ["Liveness", "ProbeHook"]

ProbeHook = Callable[[StreamKey, StartReplay], None]
"""Schedules a liveness probe (a replay request flagged as a probe)."""


class Liveness:
    """Tracks when each stream of ``streams`` was last heard from, with the bound
    ``stale_after_s`` (seconds; None: never stale).  ``probe`` sends a probe request.
    All times are ``time.monotonic()`` seconds."""

    def __init__(
        self,
        streams: dict[StreamKey, Stream],
        outbox: Outbox,
        stale_after_s: float | None,
        probe: ProbeHook,
    ) -> None:
        self.streams = streams
        self.outbox = outbox
        self.stale_after_s = stale_after_s
        self.probe = probe
        self.check_at = float("-inf") if stale_after_s is not None else float("inf")
        """No stream is due for a probe or a stale report before this (monotonic
        seconds; +inf when ``stale_after_s`` is None): the earliest due time the last
        scan found.  Between scans a stream's due times only move later (``heard`` only
        grows), and a new stream is first due a third of ``stale_after_s`` after it
        starts, never before the next scan; so a wake-up before it skips :meth:`check`,
        which costs O(streams)."""

    def heard(self, st: Stream, now: float, *, live: bool = False) -> None:
        """``st`` was heard from at ``now`` (``live``: a live batch); a stale stream is
        reported ``live`` again."""
        st.heard = now
        if live:
            st.live_at = now
        if st.stale:
            self.revive(st)

    def revive(self, st: Stream) -> None:
        """Report stale ``st`` ``live`` again (call when it was heard from)."""
        st.stale = False
        self.outbox.stats.stale_workers -= 1
        self.outbox.emit(Anomaly(LIVE_AGAIN, st.key[0], st.key[1], detail="heard from again"))

    def resumed_after_silence(self, st: Stream, now: float) -> bool:
        """Whether a live batch at ``now`` ends a silence long enough that the stream's
        identity should be checked (a restart behind a proxy looks like this)."""
        stale = self.stale_after_s
        return (
            stale is not None
            and st.channel is not None
            and st.tracker.last is not None
            and now - st.live_at >= stale / 3
        )

    def check(self, now: float) -> None:
        """Probe the streams silent for a third of ``stale_after_s`` and report the ones
        silent for all of it.  A call before the earliest due time the last call found
        returns at once."""
        stale_after = self.stale_after_s
        if stale_after is None or now < self.check_at:
            return
        third = stale_after / 3
        outbox = self.outbox
        scan_at = now + third
        for key, st in self.streams.items():
            if st.channel is None:
                continue  # silence alone proves nothing
            idle = now - st.heard
            if now - max(st.heard, st.probe_at) >= third:
                st.probe_at = now
                req = st.tracker.probe()
                if req is not None:
                    outbox.stats.replays["probe"] += 1
                    self.probe(key, req)
            if idle >= stale_after and not st.stale:
                st.stale = True
                outbox.stats.stale_workers += 1
                detail = f"no batch and no replay answer for {idle:.1f} s"
                outbox.log.warning(f"stale:{key[0]}", "%s rank %d: stale (%s)", *key, detail)
                outbox.emit(Anomaly(STALE, key[0], key[1], detail=detail))
            due = max(st.heard, st.probe_at) + third
            if not st.stale:
                due = min(due, st.heard + stale_after)
            if due < scan_at:
                scan_at = due
        self.check_at = scan_at
