"""The subscriber's tables: one :class:`Stream` per publisher stream, one
:class:`ReplayJob` per replay request, and how a :class:`Source` is asked for a replay.

One job: the shared state the other rooms of the subscriber read and update (no logic
beyond the source adapters).  May import :mod:`kvevents.seqtrack`, the source
protocol, :mod:`kvevents.events` and ``xxhash``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xxhash import xxh3_64_intdigest

from kvevents.consumers.source_protocol import Source
from kvevents.events import KVEventBatch
from kvevents.seqtrack import StreamTracker

__all__ = [
    "ChannelKey",
    "HeldBatch",
    "ReplayJob",
    "Stream",
    "StreamKey",
    "cancel_replay",
    "fingerprint",
    "replay_channel",
    "replay_channels",
    "request_replay",
]

fingerprint = xxh3_64_intdigest
"""A payload's fingerprint, what the sequence trackers compare to tell a duplicate from
different content under one seq: xxh3-64 of the bytes (Python's ``hash`` of a 15 KB
payload costs ~6 us, ten times as much)."""

StreamKey = tuple[str, int]
"""A worker: ``(source, dp_rank)`` (see :func:`~kvevents.consumers.subscriber.worker_source`)."""

ChannelKey = tuple[str, str]
"""A replay channel: ``(source name, replay endpoint)``; one request in flight at a time."""


@dataclass(slots=True)
class HeldBatch:
    """A decoded batch as a :class:`StreamTracker` holds it until delivery: the raw
    ``topic`` and ``payload``, the ``recv_ts`` (wall-clock seconds) and whether it came
    through replay."""

    topic: bytes
    payload: bytes
    batch: KVEventBatch
    recv_ts: float
    replayed: bool


@dataclass
class Stream:
    """One publisher stream.  ``channel`` is its replay endpoint (None: none);
    ``heard`` (monotonic seconds) its last batch or replay answer, ``live_at`` its last
    live batch, ``probe_at`` its last liveness probe; ``stale`` whether it is reported
    stale."""

    key: StreamKey
    tracker: StreamTracker[HeldBatch]
    src: Source
    topic: bytes
    channel: str | None
    heard: float
    live_at: float
    stale: bool = False
    probe_at: float = float("-inf")


@dataclass
class ReplayJob:
    """A replay request for ``stream`` from seq ``start`` on ``channel``, queued until
    ``sent``.  ``deadline`` (monotonic seconds) is when it times out, renewed by every
    reply; ``replies`` counts them; ``waited`` counts live records a capture's in-band
    replay let pass; ``resends`` the times its connection dropped; ``probe`` marks a
    liveness probe.  ``catch_up`` is set for the catch-up of a channel (its whole
    ring): the streams it feeds, with their replay ids; ``declined`` the streams that
    were already following something else when its first reply for them came (they
    ignore it)."""

    stream: StreamKey
    channel: ChannelKey
    topic: bytes
    start: int
    replay_id: int
    deadline: float
    sent: bool = False
    replies: int = 0
    waited: int = 0
    resends: int = 0
    probe: bool = False
    catch_up: dict[StreamKey, int] | None = None
    declined: set[StreamKey] = field(default_factory=set)

    def streams(self) -> list[tuple[StreamKey, int]]:
        """``(stream, replay_id)`` pairs this job answers."""
        if self.catch_up is not None:
            return list(self.catch_up.items())
        return [(self.stream, self.replay_id)]


# --- sources with and without a replay endpoint per topic --------------------------------
def replay_channel(src: Source, topic: bytes) -> str | None:
    """The replay channel serving ``topic`` on ``src``: its ``replay_channel(topic)`` when
    it has one, ``""`` for a source with one replay endpoint, None when it cannot replay
    (or answers in band)."""
    if src.replay_inband:
        return None
    fn = getattr(src, "replay_channel", None)
    if fn is not None:
        ch = fn(topic)
        return ch if isinstance(ch, str) else None
    return "" if src.can_replay else None


def replay_channels(src: Source) -> dict[str, bytes]:
    """Every replay channel of ``src`` with the topic it serves (``b""``: any)."""
    fn = getattr(src, "replay_channels", None)
    if fn is not None:
        channels: dict[str, bytes] = dict(fn())
        return channels
    return {"": b""} if src.can_replay else {}


def request_replay(src: Source, start: int, topic: bytes) -> None:
    """Ask ``src`` for every batch from seq ``start`` on ``topic``'s channel."""
    if hasattr(src, "replay_channel"):
        src.request_replay(start, topic)  # type: ignore[call-arg]
    else:
        src.request_replay(start)


def cancel_replay(src: Source, topic: bytes) -> None:
    """Drop the request in flight on ``topic``'s channel of ``src``."""
    if hasattr(src, "replay_channel"):
        src.cancel_replay(topic)  # type: ignore[call-arg]
    else:
        src.cancel_replay()
