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

from kvevents.consumers.seqtrack import StartReplay
from kvevents.consumers.subscriber.items import LIVE_AGAIN, STALE, Anomaly
from kvevents.consumers.subscriber.outbox import Outbox
from kvevents.consumers.subscriber.streams import Stream, StreamKey

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

    def next_check_s(self, now: float) -> float | None:
        """Seconds until the next probe or stale check is due (may be negative: overdue),
        None when nothing is watched."""
        stale = self.stale_after_s
        if stale is None:
            return None
        waits: list[float] = []
        for st in self.streams.values():
            if st.channel is not None:
                waits.append(max(st.heard, st.probe_at) + stale / 3 - now)
                if not st.stale:
                    waits.append(st.heard + stale - now)
        return min(waits) if waits else None

    def check(self, now: float) -> None:
        """Probe the streams silent for a third of ``stale_after_s`` and report the ones
        silent for all of it."""
        stale_after = self.stale_after_s
        if stale_after is None:
            return
        outbox = self.outbox
        for key, st in self.streams.items():
            if st.channel is None:
                continue  # silence alone proves nothing
            idle = now - st.heard
            if now - max(st.heard, st.probe_at) >= stale_after / 3:
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
