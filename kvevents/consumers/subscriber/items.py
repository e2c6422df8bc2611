"""What a subscriber hands out: :class:`ReceivedBatch`, :class:`Anomaly`, the anomaly kinds,
and its counters (:class:`SubscriberStats`).

One job: the values an application sees.  May import :mod:`kvevents.events` and the kind
names of :mod:`kvevents.seqtrack`; nothing else of the subscriber.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Union

from kvevents.events import KVEventBatch
from kvevents.seqtrack import (
    DISOWNED_SEQ,
    DUPLICATE,
    GAP,
    HISTORY_MISSED,
    PUBLISHER_RESTART,
    UNRECOVERABLE_LOSS,
)

__all__ = [
    "ANOMALY_KINDS",
    "BAD_FRAME_KIND",
    "DEFAULT_STALE_AFTER_S",
    "LIVE_AGAIN",
    "REPLAY_TIMEOUT",
    "STALE",
    "UNDECODABLE",
    "Anomaly",
    "ReceivedBatch",
    "SubscriberItem",
    "SubscriberStats",
    "received_batch",
    "worker_source",
]

UNDECODABLE = "undecodable"
BAD_FRAME_KIND = "bad_frame"
REPLAY_TIMEOUT = "replay_timeout"
STALE = "stale"
LIVE_AGAIN = "live"
ANOMALY_KINDS: frozenset[str] = frozenset(
    {
        GAP,
        DUPLICATE,
        PUBLISHER_RESTART,
        UNRECOVERABLE_LOSS,
        HISTORY_MISSED,
        DISOWNED_SEQ,
        UNDECODABLE,
        BAD_FRAME_KIND,
        REPLAY_TIMEOUT,
        STALE,
        LIVE_AGAIN,
    }
)
"""Every :attr:`Anomaly.kind` the subscriber reports."""

DEFAULT_STALE_AFTER_S = 30.0
"""Default ``stale_after_s``: a worker with a replay endpoint that neither publishes nor
answers a probe for 30 s is stale (probes start after 10 s of silence)."""


def worker_source(name: str, topic: bytes) -> str:
    """The ``source`` of a worker id: ``name`` for an empty topic, else
    ``"<name>#<topic>"`` (the topic decoded as UTF-8, undecodable bytes escaped).  A name
    that already ends with ``#<topic>`` (a capture recorded by a subscriber) is kept."""
    if not topic:
        return name
    tag = "#" + topic.decode("utf-8", "backslashreplace")
    return name if name.endswith(tag) else name + tag


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """A decoded batch to apply.

    ``source`` names the publisher stream (:func:`worker_source`: its endpoint, with
    ``#topic`` when the topic is not empty; or the recorded source of a capture);
    ``dp_rank`` is the batch's ``data_parallel_rank`` (None on the wire reads as 0);
    ``seq`` its live seq; ``replayed`` is true if it came through replay.  ``topic`` and
    ``payload`` are the raw frames exactly as received; ``recv_ts`` the receive time
    (seconds since the epoch).
    """

    source: str
    dp_rank: int
    seq: int
    batch: KVEventBatch
    replayed: bool
    topic: bytes
    payload: bytes
    recv_ts: float

    @property
    def worker(self) -> tuple[str, int]:
        """The worker scope ``(source, dp_rank)`` the index keys state by."""
        return (self.source, self.dp_rank)


class _ReceivedBatchBuilder:
    """:func:`received_batch`: ``ReceivedBatch``'s slots, filled by plain attribute
    stores, then the object becomes a ``ReceivedBatch`` by ``__class__`` assignment
    (allowed: the two classes have the same slots and base).  A frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__``; these stores take the
    interpreter's fast path for slots, about half the cost in all (the subscriber builds
    one per batch)."""

    __slots__ = ReceivedBatch.__slots__

    def __init__(
        self,
        source: str,
        dp_rank: int,
        seq: int,
        batch: KVEventBatch,
        replayed: bool,
        topic: bytes,
        payload: bytes,
        recv_ts: float,
    ) -> None:
        self.source = source
        self.dp_rank = dp_rank
        self.seq = seq
        self.batch = batch
        self.replayed = replayed
        self.topic = topic
        self.payload = payload
        self.recv_ts = recv_ts
        self.__class__ = ReceivedBatch  # type: ignore[assignment]


received_batch: Callable[[str, int, int, KVEventBatch, bool, bytes, bytes, float], ReceivedBatch]
received_batch = _ReceivedBatchBuilder  # type: ignore[assignment]
"""``ReceivedBatch(source, dp_rank, seq, batch, replayed, topic, payload, recv_ts)``: the
same value, built faster."""


@dataclass(frozen=True, slots=True)
class Anomaly:
    """Something the application should know about, in stream order.

    ``kind`` is one of :data:`ANOMALY_KINDS`:

    * ``gap`` - seqs missing on the live path, being replayed (nothing to do);
    * ``duplicate`` - a batch already applied, dropped;
    * ``unrecoverable_loss`` - seqs the replay ring no longer has (or that could not be
      replayed): reset the worker (:attr:`needs_reset`);
    * ``publisher_restart`` - a new publisher process (``first_seq`` is the seq that
      revealed it, None when a replay did; ``last_seq`` the old stream's last applied
      seq): reset the worker, the new stream follows from its start;
    * ``history_missed`` - a new stream's seqs before what its ring still holds (the
      worker starts incomplete; nothing to reset);
    * ``stale`` / ``live`` - the worker stopped / resumed publishing and answering its
      replay endpoint: exclude it from routing / include it again;
    * ``disowned_seq`` - a live batch the publisher's replay service disowns (a seq
      beyond what it held when asked after the batch came, another payload under that
      seq, or a contradiction of an applied seq of a stream the replay showed
      unchanged): a frame the publisher never sent (forged on an unauthenticated
      socket, or corrupted).  Dropped, never applied; nothing to reset;
    * ``replay_timeout``, ``undecodable``, ``bad_frame`` - counted and skipped.

    ``first_seq``..``last_seq`` is the inclusive seq range concerned; ``dp_rank`` is None
    when the rank is unknown (an undecodable payload, a bad frame, a replay endpoint
    timing out).
    """

    kind: str
    source: str
    dp_rank: int | None
    first_seq: int | None = None
    last_seq: int | None = None
    detail: str = ""

    @property
    def needs_reset(self) -> bool:
        """True if the worker's state can no longer be trusted and must be reset."""
        return self.kind in (PUBLISHER_RESTART, UNRECOVERABLE_LOSS)

    @property
    def worker(self) -> tuple[str, int] | None:
        """The worker ``(source, dp_rank)`` concerned, None when the rank is unknown."""
        return None if self.dp_rank is None else (self.source, self.dp_rank)

    @property
    def seq_count(self) -> int:
        """How many seqs the range covers (0 without a range)."""
        if self.first_seq is None or self.last_seq is None or self.kind == PUBLISHER_RESTART:
            return 0
        return self.last_seq - self.first_seq + 1


SubscriberItem = Union[ReceivedBatch, Anomaly]


@dataclass
class SubscriberStats:
    """Counters of a :class:`~kvevents.consumers.subscriber.Subscriber`.

    ``batches`` / ``events``: delivered batches and the events in them;
    ``replayed_batches``: delivered batches that came through replay;
    ``lost_batches``: seqs reported as unrecoverable loss;
    ``missed_batches``: seqs reported as ``history_missed``;
    ``anomalies``: reported anomalies by kind;
    ``dropped``: messages discarded, by reason (``duplicate``, ``late``, ``mismatch``,
    ``replay_overlap``, ``replay_ahead``, ``stale_replay``, ``replay_mismatch``,
    ``replay_other_stream``, ``undecodable``, ``bad_frame``, ...);
    ``replays``: replay requests by outcome (``requested``, ``completed``, ``timed_out``,
    ``unavailable``, ``cooldown``, ``queue_timeout``, ``superseded``, ``resent``,
    ``connection_lost``, ``abandoned``, ``probe``, ``catch_up``);
    ``connections``: socket monitor events (``connected``, ``disconnected`` for the live
    sockets; ``replay_disconnected`` for replay DEALERs; a frame above
    ``max_message_size_bytes`` shows as a disconnect);
    ``stale_workers``: workers currently stale (a gauge, not a counter).
    """

    GAUGES: ClassVar[frozenset[str]] = frozenset({"stale_workers"})

    batches: int = 0
    events: int = 0
    replayed_batches: int = 0
    lost_batches: int = 0
    missed_batches: int = 0
    stale_workers: int = 0
    anomalies: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    replays: Counter[str] = field(default_factory=Counter)
    connections: Counter[str] = field(default_factory=Counter)
