"""The subscriber SDK: follow many publishers without losing track of any (DESIGN §4).

:class:`Subscriber` reads one or more sources (ZMQ endpoints of vLLM-compatible
publishers, capture files, or any :class:`~kvevents.consumers.sources.Source`), decodes
each batch, tracks seq per ``(source, dp_rank)`` (:mod:`kvevents.consumers.seqtrack`)
and yields, in order:

* :class:`ReceivedBatch` - a decoded batch to apply, with its raw topic and payload bytes
  (so a recorder can store it losslessly) and whether it came through replay;
* :class:`Anomaly` - a counted value describing something the application should know:
  ``gap`` (being replayed), ``duplicate`` (dropped), ``publisher_restart`` and
  ``unrecoverable_loss`` (both: reset that worker - :attr:`Anomaly.needs_reset`),
  ``replay_timeout``, ``undecodable`` and ``bad_frame`` (skipped).

Anomalies are values, never exceptions: the stream always goes on.  A gap is repaired by
a DEALER replay (C§2.2) merged with live traffic so nothing is applied twice or out of
order.  Replays have a timeout (the stream of that worker is held at most that long
without a reply), a
bound on how many run at once, and a cooldown: after a replay endpoint timed out, gaps on
that source are reported lost at once for ``replay_cooldown`` seconds instead of waiting
on it again.  Everything dropped or skipped is counted in :attr:`Subscriber.stats` with a
reason label.

Threading: a subscriber is used from one thread (ZMQ sockets are not thread-safe).  For
asyncio use :class:`~kvevents.consumers.aio.AsyncSubscriber`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Union

import zmq

from kvevents.codec import BatchDecoder
from kvevents.consumers.seqtrack import (
    GAP,
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
    LIVE,
    REPLAY,
    REPLAY_END,
    CaptureSource,
    Source,
    SourceMessage,
    ZmqSource,
)
from kvevents.errors import ConfigError, DecodeError
from kvevents.events import KVEventBatch

__all__ = [
    "ANOMALY_KINDS",
    "BAD_FRAME_KIND",
    "REPLAY_TIMEOUT",
    "UNDECODABLE",
    "Anomaly",
    "ReceivedBatch",
    "Subscriber",
    "SubscriberItem",
    "SubscriberStats",
]

logger = logging.getLogger(__name__)

UNDECODABLE = "undecodable"
BAD_FRAME_KIND = "bad_frame"
REPLAY_TIMEOUT = "replay_timeout"
ANOMALY_KINDS: frozenset[str] = frozenset(
    {
        GAP,
        "duplicate",
        PUBLISHER_RESTART,
        UNRECOVERABLE_LOSS,
        UNDECODABLE,
        BAD_FRAME_KIND,
        REPLAY_TIMEOUT,
    }
)
"""Every :attr:`Anomaly.kind` the subscriber reports."""


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """A decoded batch to apply.

    ``source`` names the publisher (its endpoint, or the recorded source of a capture);
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

    ``kind`` is one of :data:`ANOMALY_KINDS`.  ``first_seq``..``last_seq`` is the
    inclusive seq range concerned (see :class:`~kvevents.consumers.seqtrack.Report` for
    ``publisher_restart``); ``dp_rank`` is None when the rank is unknown (an undecodable
    payload, a bad frame, a replay endpoint timing out).
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
    ``anomalies``: reported anomalies by kind;
    ``dropped``: messages discarded, by reason (``duplicate``, ``replay_overlap``,
    ``stale_replay``, ``replay_mismatch``, ``replay_other_rank``, ``undecodable``,
    ``bad_frame``, ...);
    ``replays``: replay requests by outcome (``requested``, ``completed``, ``timed_out``,
    ``unavailable``, ``cooldown``, ``queue_timeout``, ``superseded``).
    """

    batches: int = 0
    events: int = 0
    replayed_batches: int = 0
    lost_batches: int = 0
    anomalies: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    replays: Counter[str] = field(default_factory=Counter)


@dataclass(slots=True)
class _Item:
    topic: bytes
    payload: bytes
    batch: KVEventBatch
    recv_ts: float
    replayed: bool


@dataclass
class _ReplayJob:
    stream: tuple[str, int]
    start: int
    replay_id: int
    deadline: float
    sent: bool = False
    replies: int = 0
    waited: int = 0
    catch_up: dict[tuple[str, int], int] | None = None
    """For the start-up catch-up of a source: the streams it fed, with their replay ids."""

    def streams(self) -> list[tuple[tuple[str, int], int]]:
        """``(stream, replay_id)`` pairs this job answers."""
        if self.catch_up is not None:
            return list(self.catch_up.items())
        return [(self.stream, self.replay_id)]


class _RateLimitedLog:
    """Log a warning per key at most once per ``interval`` seconds, with a skipped count."""

    def __init__(self, interval: float = 5.0) -> None:
        self._interval = interval
        self._last: dict[str, float] = {}
        self._skipped: Counter[str] = Counter()

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e18) < self._interval:
            self._skipped[key] += 1
            return
        skipped = self._skipped.pop(key, 0)
        self._last[key] = now
        if skipped:
            logger.warning(msg + " (%d similar suppressed)", *args, skipped)
        else:
            logger.warning(msg, *args)


EndpointSpec = Union[str, Source]


class Subscriber:
    """Follow the batches of many publishers, repairing gaps by replay.

    ``endpoints``: one endpoint string or :class:`Source`, or a sequence of them.  A string
    becomes a :class:`ZmqSource` subscribed to ``topic``; a path ending in ``.kvcap`` (or
    prefixed ``capture:``) becomes a :class:`CaptureSource`.  ``replay_endpoints`` gives
    the replay (ROUTER) endpoint of each string endpoint: a sequence aligned with
    ``endpoints`` (None entries allowed) or a mapping from endpoint to replay endpoint.

    Options: ``replay_from_start`` asks each source's replay endpoint for its whole
    buffer when the subscriber starts, and catches any stream seen later up from seq 0;
    ``replay_timeout`` (s) bounds how long a worker's stream may wait on a replay that
    makes no progress (to start, including queueing, and between two replies); ``max_concurrent_replays`` bounds replays in flight over all sources;
    ``replay_cooldown`` (s) is how long a source whose replay timed out is not asked
    again; ``decoder`` is a :class:`BatchDecoder` to use (its stats count skipped events);
    ``history`` and ``max_pending`` are passed to each
    :class:`~kvevents.consumers.seqtrack.StreamTracker`; ``rcvhwm`` is the SUB high-water
    mark; ``receive_batch`` the most messages read from one source per wake-up;
    ``inband_window`` how many live records of a capture may follow a gap before the
    recorded replay answering it is given up (the gap is then reported lost).
    """

    def __init__(
        self,
        endpoints: EndpointSpec | Sequence[EndpointSpec],
        topic: bytes = b"",
        replay_endpoints: Sequence[str | None] | Mapping[str, str] | None = None,
        *,
        replay_from_start: bool = False,
        replay_timeout: float = 5.0,
        max_concurrent_replays: int = 4,
        replay_cooldown: float = 10.0,
        decoder: BatchDecoder | None = None,
        context: zmq.Context[Any] | None = None,
        history: int = 4096,
        max_pending: int = 100_000,
        rcvhwm: int = 100_000,
        receive_batch: int = 256,
        inband_window: int = 1024,
    ) -> None:
        if replay_timeout <= 0 or max_concurrent_replays < 1 or replay_cooldown < 0:
            raise ConfigError(
                "replay_timeout must be > 0, max_concurrent_replays >= 1, replay_cooldown >= 0"
            )
        if isinstance(topic, str):
            topic = topic.encode()
        specs: list[EndpointSpec] = (
            [endpoints] if isinstance(endpoints, (str, Source)) else list(endpoints)
        )
        if not specs:
            raise ConfigError("Subscriber needs at least one endpoint or source")
        replay_for = _replay_map(specs, replay_endpoints)
        self.stats = SubscriberStats()
        self.decoder = decoder if decoder is not None else BatchDecoder()
        self.replay_timeout = replay_timeout
        self.max_concurrent_replays = max_concurrent_replays
        self.replay_cooldown = replay_cooldown
        self._replay_from_start = replay_from_start
        self._history = history
        self._max_pending = max_pending
        self._batch = receive_batch
        self._inband_window = inband_window
        self._sources: list[Source] = []
        try:
            for spec in specs:
                if isinstance(spec, str):
                    self._sources.append(
                        _source_for(spec, topic, replay_for.get(spec), context, rcvhwm)
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
        self._by_name: dict[str, Source] = {s.name: s for s in self._sources}
        self._out: deque[SubscriberItem] = deque()
        self._trackers: dict[tuple[str, int], StreamTracker[_Item]] = {}
        self._stream_source: dict[tuple[str, int], Source] = {}
        self._queues: dict[str, deque[_ReplayJob]] = {s.name: deque() for s in self._sources}
        self._inband: dict[tuple[str, int], _ReplayJob] = {}
        self._active = 0
        self._cooldown_until: dict[str, float] = {}
        self._last_topic: dict[str, bytes] = {}
        self._poller: zmq.Poller | None = None
        self._poller_key: tuple[int, ...] = ()
        self._owner: dict[Any, Source] = {}
        self._log = _RateLimitedLog()
        self._closed = False
        self._last_delivery: dict[tuple[str, int], float] = {}
        self.stale_after_s = 30.0
        """A worker whose last delivered batch was received longer ago than this (seconds)
        counts as stale in :meth:`gauges`."""
        if replay_from_start:
            self._catch_up_sources()

    # --- public API -----------------------------------------------------------------
    @property
    def sources(self) -> tuple[Source, ...]:
        """The sources, in the order given."""
        return tuple(self._sources)

    @property
    def closed(self) -> bool:
        return self._closed

    def receive(self, timeout: float | None = None) -> SubscriberItem | None:
        """Return the next batch or anomaly, waiting up to ``timeout`` seconds (None: for
        ever).  Returns None on timeout, after :meth:`close`, or when every source is
        exhausted (capture files read to the end) and nothing is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._out:
                return self._out.popleft()
            if self._closed or self._finished():
                return None
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                # Read what is already there before giving up.
                self._step(self._poll(0.0), now)
                return self._out.popleft() if self._out else None
            self._step(self._poll(self._wait_seconds(now, deadline)), time.monotonic())

    def __iter__(self) -> Iterator[SubscriberItem]:
        """Yield batches and anomalies until :meth:`close` (or the end of every source)."""
        while True:
            item = self.receive(None)
            if item is None:
                return
            yield item

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

    def gauges(self, now: float | None = None) -> dict[str, float]:
        """Current state, for metrics (``now``: wall-clock seconds, default the time now).

        ``workers``: ``(source, dp_rank)`` streams seen; ``stale_workers``: those whose
        last delivered batch was received more than :attr:`stale_after_s` ago;
        ``replays_in_flight``: replay requests sent and not finished;
        ``replay_lag_batches``: live batches held back behind gaps being replayed;
        ``replay_lag_seconds``: how long the stream held back longest has delivered
        nothing (seconds since its last delivered batch; 0 when no stream is replaying).
        Reads copies of the subscriber's tables, so a scrape thread may call it."""
        now = time.time() if now is None else now
        last = dict(self._last_delivery)
        trackers = list(self._trackers.items())
        stale = sum(1 for ts in last.values() if now - ts > self.stale_after_s)
        held = 0
        lag = 0.0
        for key, tracker in trackers:
            if tracker.replaying:
                held += tracker.pending
                since = last.get(key)
                if since is not None:
                    lag = max(lag, now - since)
        return {
            "workers": len(trackers),
            "stale_workers": stale,
            "replays_in_flight": self._active,
            "replay_lag_batches": held,
            "replay_lag_seconds": max(lag, 0.0),
        }

    # --- the engine shared with AsyncSubscriber ------------------------------------------
    def _take(self) -> SubscriberItem | None:
        return self._out.popleft() if self._out else None

    def _finished(self) -> bool:
        return all(s.exhausted for s in self._sources) and not self._inband

    def _wait_seconds(self, now: float, deadline: float | None) -> float | None:
        """How long the next poll may wait: until the caller's deadline or the next replay
        deadline; 0 when an always-ready source (a file) has more to read."""
        waits: list[float] = []
        if deadline is not None:
            waits.append(deadline - now)
        for src in self._sources:
            if not src.exhausted and not src.sockets():
                return 0.0
        for queue in self._queues.values():
            for job in queue:
                waits.append(job.deadline - now)
        return max(0.0, min(waits)) if waits else None

    def _poll_sockets(self) -> list[Any]:
        socks: list[Any] = []
        owner: dict[Any, Source] = {}
        for src in self._sources:
            for sock in src.sockets():
                socks.append(sock)
                owner[sock] = src
        self._owner = owner
        return socks

    def _poll(self, wait: float | None) -> list[Source]:
        socks = self._poll_sockets()
        key = tuple(id(s) for s in socks)
        if self._poller is None or key != self._poller_key:
            poller = zmq.Poller()
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            self._poller, self._poller_key = poller, key
        ready: list[Source] = []
        if socks:
            timeout_ms = None if wait is None else max(0, int(wait * 1000 + 0.999))
            events = self._poller.poll(timeout_ms)
            seen: set[int] = set()
            for sock, _ in events:
                src = self._owner[sock]
                if id(src) not in seen:
                    seen.add(id(src))
                    ready.append(src)
        for src in self._sources:
            if not src.exhausted and not src.sockets():
                ready.append(src)
        return ready

    def _step(self, ready: Iterable[Source], now: float) -> None:
        """Read what the ``ready`` sources have, process it, then enforce replay deadlines."""
        for src in ready:
            for msg in src.receive(self._batch):
                self._process(src, msg, now)
            if src.exhausted and src.replay_inband:
                self._end_inband(src, everything=True)
        self._check_deadlines(now)

    # --- message handling -------------------------------------------------------------
    def _process(self, src: Source, msg: SourceMessage, now: float) -> None:
        kind = msg.kind
        origin = msg.origin or src.name
        if kind == LIVE:
            self._last_topic[origin] = msg.topic
            decoded = self._decode(origin, msg)
            if decoded is None:
                return
            key = (origin, decoded.data_parallel_rank or 0)
            tracker = self._tracker(key, src)
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
            self._apply(key, tracker.live(msg.seq, item, fp))
        elif kind == REPLAY:
            queue = self._queues[src.name]
            job = queue[0] if queue and queue[0].sent else None
            if job is None:
                self.stats.dropped["stale_replay"] += 1
                return
            job.replies += 1
            # The timeout bounds a replay without progress: every reply renews it.
            job.deadline = now + self.replay_timeout
            decoded = self._decode(origin, msg)
            if decoded is None:
                return
            key = (origin, decoded.data_parallel_rank or 0)
            topic = msg.topic or self._last_topic.get(origin, b"")
            item = _Item(topic, msg.payload, decoded, msg.recv_ts, True)
            if job.catch_up is not None:
                replay_id = job.catch_up.get(key)
                if replay_id is None:
                    tracker = self._tracker(key, src)
                    start = tracker.catch_up()
                    if start is None:  # already following: live traffic got there first
                        self.stats.dropped["catch_up_overlap"] += 1
                        return
                    replay_id = job.catch_up[key] = start.replay_id
            elif key != job.stream:
                self.stats.dropped["replay_other_rank"] += 1
                return
            else:
                replay_id = job.replay_id
            self._apply(
                key, self._trackers[key].replayed(replay_id, msg.seq, item, hash(msg.payload))
            )
        elif kind == REPLAY_END:
            if src.replay_inband:
                self._end_inband(src, everything=False, origin=origin)
                return
            queue = self._queues[src.name]
            if not queue or not queue[0].sent:
                self.stats.dropped["stale_replay_end"] += 1
                return
            job = queue.popleft()
            self._active -= 1
            self.stats.replays["completed"] += 1
            for key, replay_id in job.streams():
                self._apply(key, self._trackers[key].replay_end(replay_id))
            self._pump(now)
        elif kind == BAD_FRAME:
            self.stats.dropped["bad_frame"] += 1
            self._log.warning(
                "bad_frame:" + origin, "%s: skipped a malformed message: %s", origin, msg.detail
            )
            self._emit(Anomaly(BAD_FRAME_KIND, origin, None, None, None, msg.detail))

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

    def _tracker(self, key: tuple[str, int], src: Source) -> StreamTracker[_Item]:
        tracker = self._trackers.get(key)
        if tracker is None:
            tracker = StreamTracker(
                replay_from_start=self._replay_from_start,
                history=self._history,
                max_pending=self._max_pending,
            )
            self._trackers[key] = tracker
            self._stream_source[key] = src
        return tracker

    def _emit(self, anomaly: Anomaly) -> None:
        self.stats.anomalies[anomaly.kind] += 1
        self._out.append(anomaly)

    def _apply(self, key: tuple[str, int], actions: list[TrackerAction[_Item]]) -> None:
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
                if act.kind == UNRECOVERABLE_LOSS and act.first_seq is not None:
                    stats.lost_batches += (act.last_seq or 0) - act.first_seq + 1
                if act.kind == "duplicate":
                    stats.dropped["duplicate"] += 1
                if act.kind != GAP:
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

    # --- replay scheduling ------------------------------------------------------------
    def _schedule(self, key: tuple[str, int], req: StartReplay) -> None:
        src = self._stream_source[key]
        tracker = self._trackers[key]
        now = time.monotonic()
        if src.replay_inband:
            self.stats.replays["inband"] += 1
            self._inband[key] = _ReplayJob(key, req.start, req.replay_id, float("inf"), True)
            return
        if not src.can_replay:
            self.stats.replays["unavailable"] += 1
            self._apply(key, tracker.replay_failed(req.replay_id, "no replay endpoint"))
            return
        if now < self._cooldown_until.get(src.name, 0.0):
            self.stats.replays["cooldown"] += 1
            self._apply(
                key,
                tracker.replay_failed(
                    req.replay_id, "replay endpoint timed out recently (cooldown)"
                ),
            )
            return
        self._queues[src.name].append(
            _ReplayJob(key, req.start, req.replay_id, now + self.replay_timeout)
        )
        self._pump(now)

    def _pump(self, now: float) -> None:
        """Send queued requests while fewer than ``max_concurrent_replays`` are in flight
        (one per source at a time: replies on a DEALER carry no request id)."""
        for src in self._sources:
            queue = self._queues[src.name]
            while queue and not queue[0].sent:
                job = queue[0]
                tracker = self._trackers.get(job.stream)
                if job.catch_up is None and (
                    tracker is None or not tracker.replaying or tracker.replay_id != job.replay_id
                ):
                    queue.popleft()
                    self.stats.replays["superseded"] += 1
                    continue
                if self._active >= self.max_concurrent_replays:
                    break
                src.request_replay(job.start)
                job.sent = True
                self._active += 1
                self.stats.replays["requested"] += 1
                logger.debug("%s: replay from seq %d requested", src.name, job.start)
            if self._active >= self.max_concurrent_replays:
                return

    def _check_deadlines(self, now: float) -> None:
        expired = False
        for src in self._sources:
            queue = self._queues[src.name]
            if not queue or all(job.deadline > now for job in queue):
                continue
            expired = True
            head = queue[0]
            if head.sent and head.deadline <= now:
                # The endpoint is dead or too slow: drop the request in flight, fail every
                # request queued for this source, and leave it alone for a while.
                src.cancel_replay()
                self._active -= 1
                self._cooldown_until[src.name] = now + self.replay_cooldown
                self.stats.replays["timed_out"] += 1
                detail = (
                    f"replay from seq {head.start} got no end marker within "
                    f"{self.replay_timeout:g} s ({head.replies} repl(ies))"
                )
                self._log.warning(f"replay_timeout:{src.name}", "%s: %s", src.name, detail)
                self._emit(
                    Anomaly(REPLAY_TIMEOUT, src.name, head.stream[1], head.start, None, detail)
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

    def _fail_job(self, job: _ReplayJob, detail: str) -> None:
        for key, replay_id in job.streams():
            self._apply(key, self._trackers[key].replay_failed(replay_id, detail))

    def _catch_up_sources(self) -> None:
        """``replay_from_start``: ask every source with a replay endpoint for its whole
        buffer at once, so a subscriber catches up even before new traffic arrives.  The
        replies create the streams they belong to (the rank is in each batch)."""
        now = time.monotonic()
        for src in self._sources:
            if src.can_replay and not src.replay_inband:
                self.stats.replays["catch_up"] += 1
                job = _ReplayJob((src.name, -1), 0, 0, now + self.replay_timeout, catch_up={})
                self._queues[src.name].append(job)
        self._pump(now)

    def _end_inband_job(self, key: tuple[str, int], job: _ReplayJob) -> None:
        del self._inband[key]
        self._apply(key, self._trackers[key].replay_end(job.replay_id))

    def _end_inband(self, src: Source, *, everything: bool, origin: str = "") -> None:
        for key, job in list(self._inband.items()):
            owned = self._stream_source.get(key) is src
            if owned and (everything or key[0] == origin) and key in self._inband:
                self._end_inband_job(key, job)
        if everything:
            # Whatever is still waiting on a replay the file never held is lost.
            for key, job in list(self._inband.items()):
                if self._stream_source.get(key) is src:
                    del self._inband[key]
                    self._apply(
                        key,
                        self._trackers[key].replay_failed(job.replay_id, "capture ended"),
                    )


def _replay_map(
    specs: Sequence[EndpointSpec], replay: Sequence[str | None] | Mapping[str, str] | None
) -> dict[str, str]:
    if replay is None:
        return {}
    if isinstance(replay, Mapping):
        return dict(replay)
    if isinstance(replay, str):
        replay = [replay]
    if len(replay) != len(specs):
        raise ConfigError(f"replay_endpoints has {len(replay)} entries for {len(specs)} endpoints")
    return {s: r for s, r in zip(specs, replay) if isinstance(s, str) and r is not None}


def _source_for(
    spec: str,
    topic: bytes,
    replay_endpoint: str | None,
    context: zmq.Context[Any] | None,
    rcvhwm: int,
) -> Source:
    if spec.startswith("capture:"):
        return CaptureSource(spec[len("capture:") :], name=spec)
    if spec.endswith(".kvcap") and "://" not in spec:
        return CaptureSource(spec, name=spec)
    return ZmqSource(spec, topic, replay_endpoint, context=context, rcvhwm=rcvhwm)
