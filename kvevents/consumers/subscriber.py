"""The subscriber SDK: follow many publishers without losing track of any.

:class:`Subscriber` reads one or more sources (ZMQ endpoints of vLLM-compatible
publishers, capture files, or any :class:`~kvevents.consumers.sources.Source`), decodes
each batch, tracks seq per stream (:mod:`kvevents.consumers.seqtrack`) and yields, in
order:

* :class:`ReceivedBatch` - a decoded batch to apply, with its raw topic and payload bytes
  (so a recorder can store it losslessly) and whether it came through replay;
* :class:`Anomaly` - a counted value describing something the application should know
  (see :data:`ANOMALY_KINDS`; :attr:`Anomaly.needs_reset` says when to reset a worker).

**Streams and workers.**  A stream is one ``(endpoint, topic, dp_rank)``: several engines
may share an endpoint (an XSUB/XPUB proxy) as long as their topics differ.  The worker id
is ``(source, dp_rank)``, where ``source`` is the endpoint (or source name) when the
topic is empty, else ``"<endpoint>#<topic>"`` (:func:`worker_source`), e.g.
``("tcp://proxy:5557#kv@engine-a", 0)``.

**Catch-up.**  A new stream is replayed from seq 0: the publisher's ring answers from its
oldest seq; what it no longer holds is a ``history_missed`` anomaly with the seq range
(the index starts incomplete; nothing to reset).  With a replay endpoint the whole ring
is also asked for when the subscriber starts, so idle engines are caught up too.

**Gaps, duplicates, order.**  A gap is repaired by a DEALER replay merged with live
traffic, so nothing is applied twice or out of order.  A seq is either delivered or
reported lost (``unrecoverable_loss``), never both; only a replay that proves the ring no
longer holds a seq the live path has passed makes it lost, so a live backlog deeper than
the ring invents nothing.  A batch arriving after its seq was reported lost is dropped
and counted as ``late``; duplicates and reordered batches never reset anything.

**Restarts** are detected by the identity of the last applied seq, not by seq order:
every replay starts at the last applied seq and compares its payload fingerprint, and
after the live socket reconnects (a ZMQ socket monitor reports it), or when a batch
contradicts what was applied, the stream is checked that way before anything new is
applied.  A restart (``publisher_restart``) resets that worker and resyncs it from the
new stream's start.

**Liveness.**  Idle engines publish nothing, so silence alone proves nothing.  After a
third of ``stale_after_s`` without a batch, a worker's replay endpoint is probed (a
request from its last seq: the end marker answers); a worker with neither a batch nor an
answer for ``stale_after_s`` is reported ``stale`` (exclude it from routing:
:meth:`~kvevents.consumers.index.BlockIndex.set_stale`) and ``live`` again when its stream
or its replay endpoint is heard from.  A worker without a replay endpoint is never made
stale by silence.

**Bounds.**  Replays have a timeout (a worker's stream waits at most that long without
progress), a bound on how many run at once, and a cooldown after a replay endpoint timed
out.  Every socket has ``ZMQ_MAXMSGSIZE`` (``max_message_size``): an oversize frame makes
ZMQ drop that connection, which is counted in :attr:`SubscriberStats.connections`; the
stream reconnects and its gap is replayed or reported.  Everything dropped or skipped is
counted in :attr:`Subscriber.stats` with a reason label.  Anomalies are values, never
exceptions: the stream always goes on.

Threading: a subscriber is used from one thread (ZMQ sockets are not thread-safe).  For
asyncio use :class:`~kvevents.consumers.aio.AsyncSubscriber`, which drives the same
:class:`SubscriberCore`.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Union

import zmq

from kvevents.codec import BatchDecoder
from kvevents.consumers.seqtrack import (
    GAP,
    HISTORY_MISSED,
    PUBLISHER_RESTART,
    UNRECOVERABLE_LOSS,
    Deliver,
    Drop,
    Report,
    StartReplay,
    StreamTracker,
    TrackerAction,
)
from kvevents.consumers.sources import (
    BAD_FRAME,
    CONNECTED,
    DEFAULT_MAX_MESSAGE_SIZE,
    DISCONNECTED,
    LIVE,
    REPLAY,
    REPLAY_DISCONNECTED,
    REPLAY_END,
    CaptureSource,
    Source,
    SourceMessage,
    ZmqSource,
)
from kvevents.errors import ConfigError, DecodeError
from kvevents.events import KVEventBatch
from kvevents.ratelimit import RateLimitedLog
from kvevents.security import CurveClientConfig

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
    "Subscriber",
    "SubscriberCore",
    "SubscriberItem",
    "SubscriberStats",
    "worker_source",
]

logger = logging.getLogger(__name__)

UNDECODABLE = "undecodable"
BAD_FRAME_KIND = "bad_frame"
REPLAY_TIMEOUT = "replay_timeout"
STALE = "stale"
LIVE_AGAIN = "live"
ANOMALY_KINDS: frozenset[str] = frozenset(
    {
        GAP,
        "duplicate",
        PUBLISHER_RESTART,
        UNRECOVERABLE_LOSS,
        HISTORY_MISSED,
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

_RESENDS = 2
"""How many times a replay request is resent after its connection dropped."""


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
    """Counters of a :class:`Subscriber`.

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
    ``max_message_size`` shows as a disconnect);
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


@dataclass(slots=True)
class _Item:
    topic: bytes
    payload: bytes
    batch: KVEventBatch
    recv_ts: float
    replayed: bool


StreamKey = tuple[str, int]
ChannelKey = tuple[str, str]  # (source name, replay channel)


@dataclass
class _Stream:
    key: StreamKey
    tracker: StreamTracker[_Item]
    src: Source
    topic: bytes
    channel: str | None  # None: no replay endpoint
    heard: float  # monotonic: last batch or replay answer
    live_at: float  # monotonic: last live batch
    stale: bool = False
    probe_at: float = float("-inf")  # monotonic: last liveness probe


@dataclass
class _ReplayJob:
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
    """For the start-up catch-up of a channel: the streams it fed, with their replay ids."""

    def streams(self) -> list[tuple[StreamKey, int]]:
        """``(stream, replay_id)`` pairs this job answers."""
        if self.catch_up is not None:
            return list(self.catch_up.items())
        return [(self.stream, self.replay_id)]


EndpointSpec = Union[str, Source]
ReplaySpec = Union[Sequence[Union[str, None]], Mapping[str, str], None]


class SubscriberCore:
    """The subscriber's engine without a way to wait: decoding, seq tracking, replay
    scheduling, liveness.  :class:`Subscriber` (blocking) and
    :class:`~kvevents.consumers.aio.AsyncSubscriber` (asyncio) drive it the same way:

    * :meth:`take` - the next item ready, or None;
    * :meth:`wait_sockets` and :meth:`wait_seconds` - what to wait on, and for how long;
    * :meth:`step` - read what the ready sources have (None: every source), process it
      and enforce replay deadlines and liveness;
    * :meth:`finished` - every source exhausted and nothing left.

    Arguments: see :class:`Subscriber`.
    """

    def __init__(
        self,
        endpoints: EndpointSpec | Sequence[EndpointSpec],
        topic: bytes | str = b"",
        replay_endpoints: ReplaySpec = None,
        *,
        catch_up: bool = True,
        replay_from_start: bool | None = None,
        replay_timeout: float = 5.0,
        max_concurrent_replays: int = 4,
        replay_cooldown: float = 10.0,
        stale_after_s: float | None = DEFAULT_STALE_AFTER_S,
        decoder: BatchDecoder | None = None,
        context: zmq.Context[Any] | None = None,
        history: int = 4096,
        max_pending: int = 100_000,
        rcvhwm: int = 100_000,
        max_message_size: int | None = DEFAULT_MAX_MESSAGE_SIZE,
        curve: CurveClientConfig | None = None,
        max_replay_batches: int = 1_000_000,
        receive_batch: int = 256,
        inband_window: int = 1024,
    ) -> None:
        if replay_timeout <= 0 or max_concurrent_replays < 1 or replay_cooldown < 0:
            raise ConfigError(
                "replay_timeout must be > 0, max_concurrent_replays >= 1, replay_cooldown >= 0"
            )
        if stale_after_s is not None and stale_after_s <= 0:
            raise ConfigError(f"stale_after_s must be > 0 or None, got {stale_after_s}")
        if replay_from_start is not None:
            warnings.warn(
                "replay_from_start is deprecated: catch-up is the default (catch_up=True)",
                DeprecationWarning,
                stacklevel=3,
            )
            catch_up = bool(replay_from_start) or catch_up
        if isinstance(topic, str):
            topic = topic.encode()
        specs: list[EndpointSpec] = (
            [endpoints] if isinstance(endpoints, (str, Source)) else list(endpoints)
        )
        if not specs:
            raise ConfigError("Subscriber needs at least one endpoint or source")
        replay_for, by_topic = _replay_map(specs, replay_endpoints)
        self.stats = SubscriberStats()
        self.decoder = decoder if decoder is not None else BatchDecoder()
        self.replay_timeout = replay_timeout
        self.max_concurrent_replays = max_concurrent_replays
        self.replay_cooldown = replay_cooldown
        self.stale_after_s = stale_after_s
        self.catch_up = catch_up
        self.max_replay_batches = max_replay_batches
        self._history = history
        self._max_pending = max_pending
        self._batch = receive_batch
        self._inband_window = inband_window
        self._sources: list[Source] = []
        try:
            for spec in specs:
                if isinstance(spec, str):
                    self._sources.append(
                        _source_for(
                            spec,
                            topic,
                            replay_for.get(spec),
                            by_topic.get(spec),
                            context,
                            rcvhwm,
                            max_message_size,
                            curve,
                        )
                    )
                else:
                    self._sources.append(spec)
        except BaseException:
            for src in self._sources:
                src.close()
            raise
        names = [s.name for s in self._sources]
        if len(set(names)) != len(names):
            for src in self._sources:
                src.close()
            raise ConfigError(f"source names must be unique: {names}")
        self._out: deque[SubscriberItem] = deque()
        self._streams: dict[StreamKey, _Stream] = {}
        self._last_delivery: dict[StreamKey, float] = {}  # wall-clock receive time
        self._queues: dict[ChannelKey, deque[_ReplayJob]] = {}
        self._inband: dict[StreamKey, _ReplayJob] = {}
        self._active = 0
        self._cooldown_until: dict[ChannelKey, float] = {}
        self._dropped: set[str] = set()  # sources whose live socket disconnected
        self._last_topic: dict[str, bytes] = {}
        self._cut_channels: set[ChannelKey] = set()
        self._names: dict[tuple[str, bytes], str] = {}
        self._owner: dict[Any, Source] = {}
        self._log = RateLimitedLog(logger)
        self._closed = False
        if catch_up:
            self._catch_up_sources()

    # --- the driving interface ----------------------------------------------------------
    @property
    def sources(self) -> tuple[Source, ...]:
        """The sources, in the order given."""
        return tuple(self._sources)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stale_workers(self) -> list[tuple[str, int]]:
        """The workers currently stale (see the module docstring), sorted."""
        return sorted(k for k, s in self._streams.items() if s.stale)

    def gauges(self, now: float | None = None) -> dict[str, float]:
        """Current state, for metrics (``now``: wall-clock seconds, default the time now).

        ``workers``: ``(source, dp_rank)`` streams seen (the stale ones are in
        ``stats.stale_workers``); ``replays_in_flight``: replay requests sent and not finished;
        ``replay_lag_batches``: live batches held back behind gaps being replayed;
        ``replay_lag_seconds``: how long the stream held back longest has delivered
        nothing (seconds since its last delivered batch; 0 when no stream is replaying).
        Reads copies of the subscriber's tables, so a scrape thread may call it."""
        now = time.time() if now is None else now
        last = dict(self._last_delivery)
        streams = list(self._streams.items())
        held = 0
        lag = 0.0
        for key, st in streams:
            if st.tracker.replaying:
                held += st.tracker.pending
                since = last.get(key)
                if since is not None:
                    lag = max(lag, now - since)
        return {
            "workers": len(streams),
            "replays_in_flight": self._active,
            "replay_lag_batches": held,
            "replay_lag_seconds": max(lag, 0.0),
        }

    def take(self) -> SubscriberItem | None:
        """The next batch or anomaly already processed, or None."""
        return self._out.popleft() if self._out else None

    def finished(self) -> bool:
        """Every source is exhausted (capture files read to the end) and nothing is left."""
        return all(s.exhausted for s in self._sources) and not self._inband and not self._out

    def wait_sockets(self) -> list[Any]:
        """The sockets to wait on for input (readable: call :meth:`step`)."""
        socks: list[Any] = []
        owner: dict[Any, Source] = {}
        for src in self._sources:
            for sock in src.sockets():
                socks.append(sock)
                owner[sock] = src
        self._owner = owner
        return socks

    def wait_seconds(self, now: float, deadline: float | None) -> float | None:
        """How long a wait may last (None: until input): until ``deadline``, the next
        replay deadline or liveness check; 0 when an always-ready source (a file) has
        more to read."""
        waits: list[float] = []
        if deadline is not None:
            waits.append(deadline - now)
        for src in self._sources:
            if not src.exhausted and not src.sockets():
                return 0.0
        for queue in self._queues.values():
            for job in queue:
                waits.append(job.deadline - now)
        for src in self._sources:
            redial_at = getattr(src, "redial_at", None)
            if redial_at is not None:
                waits.append(redial_at - now)
        stale = self.stale_after_s
        if stale is not None:
            for st in self._streams.values():
                if st.channel is not None:
                    waits.append(max(st.heard, st.probe_at) + stale / 3 - now)
                    if not st.stale:
                        waits.append(st.heard + stale - now)
        return max(0.0, min(waits)) if waits else None

    def ready_sources(self, sockets: Iterable[Any]) -> list[Source]:
        """The sources owning ``sockets`` (readable ones from a poll), plus every
        always-ready source (a file)."""
        ready: list[Source] = []
        seen: set[int] = set()
        for sock in sockets:
            src = self._owner.get(sock)
            if src is not None and id(src) not in seen:
                seen.add(id(src))
                ready.append(src)
        for src in self._sources:
            if not src.exhausted and not src.sockets() and id(src) not in seen:
                ready.append(src)
        return ready

    def step(self, ready: Iterable[Source] | None, now: float) -> None:
        """Read what the ``ready`` sources have (None: every source), process it, then
        enforce replay deadlines and liveness.  ``now`` is ``time.monotonic()``."""
        for src in self._sources if ready is None else ready:
            self._cut_channels.clear()
            for msg in src.receive(self._batch):
                self._process(src, msg, now)
            if src.exhausted and src.replay_inband:
                self._end_inband(src, everything=True)
        self._check_deadlines(now)
        self._check_liveness(now)
        for src in self._sources:
            maintain = getattr(src, "maintain", None)
            if maintain is not None:
                maintain(now)

    def close(self) -> None:
        """Close every source's sockets (the ZMQ context is left alone).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        for src in self._sources:
            try:
                src.close()
            except Exception:  # pragma: no cover - closing must not raise
                logger.exception("error closing %s", src.name)

    # --- message handling -------------------------------------------------------------
    def _process(self, src: Source, msg: SourceMessage, now: float) -> None:
        kind = msg.kind
        origin = msg.origin or src.name
        if kind == LIVE:
            decoded = self._decode(origin, msg)
            if decoded is None:
                return
            self._last_topic[src.name] = msg.topic
            key = (self._worker_source(origin, msg.topic), decoded.data_parallel_rank or 0)
            st = self._stream(key, src, msg.topic, now)
            tracker = st.tracker
            item = _Item(msg.topic, msg.payload, decoded, msg.recv_ts, msg.replayed)
            fp = hash(msg.payload)
            if src.replay_inband:
                # A recording answers its own gaps: the replayed records that follow a
                # gap are the replay.  It ends at a recorded end marker, at the first
                # live record after a reply, or when no reply came within
                # ``inband_window`` live records (the gap was never repaired).
                job = self._inband.get(key)
                if job is not None:
                    if msg.replayed:
                        job.replies += 1
                        self._apply(key, tracker.replayed(job.replay_id, msg.seq, item, fp))
                        return
                    job.waited += 1
                    if job.replies or job.waited > self._inband_window:
                        self._end_inband_job(key, job)
                elif msg.replayed and tracker.last is not None and msg.seq <= tracker.last:
                    self.stats.dropped["stale_replay"] += 1
                    return
            elif (
                self.stale_after_s is not None
                and st.channel is not None
                and tracker.last is not None
                and now - st.live_at >= self.stale_after_s / 3
            ):
                # Resuming after a silence: a restart behind a proxy looks like this.
                self._apply(key, tracker.verify())
            self._heard(st, now, live=True)
            self._apply(key, tracker.live(msg.seq, item, fp))
        elif kind == REPLAY:
            ck = (src.name, msg.channel)
            queue = self._queues.get(ck)
            if ck in self._cut_channels:
                queue = None  # read from a DEALER closed since: not for the job now
            job = queue[0] if queue and queue[0].sent else None
            if job is None:
                self.stats.dropped["stale_replay"] += 1
                return
            if src.name in self._dropped:
                # The live connection dropped and has not come back: the replay endpoint
                # may already be a new process, whose batches must not extend the old
                # streams before the identity check the reconnect runs.
                self.stats.dropped["unverified_replay"] += 1
                return
            job.replies += 1
            # The timeout bounds a replay without progress: every reply renews it.
            job.deadline = now + self.replay_timeout
            decoded = self._decode(origin, msg)
            if decoded is None:
                return
            # A reply without a topic frame (vLLM before 0.26) on a channel serving any
            # topic: the stream it answers, else the source's last live topic.
            topic = msg.topic or (
                job.topic if job.catch_up is None else self._last_topic.get(src.name, b"")
            )
            key = (self._worker_source(origin, topic), decoded.data_parallel_rank or 0)
            item = _Item(topic, msg.payload, decoded, msg.recv_ts, True)
            if job.catch_up is not None:
                replay_id = job.catch_up.get(key)
                if replay_id is None:
                    st = self._stream(key, src, topic, now)
                    start = st.tracker.catch_up()
                    if start is None:  # already following: live traffic got there first
                        self.stats.dropped["catch_up_overlap"] += 1
                        return
                    replay_id = job.catch_up[key] = start.replay_id
            elif key != job.stream:
                self.stats.dropped["replay_other_stream"] += 1
                return
            else:
                replay_id = job.replay_id
            st = self._streams[key]
            self._heard(st, now)
            self._apply(key, st.tracker.replayed(replay_id, msg.seq, item, hash(msg.payload)))
            if job.replies > self.max_replay_batches:
                self._abandon(ck, f"replay sent over {self.max_replay_batches} batches")
            elif job.catch_up is None and (
                not st.tracker.replaying or st.tracker.replay_id != job.replay_id
            ):
                # The stream gave this replay up (too much buffered, a restart): stop
                # reading a reply stream nobody waits for.
                self._abandon(ck, "")
        elif kind == REPLAY_END:
            if src.replay_inband:
                self._end_inband(src, everything=False, origin=origin)
                return
            ck = (src.name, msg.channel)
            queue = self._queues.get(ck)
            if not queue or not queue[0].sent or ck in self._cut_channels:
                self.stats.dropped["stale_replay_end"] += 1
                return
            job = queue.popleft()
            self._active -= 1
            self.stats.replays["completed"] += 1
            for key, replay_id in job.streams():
                st = self._streams[key]
                self._heard(st, now)
                self._apply(key, st.tracker.replay_end(replay_id))
            self._pump(now)
        elif kind == BAD_FRAME:
            self.stats.dropped["bad_frame"] += 1
            self._log.warning(
                "bad_frame:" + origin, "%s: skipped a malformed message: %s", origin, msg.detail
            )
            self._emit(Anomaly(BAD_FRAME_KIND, origin, None, None, None, msg.detail))
        elif kind == DISCONNECTED:
            self.stats.connections["disconnected"] += 1
            self._dropped.add(src.name)
            self._log.warning(
                "disconnected:" + src.name,
                "%s: live connection dropped (peer gone, or a frame over max_message_size)",
                src.name,
            )
        elif kind == CONNECTED:
            self.stats.connections["connected"] += 1
            if src.name in self._dropped:
                self._dropped.discard(src.name)
                self._reconnected(src, now)
            if self.catch_up:
                # What was published before this connection never arrives live.
                self._catch_up_source(src, now)
        elif kind == REPLAY_DISCONNECTED:
            self.stats.connections["replay_disconnected"] += 1
            self._replay_dropped(src, msg.channel, now)

    def _worker_source(self, origin: str, topic: bytes) -> str:
        names = self._names
        name = names.get((origin, topic))
        if name is None:
            if len(names) > 65_536:  # topics are few; a peer inventing them is not
                names.clear()
            name = names[(origin, topic)] = worker_source(origin, topic)
        return name

    def _heard(self, st: _Stream, now: float, *, live: bool = False) -> None:
        st.heard = now
        if live:
            st.live_at = now
        if st.stale:
            st.stale = False
            self.stats.stale_workers -= 1
            self._emit(Anomaly(LIVE_AGAIN, st.key[0], st.key[1], detail="heard from again"))

    def _decode(self, origin: str, msg: SourceMessage) -> KVEventBatch | None:
        try:
            return self.decoder.decode(msg.payload)
        except DecodeError as exc:
            self.stats.dropped["undecodable"] += 1
            self._log.warning(
                "undecodable:" + origin,
                "%s: skipped an undecodable payload (seq %d): %s",
                origin,
                msg.seq,
                exc,
            )
            where = "replayed " if msg.kind == REPLAY else ""
            self._emit(Anomaly(UNDECODABLE, origin, None, msg.seq, msg.seq, f"{where}{exc}"))
            return None

    def _stream(self, key: StreamKey, src: Source, topic: bytes, now: float) -> _Stream:
        st = self._streams.get(key)
        if st is None:
            channel = _channel(src, topic)
            tracker: StreamTracker[_Item] = StreamTracker(
                replayable=channel is not None or src.replay_inband,
                catch_up=self.catch_up,
                history=self._history,
                max_pending=self._max_pending,
            )
            st = self._streams[key] = _Stream(key, tracker, src, topic, channel, now, now)
        return st

    def _emit(self, anomaly: Anomaly) -> None:
        self.stats.anomalies[anomaly.kind] += 1
        self._out.append(anomaly)

    def _apply(self, key: StreamKey, actions: list[TrackerAction[_Item]]) -> None:
        source, rank = key
        stats = self.stats
        for act in actions:
            if isinstance(act, Deliver):
                it = act.item
                replayed = act.replayed or it.replayed
                stats.batches += 1
                stats.events += len(it.batch.events)
                if replayed:
                    stats.replayed_batches += 1
                self._last_delivery[key] = it.recv_ts
                self._out.append(
                    ReceivedBatch(
                        source,
                        rank,
                        act.seq,
                        it.batch,
                        replayed,
                        it.topic,
                        it.payload,
                        it.recv_ts,
                    )
                )
            elif isinstance(act, Report):
                if act.first_seq is not None and act.last_seq is not None:
                    if act.kind == UNRECOVERABLE_LOSS:
                        stats.lost_batches += act.last_seq - act.first_seq + 1
                    elif act.kind == HISTORY_MISSED:
                        stats.missed_batches += act.last_seq - act.first_seq + 1
                if act.kind == "duplicate":
                    stats.dropped["duplicate"] += 1
                if act.kind not in (GAP, "duplicate", HISTORY_MISSED):
                    self._log.warning(
                        f"{act.kind}:{source}",
                        "%s rank %d: %s seq %s..%s (%s)",
                        source,
                        rank,
                        act.kind,
                        act.first_seq,
                        act.last_seq,
                        act.detail,
                    )
                self._emit(Anomaly(act.kind, source, rank, act.first_seq, act.last_seq, act.detail))
            elif isinstance(act, Drop):
                stats.dropped[act.reason] += 1
            elif isinstance(act, StartReplay):
                self._schedule(key, act)

    # --- connection events ------------------------------------------------------------
    def _reconnected(self, src: Source, now: float) -> None:
        """The live socket of ``src`` came back after a disconnect: requests in flight
        went to a connection that is gone (resend them), and every stream's identity is
        checked before anything the new connection delivers is applied."""
        for ck, queue in self._queues.items():
            if ck[0] == src.name and queue and queue[0].sent:
                job = queue[0]
                self._cut(src, ck, job.topic)
                job.sent = False
                self._active -= 1
                self.stats.replays["resent"] += 1
            self._cooldown_until.pop(ck, None)
        for key, st in list(self._streams.items()):
            if st.src is src:
                self._apply(key, st.tracker.verify())
        self._pump(now)

    def _cut(self, src: Source, ck: ChannelKey, topic: bytes) -> None:
        """Close ``ck``'s DEALER; replies of it already read in this batch are stale."""
        _cancel(src, topic)
        self._cut_channels.add(ck)

    def _abandon(self, ck: ChannelKey, detail: str) -> None:
        """Drop the replay in flight on ``ck`` (its DEALER is closed: no reply to it can
        arrive any more); with ``detail``, its streams are told it failed."""
        queue = self._queues[ck]
        job = queue.popleft()
        self._cut(self._source(ck[0]), ck, job.topic)
        self._active -= 1
        self.stats.replays["abandoned"] += 1
        if detail:
            self._log.warning(f"abandoned:{ck}", "%s: %s", ck[1], detail)
            self._fail_job(job, detail)
        self._pump(time.monotonic())

    def _replay_dropped(self, src: Source, channel: str, now: float) -> None:
        """A replay DEALER lost its connection: the request in flight (if any) is lost."""
        queue = self._queues.get((src.name, channel))
        if not queue or not queue[0].sent:
            return
        job = queue[0]
        self._cut(src, (src.name, channel), job.topic)
        job.sent = False
        self._active -= 1
        if src.name in self._dropped and job.catch_up is not None:
            # Publisher gone (live connection dropped too): the reconnect asks for the
            # ring again, after checking every stream's identity.
            queue.popleft()
            self.stats.replays["superseded"] += 1
            return
        job.resends += 1
        if job.resends > _RESENDS:
            queue.popleft()
            self.stats.replays["connection_lost"] += 1
            self._fail_job(
                job,
                f"replay connection to {channel} dropped {job.resends} times "
                "(publisher gone, or a reply over max_message_size)",
                conclusive=False,
            )
        else:
            self.stats.replays["resent"] += 1
        self._pump(now)

    # --- liveness ---------------------------------------------------------------------
    def _check_liveness(self, now: float) -> None:
        stale_after = self.stale_after_s
        if stale_after is None:
            return
        for key, st in self._streams.items():
            if st.channel is None:
                continue  # silence alone proves nothing
            idle = now - st.heard
            if now - max(st.heard, st.probe_at) >= stale_after / 3:
                st.probe_at = now
                req = st.tracker.probe()
                if req is not None:
                    self.stats.replays["probe"] += 1
                    self._schedule(key, req, probe=True)
            if idle >= stale_after and not st.stale:
                st.stale = True
                self.stats.stale_workers += 1
                detail = f"no batch and no replay answer for {idle:.1f} s"
                self._log.warning(f"stale:{key[0]}", "%s rank %d: stale (%s)", *key, detail)
                self._emit(Anomaly(STALE, key[0], key[1], detail=detail))

    # --- replay scheduling ------------------------------------------------------------
    def _schedule(self, key: StreamKey, req: StartReplay, *, probe: bool = False) -> None:
        st = self._streams[key]
        src = st.src
        tracker = st.tracker
        now = time.monotonic()
        if src.replay_inband:
            self.stats.replays["inband"] += 1
            self._inband[key] = _ReplayJob(
                key, (src.name, ""), st.topic, req.start, req.replay_id, float("inf"), True
            )
            return
        if st.channel is None:
            self.stats.replays["unavailable"] += 1
            self._apply(key, tracker.replay_failed(req.replay_id, "no replay endpoint"))
            return
        ck = (src.name, st.channel)
        if now < self._cooldown_until.get(ck, 0.0):
            self.stats.replays["cooldown"] += 1
            self._apply(
                key,
                tracker.replay_failed(
                    req.replay_id, "replay endpoint timed out recently (cooldown)"
                ),
            )
            return
        job = _ReplayJob(
            key, ck, st.topic, req.start, req.replay_id, now + self.replay_timeout, probe=probe
        )
        self._queues.setdefault(ck, deque()).append(job)
        self._pump(now)

    def _pump(self, now: float) -> None:
        """Send queued requests while fewer than ``max_concurrent_replays`` are in flight
        (one per channel at a time: replies on a DEALER carry no request id)."""
        for ck, queue in self._queues.items():
            while queue and not queue[0].sent:
                job = queue[0]
                st = self._streams.get(job.stream)
                if job.catch_up is None and (
                    st is None or not st.tracker.replaying or st.tracker.replay_id != job.replay_id
                ):
                    queue.popleft()
                    self.stats.replays["superseded"] += 1
                    continue
                if self._active >= self.max_concurrent_replays:
                    break
                src = self._source(ck[0])
                _request(src, job.start, job.topic)
                job.sent = True
                job.deadline = now + self.replay_timeout
                self._active += 1
                self.stats.replays["requested"] += 1
                logger.debug("%s: replay from seq %d requested on %s", src.name, job.start, ck[1])
            if self._active >= self.max_concurrent_replays:
                return

    def _source(self, name: str) -> Source:
        for src in self._sources:
            if src.name == name:
                return src
        raise KeyError(name)  # pragma: no cover - jobs only name known sources

    def _check_deadlines(self, now: float) -> None:
        expired = False
        for ck, queue in self._queues.items():
            if not queue or all(job.deadline > now for job in queue):
                continue
            expired = True
            head = queue[0]
            if head.sent and head.deadline <= now:
                # The endpoint is dead or too slow: drop the request in flight, fail every
                # request queued for this channel, and leave it alone for a while.
                src = self._source(ck[0])
                self._cut(src, ck, head.topic)
                self._active -= 1
                self._cooldown_until[ck] = now + self.replay_cooldown
                self.stats.replays["timed_out"] += 1
                detail = (
                    f"replay from seq {head.start} got no end marker within "
                    f"{self.replay_timeout:g} s ({head.replies} repl(ies))"
                )
                if not head.probe:
                    self._log.warning(f"replay_timeout:{ck}", "%s: %s", ck[1], detail)
                    rank = None if head.catch_up is not None else head.stream[1]
                    self._emit(
                        Anomaly(REPLAY_TIMEOUT, head.stream[0], rank, head.start, None, detail)
                    )
                jobs = list(queue)
                queue.clear()
                for job in jobs:
                    self._fail_job(job, detail)
                continue
            keep: deque[_ReplayJob] = deque()
            for job in queue:
                if not job.sent and job.deadline <= now:
                    self.stats.replays["queue_timeout"] += 1
                    self._fail_job(
                        job,
                        f"replay could not start within {self.replay_timeout:g} s "
                        f"({self.max_concurrent_replays} already running)",
                    )
                else:
                    keep.append(job)
            queue.clear()
            queue.extend(keep)
        if expired:
            self._pump(now)

    def _fail_job(self, job: _ReplayJob, detail: str, *, conclusive: bool = True) -> None:
        for key, replay_id in job.streams():
            tracker = self._streams[key].tracker
            self._apply(key, tracker.replay_failed(replay_id, detail, conclusive=conclusive))

    def _catch_up_sources(self) -> None:
        """Ask every replay channel for its whole ring at once, so a subscriber catches
        up even on idle engines.  A source that reports connection events is asked when
        its live socket connects instead (and again after each reconnect), so nothing
        published before the connection is missed."""
        now = time.monotonic()
        for src in self._sources:
            if not getattr(src, "monitored", False):
                self._catch_up_source(src, now)

    def _catch_up_source(self, src: Source, now: float) -> None:
        """The replies create the streams they belong to (the rank is in each batch,
        the topic in the reply or the channel); known streams ignore them."""
        if src.replay_inband or not src.can_replay:
            return
        for channel, topic in _channels(src).items():
            ck = (src.name, channel)
            queue = self._queues.setdefault(ck, deque())
            if any(j.catch_up is not None and not j.sent for j in queue):
                continue
            self.stats.replays["catch_up"] += 1
            queue.append(
                _ReplayJob((src.name, -1), ck, topic, 0, 0, now + self.replay_timeout, catch_up={})
            )
        self._pump(now)

    def _end_inband_job(self, key: StreamKey, job: _ReplayJob) -> None:
        del self._inband[key]
        tracker = self._streams[key].tracker
        if job.replies:
            self._apply(key, tracker.replay_end(job.replay_id))
        else:  # a recording without the replay that answered: nothing to check it by
            self._apply(key, tracker.replay_failed(job.replay_id, "not in the capture"))

    def _end_inband(self, src: Source, *, everything: bool, origin: str = "") -> None:
        for key, job in list(self._inband.items()):
            st = self._streams.get(key)
            owned = st is not None and st.src is src
            mine = everything or key[0] == origin or key[0].startswith(origin + "#")
            if owned and mine and key in self._inband:
                self._end_inband_job(key, job)
        if everything:
            # Whatever is still waiting on a replay the file never held is lost.
            for key, job in list(self._inband.items()):
                if self._streams[key].src is src:
                    del self._inband[key]
                    self._apply(
                        key,
                        self._streams[key].tracker.replay_failed(job.replay_id, "capture ended"),
                    )


class Subscriber(SubscriberCore):
    """Follow the batches of many publishers, repairing gaps by replay.

    ``endpoints``: one endpoint string or :class:`Source`, or a sequence of them.  A string
    becomes a :class:`ZmqSource` subscribed to ``topic`` (a prefix: ``b"kv@"`` follows
    every ``kv@...`` engine behind a proxy); a path ending in ``.kvcap`` (or prefixed
    ``capture:``) becomes a :class:`CaptureSource`.  ``replay_endpoints`` gives the
    replay (ROUTER) endpoints: a sequence aligned with ``endpoints`` (None entries
    allowed), or a mapping whose keys are an endpoint (its replay endpoint for every
    topic) or ``"<endpoint>#<topic>"`` (the replay endpoint of that topic's engine behind
    a shared endpoint).

    Options: ``catch_up`` (default True) replays every new stream from the oldest seq its
    publisher holds and asks each replay endpoint for its ring at start
    (``replay_from_start`` is its deprecated alias); ``replay_timeout`` (s) bounds how
    long a worker's stream may wait on a replay that makes no progress (to start,
    including queueing, and between two replies); ``max_concurrent_replays`` bounds
    replays in flight over all sources; ``replay_cooldown`` (s) is how long a replay
    endpoint that timed out is not asked again; ``stale_after_s`` (default
    :data:`DEFAULT_STALE_AFTER_S`; None: never) is the liveness bound; ``decoder`` is a
    :class:`BatchDecoder` to use (its stats count skipped events); ``history`` and
    ``max_pending`` are passed to each
    :class:`~kvevents.consumers.seqtrack.StreamTracker`; ``rcvhwm`` is the SUB high-water
    mark; ``max_message_size`` (bytes, default 64 MiB; None: unlimited) the
    ``ZMQ_MAXMSGSIZE`` of every socket; ``curve`` a
    :class:`~kvevents.security.CurveClientConfig` for publishers that require CURVE;
    ``max_replay_batches`` bounds one replay's replies (a reply stream that never ends
    is abandoned and its holes reported); ``receive_batch`` the most messages read from one source per wake-up;
    ``inband_window`` how many live records of a capture may follow a gap before the
    recorded replay answering it is given up (the gap is then reported lost).
    """

    def __init__(
        self,
        endpoints: EndpointSpec | Sequence[EndpointSpec],
        topic: bytes | str = b"",
        replay_endpoints: ReplaySpec = None,
        **options: Any,
    ) -> None:
        self._poller: zmq.Poller | None = None
        self._poller_key: tuple[int, ...] = ()
        super().__init__(endpoints, topic, replay_endpoints, **options)

    def receive(self, timeout: float | None = None) -> SubscriberItem | None:
        """Return the next batch or anomaly, waiting up to ``timeout`` seconds (None: for
        ever).  Returns None on timeout, after :meth:`close`, or when every source is
        exhausted (capture files read to the end) and nothing is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            item = self.take()
            if item is not None:
                return item
            if self._closed or self.finished():
                return None
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                # Read what is already there before giving up.
                self.step(None, now)
                return self.take()
            self.step(self._poll(self.wait_seconds(now, deadline)), time.monotonic())

    def _poll(self, wait: float | None) -> list[Source]:
        socks = self.wait_sockets()
        key = tuple(id(s) for s in socks)
        if self._poller is None or key != self._poller_key:
            poller = zmq.Poller()
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            self._poller, self._poller_key = poller, key
        if not socks:
            return self.ready_sources(())
        timeout_ms = None if wait is None else max(0, int(wait * 1000 + 0.999))
        return self.ready_sources(sock for sock, _ in self._poller.poll(timeout_ms))

    def __iter__(self) -> Iterator[SubscriberItem]:
        """Yield batches and anomalies until :meth:`close` (or the end of every source)."""
        while True:
            item = self.receive(None)
            if item is None:
                return
            yield item

    def close(self) -> None:
        """Close every source's sockets (the ZMQ context is left alone).  Idempotent."""
        super().close()
        self._poller = None

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


# --- helpers for sources with and without per-topic replay --------------------------------
def _channel(src: Source, topic: bytes) -> str | None:
    if src.replay_inband:
        return None
    fn = getattr(src, "replay_channel", None)
    if fn is not None:
        ch = fn(topic)
        return ch if isinstance(ch, str) else None
    return "" if src.can_replay else None


def _channels(src: Source) -> dict[str, bytes]:
    fn = getattr(src, "replay_channels", None)
    if fn is not None:
        return dict(fn())
    return {"": b""} if src.can_replay else {}


def _request(src: Source, start: int, topic: bytes) -> None:
    if hasattr(src, "replay_channel"):
        src.request_replay(start, topic)  # type: ignore[call-arg]
    else:
        src.request_replay(start)


def _cancel(src: Source, topic: bytes) -> None:
    if hasattr(src, "replay_channel"):
        src.cancel_replay(topic)  # type: ignore[call-arg]
    else:
        src.cancel_replay()


def _replay_map(
    specs: Sequence[EndpointSpec], replay: ReplaySpec
) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """``(endpoint -> replay endpoint, endpoint -> {topic -> replay endpoint})``."""
    if replay is None:
        return {}, {}
    if isinstance(replay, Mapping):
        plain: dict[str, str] = {}
        by_topic: dict[str, dict[str, str]] = {}
        endpoints = {s for s in specs if isinstance(s, str)}
        for k, v in replay.items():
            if k in endpoints:
                plain[k] = v
                continue
            ep, sep, topic = k.partition("#")
            if not sep or ep not in endpoints:
                raise ConfigError(
                    f"replay_endpoints key {k!r} names no endpoint given "
                    "(use '<endpoint>' or '<endpoint>#<topic>')"
                )
            by_topic.setdefault(ep, {})[topic] = v
        return plain, by_topic
    if isinstance(replay, str):
        replay = [replay]
    if len(replay) != len(specs):
        raise ConfigError(f"replay_endpoints has {len(replay)} entries for {len(specs)} endpoints")
    return {s: r for s, r in zip(specs, replay) if isinstance(s, str) and r is not None}, {}


def _source_for(
    spec: str,
    topic: bytes,
    replay_endpoint: str | None,
    by_topic: dict[str, str] | None,
    context: zmq.Context[Any] | None,
    rcvhwm: int,
    max_message_size: int | None,
    curve: CurveClientConfig | None,
) -> Source:
    if spec.startswith("capture:"):
        return CaptureSource(spec[len("capture:") :], name=spec)
    if spec.endswith(".kvcap") and "://" not in spec:
        return CaptureSource(spec, name=spec)
    return ZmqSource(
        spec,
        topic,
        replay_endpoint,
        replay_by_topic=by_topic,
        context=context,
        rcvhwm=rcvhwm,
        max_message_size=max_message_size,
        curve=curve,
    )
