"""Where a subscriber's items wait to be taken: the :class:`Outbox` turns a
:class:`~kvevents.seqtrack.StreamTracker`'s actions into
:class:`~kvevents.consumers.subscriber.ReceivedBatch` and
:class:`~kvevents.consumers.subscriber.Anomaly` values, in order, and counts them.

One job: actions in, items and counters out.  A :class:`StartReplay` action is returned
to the caller, who schedules it (the replay room's
:meth:`~kvevents.consumers.subscriber.replay.ReplayScheduler.apply`).  May import the subscriber's items and
tables, :mod:`kvevents.seqtrack`, :mod:`kvevents.events` and
:mod:`kvevents.ratelimit`.
"""

from __future__ import annotations

from collections import deque

from kvevents.consumers.subscriber.items import (
    Anomaly,
    SubscriberItem,
    SubscriberStats,
    received_batch,
)
from kvevents.consumers.subscriber.streams import HeldBatch, StreamKey
from kvevents.events import KVEventBatch
from kvevents.ratelimit import RateLimitedLog
from kvevents.seqtrack import (
    DUPLICATE,
    GAP,
    HISTORY_MISSED,
    UNRECOVERABLE_LOSS,
    Deliver,
    Drop,
    Report,
    StartReplay,
    TrackerAction,
)

__all__ = ["Outbox"]


class Outbox:
    """The items ready to be taken (:attr:`items`, oldest first) and the counters
    (:attr:`stats`).  :attr:`last_delivery` maps each stream to the wall-clock receive
    time of its last delivered batch."""

    __slots__ = ("items", "last_delivery", "log", "stats")

    def __init__(self, stats: SubscriberStats, log: RateLimitedLog) -> None:
        self.stats = stats
        self.log = log
        self.items: deque[SubscriberItem] = deque()
        self.last_delivery: dict[StreamKey, float] = {}

    def emit(self, anomaly: Anomaly) -> None:
        """Count ``anomaly`` and queue it."""
        self.stats.anomalies[anomaly.kind] += 1
        self.items.append(anomaly)

    def deliver(
        self,
        key: StreamKey,
        seq: int,
        batch: KVEventBatch,
        replayed: bool,
        topic: bytes,
        payload: bytes,
        recv_ts: float,
    ) -> None:
        """Queue one batch of stream ``key`` as delivered and count it: what a tracker's
        ``Deliver`` asks for (:meth:`apply`), and what the in-order live path calls
        directly, without the tracker's action objects."""
        stats = self.stats
        stats.batches += 1
        stats.events += len(batch.events)
        if replayed:
            stats.replayed_batches += 1
        self.last_delivery[key] = recv_ts
        self.items.append(
            received_batch(key[0], key[1], seq, batch, replayed, topic, payload, recv_ts)
        )

    def apply(self, key: StreamKey, actions: list[TrackerAction[HeldBatch]]) -> StartReplay | None:
        """Carry out ``actions`` of stream ``key``'s tracker in order: deliver batches,
        report anomalies (logging the ones that need attention) and count drops.  Returns
        the replay request among them, for the caller to schedule (None: none).  A
        tracker asks for at most one replay per call, as its last action, so scheduling
        it after the others keeps the actions' order."""
        source, rank = key
        stats = self.stats
        request = None
        for act in actions:
            if isinstance(act, Deliver):
                it = act.item
                self.deliver(
                    key,
                    act.seq,
                    it.batch,
                    act.replayed or it.replayed,
                    it.topic,
                    it.payload,
                    it.recv_ts,
                )
            elif isinstance(act, Report):
                if act.first_seq is not None and act.last_seq is not None:
                    if act.kind == UNRECOVERABLE_LOSS:
                        stats.lost_batches += act.last_seq - act.first_seq + 1
                    elif act.kind == HISTORY_MISSED:
                        stats.missed_batches += act.last_seq - act.first_seq + 1
                if act.kind == DUPLICATE:
                    stats.dropped[DUPLICATE] += 1
                if act.kind not in (GAP, DUPLICATE, HISTORY_MISSED):
                    self.log.warning(
                        f"{act.kind}:{source}",
                        "%s rank %d: %s seq %s..%s (%s)",
                        source,
                        rank,
                        act.kind,
                        act.first_seq,
                        act.last_seq,
                        act.detail,
                    )
                self.emit(Anomaly(act.kind, source, rank, act.first_seq, act.last_seq, act.detail))
            elif isinstance(act, Drop):
                stats.dropped[act.reason] += 1
            elif isinstance(act, StartReplay):
                request = act
        return request
