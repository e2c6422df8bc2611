"""The subscriber's stream table: which streams exist, how a message is named and
decoded, and how a new stream's tracker is set up.

One job: :class:`StreamTable`.  May import the subscriber's items, tables and outbox,
:mod:`kvevents.codec` and :mod:`kvevents.seqtrack`.
"""

from __future__ import annotations

from kvevents.codec import BatchDecoder
from kvevents.consumers.source_protocol import REPLAY, Source, SourceMessage
from kvevents.consumers.subscriber.items import UNDECODABLE, Anomaly, worker_source
from kvevents.consumers.subscriber.outbox import Outbox
from kvevents.consumers.subscriber.streams import HeldBatch, Stream, StreamKey, replay_channel
from kvevents.errors import DecodeError
from kvevents.events import KVEventBatch
from kvevents.seqtrack import StreamTracker

__all__ = ["MAX_NAMES", "StreamTable"]

MAX_NAMES = 65_536
"""How many ``(origin, topic)`` names are cached before the cache is cleared (topics are
few; a peer inventing them is not)."""


class StreamTable:
    """Every stream seen (:attr:`streams`, keyed by worker ``(source, dp_rank)``), the
    names of the ``(origin, topic)`` pairs seen, and each source's last live topic.

    New streams get a :class:`StreamTracker` with ``catch_up``, ``history`` and
    ``max_pending`` (see :class:`StreamTracker`).  ``decoder`` decodes payloads; an
    undecodable one is counted and reported through ``outbox``."""

    __slots__ = (
        "_last_topics",
        "catch_up",
        "decoder",
        "history",
        "max_pending",
        "names",
        "outbox",
        "streams",
    )

    def __init__(
        self,
        outbox: Outbox,
        decoder: BatchDecoder,
        *,
        catch_up: bool,
        history: int,
        max_pending: int,
    ) -> None:
        self.outbox = outbox
        self.decoder = decoder
        self.catch_up = catch_up
        self.history = history
        self.max_pending = max_pending
        self.streams: dict[StreamKey, Stream] = {}
        self.names: dict[tuple[str, bytes], str] = {}
        self._last_topics: dict[str, bytes] = {}

    def live_stream(self, src: Source, origin: str, topic: bytes, rank: int, now: float) -> Stream:
        """The stream of a live batch of ``src`` from ``origin`` (the publisher it names)
        on ``topic`` with ``rank``, created (heard from at ``now``, monotonic seconds) if
        new; ``topic`` is noted as ``src``'s last live topic (:meth:`last_topic`)."""
        self._last_topics[src.name] = topic
        source = self.names.get((origin, topic))
        if source is None:
            source = self.worker_source(origin, topic)
        key = (source, rank)
        return self.streams.get(key) or self.open(key, src, topic, now)

    def last_topic(self, name: str) -> bytes:
        """The topic of the last live batch of the source named ``name`` (``b""``: none
        yet): what a reply without a topic frame on a channel serving any topic is
        tagged with."""
        return self._last_topics.get(name, b"")

    def worker_source(self, origin: str, topic: bytes) -> str:
        """:func:`~kvevents.consumers.subscriber.worker_source`, cached."""
        names = self.names
        name = names.get((origin, topic))
        if name is None:
            if len(names) > MAX_NAMES:
                names.clear()
            name = names[(origin, topic)] = worker_source(origin, topic)
        return name

    def open(self, key: StreamKey, src: Source, topic: bytes, now: float) -> Stream:
        """The stream ``key``, created (heard from at ``now``, monotonic seconds) if new."""
        st = self.streams.get(key)
        if st is None:
            channel = replay_channel(src, topic)
            tracker: StreamTracker[HeldBatch] = StreamTracker(
                replayable=channel is not None or src.replay_inband,
                catch_up=self.catch_up,
                history=self.history,
                max_pending=self.max_pending,
                vouch_jumps=channel is not None,
            )
            st = self.streams[key] = Stream(key, tracker, src, topic, channel, now, now)
        return st

    def decode(self, origin: str, msg: SourceMessage) -> KVEventBatch | None:
        """``msg``'s batch, or None when it does not decode (counted, logged and reported
        as ``undecodable``)."""
        try:
            return self.decoder.decode(msg.payload)
        except DecodeError as exc:
            self.undecodable(origin, msg, exc)
            return None

    def undecodable(self, origin: str, msg: SourceMessage, exc: DecodeError) -> None:
        """Count, log and report ``msg`` (from ``origin``) as ``undecodable``."""
        outbox = self.outbox
        outbox.stats.dropped[UNDECODABLE] += 1
        outbox.log.warning(
            "undecodable:" + origin,
            "%s: skipped an undecodable payload (seq %d): %s",
            origin,
            msg.seq,
            exc,
        )
        where = "replayed " if msg.kind == REPLAY else ""
        outbox.emit(Anomaly(UNDECODABLE, origin, None, msg.seq, msg.seq, f"{where}{exc}"))
