"""The service's view of its engines: event consumption, index, readiness, health, trust.

A :class:`Fleet` owns one consumer thread: a :class:`~kvevents.consumers.Subscriber` over
every engine rank's publisher (catching each up from the start of its replay buffer)
feeding a :class:`~kvevents.consumers.BlockIndex` that the router reads under
:attr:`Fleet.lock`.  Anomalies that invalidate a worker (publisher restart, unrecoverable
loss) reset it in the index.

Workers: each engine rank's worker id in the index is derived from its spec when the
service starts, as the subscriber names its batches: ``(source, rank)`` where rank is the
global data-parallel rank (one of the spec's :attr:`~kvevents.engines.EngineSpec.ranks`,
``;rank=R`` .. ``R+N-1``) and source the rank's source name (``NAME`` for the spec's
first rank, ``NAME@dpR`` for global rank R after it, each reading its own offset
endpoint), with ``#TOPIC`` appended when the spec gives a topic
(:func:`~kvevents.consumers.subscriber.worker_source`); from JetStream, ``(NAME, rank)``.
A batch naming any other worker (a ``data_parallel_rank`` or a topic the spec does not
give the stream it came on: an engine started with another ``--data-parallel-rank`` or
``kv_events_config.topic``, or a longer topic sharing the spec's prefix; from JetStream,
an engine rank not configured here) is counted per rank and reason in ``unexpected``,
logged once per worker it names, and skipped: it creates no worker.  When a single-rank
spec's stream brings one other rank only, the line suggests ``;rank=`` (an API server
started with ``--data-parallel-rank``, external load balancing).

Readiness (``/readyz``): a rank is ready once its SUB socket is connected (a ZMQ socket
monitor reports the connection) and, when it has a replay endpoint, once that endpoint
has answered a replay (its end marker arrived).  A publisher that has published nothing
answers with the end marker alone, so an idle engine counts as caught up.  The service is
ready once every rank has been ready; an engine lost later is marked down (and shown in
``/workers``) without making the service unready.

With the ``kv-aware-gpu`` policy the index is fed GPU events only (CPU and storage
events are dropped, as routers that ignore events without tokens do), so that policy
neither sees nor predicts the CPU tier.  With a ``capture`` writer, every batch received
is also written to it, as ``kvevents record`` would.

Health: an engine whose HTTP front refuses a request's connection is marked down
(:meth:`Fleet.mark_down`) and skipped until :meth:`Fleet.mark_up` (the metrics scrape
reaching it again).  A failed metrics scrape alone marks it down only when it is the
``scrape_failures``-th in a row (:meth:`Fleet.scrape_failed`), so that one late scrape
(the service's own loop stalled) does not take a healthy engine out of routing.

Completeness: a rank is ``complete`` when its index knows its history from seq 0, or
from a resume point restored from a peer's snapshot that the replay still covered;
``incomplete`` once the ring no longer held the start of its stream
(``history_missed``) or batches were lost for good, until a publisher restart starts a
new history; ``resuming`` while its resume point is being checked.  ``/readyz`` waits
for every engine that is up to be complete.

Trust: a rank whose stream brings no batch and whose replay endpoint answers no probe for
``stale_after_s`` (the subscriber's ``stale``) is untrusted: the index leaves it out
(:meth:`BlockIndex.set_stale`), so the routing policy gives it no KV credit and ranks it
by load alone; one line is logged each way.  Counters per rank (gaps, batches missing,
restarts, stale periods, decode failures) feed the ``kvevents_stream_*`` metrics.

Snapshots: :meth:`Fleet.snapshot` takes the index and every rank's resume point (the
last applied seq and its payload fingerprint) on the consumer thread, between two
batches; a fleet built with a :class:`~kvevents.serve.bootstrap.PeerSnapshot` restores
that index and has the subscriber check each point by replay and follow from it.

Nothing here needs the ``serve`` extra.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvevents.capture import CaptureWriter
from kvevents.consumers import (
    Anomaly,
    BlockIndex,
    ReceivedBatch,
    SourceMessage,
    Subscriber,
    SubscriberOptions,
    ZmqSource,
)
from kvevents.consumers.source_protocol import CONNECTED, DISCONNECTED, REPLAY_END
from kvevents.consumers.subscriber import worker_source
from kvevents.consumers.subscriber.items import BAD_FRAME_KIND, LIVE_AGAIN, STALE, UNDECODABLE
from kvevents.consumers.subscriber.streams import fingerprint
from kvevents.errors import ConfigError
from kvevents.events import MEDIUM_GPU, KVEventBatch
from kvevents.jetstream.reader import JetStreamSubscriber
from kvevents.seqtrack import GAP, HISTORY_MISSED, PUBLISHER_RESTART, UNRECOVERABLE_LOSS
from kvevents.serve.bootstrap import PeerSnapshot, StreamPoint
from kvevents.serve.config import EngineSpec, ServeConfig

__all__ = ["Fleet", "RankState"]

logger = logging.getLogger(__name__)

_RATE_WINDOW_S = 10.0
_UNEXPECTED_KEYS = 64
"""Workers named by unexpected batches that are counted by name (the rest: ``other``)."""


@dataclass
class RankState:
    """What the service knows of one engine rank (one publisher)."""

    engine: EngineSpec
    rank: int
    source: str
    """The subscriber's source name for this rank's stream."""
    events_endpoint: str
    replay_endpoint: str | None
    worker: tuple[str, int]
    """The index's worker id of this rank, derived from the spec when the service starts
    (see :class:`Fleet`): exactly what the rank's batches are named, so routing,
    reservations and ``/workers`` know it before its first event."""
    connected: bool = False
    replay_answered: bool = False
    last_seq: int = -1
    batches: int = 0
    events: int = 0
    last_event_ts: float | None = None
    anomalies: Counter[str] = field(default_factory=Counter)
    recent_anomalies: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    _times: deque[tuple[float, int]] = field(default_factory=deque)

    was_ready: bool = False
    """Latched: the rank has been ready once (the service's start-up catch-up is done)."""

    stale: bool = False
    """Its stream is silent: no batch and no answer to a replay probe for
    ``stale_after_s`` (the subscriber's ``stale``).  An engine whose HTTP front answers
    meanwhile is untrusted: routed by load alone."""
    missed: bool = False
    """History outstanding: the ring no longer held the start of its stream
    (``history_missed``), or batches were lost for good (``unrecoverable_loss``)."""
    resume: tuple[int, int] | None = None
    """While a resume point restored from a peer's snapshot is being checked by replay:
    ``(seq, fingerprint)``."""
    resume_ends: int = 0
    """:attr:`replay_ends` when the resume point was set."""
    replay_ends: int = 0
    """End markers read from its replay endpoint."""
    applied_seq: int = -1
    """The seq of the last batch applied to the index (-1: none)."""
    last_payload: bytes | None = None
    last_fingerprint: int | None = None
    """The payload fingerprint of :attr:`applied_seq` when it came from a snapshot."""
    gaps: int = 0
    batches_missing: int = 0
    restarts: int = 0
    stale_periods: int = 0
    decode_failures: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[str] = field(default_factory=Counter)
    """Batches that came on this rank's stream naming another worker, by what differed
    from the spec (``topic``, ``dp_rank`` or ``topic,dp_rank``): counted, never indexed."""
    other_ranks: set[int] = field(default_factory=set)
    """The ``data_parallel_rank`` values other than :attr:`rank` its stream brought."""

    @property
    def trusted(self) -> bool:
        """Whether its KV credit is used (its stream is not silent)."""
        return not self.stale

    @property
    def completeness(self) -> str:
        """``complete`` (its history is known from seq 0, or from a checked resume point),
        ``resuming`` (a resume point is being checked) or ``incomplete``."""
        if self.missed:
            return "incomplete"
        return "resuming" if self.resume is not None else "complete"

    def resume_point(self) -> tuple[int, int] | None:
        """``(seq, fingerprint)`` of the last batch applied, None before the first."""
        if self.applied_seq < 0:
            return None
        if self.last_payload is not None:
            return self.applied_seq, fingerprint(self.last_payload)
        if self.last_fingerprint is not None:
            return self.applied_seq, self.last_fingerprint
        return None

    @property
    def ready(self) -> bool:
        """Connected now, and caught up (replay answered) if it has a replay endpoint."""
        ok = self.connected and (self.replay_endpoint is None or self.replay_answered)
        if ok:
            self.was_ready = True
        return ok

    @property
    def label(self) -> str:
        return f"{self.engine.name}:{self.rank}"

    def note_events(self, now: float, n: int) -> None:
        self._times.append((now, n))
        while self._times and self._times[0][0] < now - _RATE_WINDOW_S:
            self._times.popleft()

    def events_per_s(self, now: float) -> float:
        while self._times and self._times[0][0] < now - _RATE_WINDOW_S:
            self._times.popleft()
        return sum(n for _, n in self._times) / _RATE_WINDOW_S


class _WatchedSource:
    """A :class:`ZmqSource` that tells its :class:`RankState` when the publisher is
    connected (the source monitors its SUB socket and reports ``connected`` /
    ``disconnected`` messages) and when a replay was answered (end marker).  Everything
    else is delegated to the wrapped source.
    """

    def __init__(self, inner: ZmqSource, state: RankState) -> None:
        self.inner = inner
        self.state = state

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def can_replay(self) -> bool:
        return self.inner.can_replay

    @property
    def replay_inband(self) -> bool:
        return False

    @property
    def exhausted(self) -> bool:
        return self.inner.exhausted

    def sockets(self) -> Sequence[Any]:
        return self.inner.sockets()

    def receive(self, limit: int) -> list[SourceMessage]:
        out = self.inner.receive(limit)
        for msg in out:
            if msg.kind == REPLAY_END:
                self.state.replay_answered = True
                self.state.replay_ends += 1
            elif msg.kind == CONNECTED:
                self.state.connected = True
            elif msg.kind == DISCONNECTED:
                self.state.connected = False
        return out

    def request_replay(self, *args: Any, **kwargs: Any) -> None:
        self.inner.request_replay(*args, **kwargs)

    def cancel_replay(self, *args: Any, **kwargs: Any) -> None:
        self.inner.cancel_replay(*args, **kwargs)

    def close(self) -> None:
        self.inner.close()


class Fleet:
    """Engines, their ranks, the block index and the consumer thread feeding it."""

    def __init__(
        self,
        config: ServeConfig,
        capture: CaptureWriter | None = None,
        bootstrap: PeerSnapshot | None = None,
    ) -> None:
        self.config = config
        self.capture = capture
        self.gpu_only = config.policy == "kv-aware-gpu"
        self.lock = threading.Lock()
        if bootstrap is not None and config.nats_url is not None:
            raise ConfigError("bootstrap from a peer follows ZMQ streams, not --nats")
        self.index = (
            BlockIndex(blocks_per_chunk=config.blocks_per_chunk)
            if bootstrap is None
            else BlockIndex.restore(bootstrap.index)
        )
        self.ranks: list[RankState] = []
        self._by_source: dict[str, RankState] = {}
        """Rank by its stream's source name (ZMQ: each rank reads its own endpoint)."""
        self._by_worker: dict[tuple[str, int], RankState] = {}
        """Rank by its worker id."""
        self._sources: list[_WatchedSource] = []
        self.down_until: dict[str, float] = {}
        self.down_reason: dict[str, str] = {}
        self.scrape_failures: dict[str, int] = {}
        if config.nats_url is not None:
            self._init_jetstream(config)
            return
        ctx: zmq.Context[Any] = zmq.Context.instance()
        try:
            for spec in config.engines:
                for rank in spec.ranks:
                    events, replay = spec.endpoints_for_rank(rank)
                    name = spec.name if rank == spec.first_rank else f"{spec.name}@dp{rank}"
                    topic = spec.topic.encode()
                    worker = (worker_source(name, topic), rank)
                    state = RankState(spec, rank, name, events, replay, worker)
                    inner = ZmqSource(events, topic, replay, name=name, context=ctx)
                    self._sources.append(_WatchedSource(inner, state))
                    self._by_source[name] = state
                    self._add(state)
            # every stream is caught up from the start of its publisher's replay buffer
            self.subscriber: Subscriber | JetStreamSubscriber = Subscriber(
                list(self._sources),  # type: ignore[arg-type,unused-ignore]
                options=SubscriberOptions(
                    replay_timeout_s=config.replay_timeout_s,
                    stale_after_s=config.stale_after_s,
                    catch_up=True,
                ),
            )
        except BaseException:
            for s in self._sources:
                s.close()
            raise
        self._finish_init()
        if bootstrap is not None:
            self._seed(bootstrap)

    def _init_jetstream(self, config: ServeConfig) -> None:
        """Follow the engines' batches in a JetStream stream (``kvevents relay`` wrote them
        as ``kvevents.<NAME>.<rank>``): the worker of an engine's rank is ``(NAME, rank)``,
        and a stream is durable, so every rank counts as connected and caught up."""
        for spec in config.engines:
            for rank in spec.ranks:
                url = config.nats_url or ""
                state = RankState(spec, rank, spec.name, url, None, (spec.name, rank), True)
                self._add(state)
        assert config.nats_url is not None
        self.subscriber = JetStreamSubscriber(config.nats_url, config.nats_stream)
        self._finish_init()

    def _add(self, state: RankState) -> None:
        self.ranks.append(state)
        self._by_worker[state.worker] = state

    def _seed(self, snap: PeerSnapshot) -> None:
        """Follow each stream of ``snap`` from its resume point (checked by replay);
        index workers without a usable point are dropped (their ranks start over)."""
        by_rank = {(st.engine.name, st.rank): st for st in self.ranks}
        seeded: set[tuple[str, int]] = set()
        assert isinstance(self.subscriber, Subscriber)
        for p in snap.streams:
            st = by_rank.get((p.engine, p.rank))
            if st is None or st.replay_endpoint is None:
                why = "not an engine rank of this service" if st is None else "no replay endpoint"
                logger.warning(
                    "bootstrap: %s:%d from the snapshot is dropped (%s)", p.engine, p.rank, why
                )
                continue
            if st.worker != p.worker:
                logger.warning(
                    "bootstrap: %s is worker %s here, %s in the snapshot: it starts over",
                    st.label, st.worker, p.worker,
                )  # fmt: skip
                continue
            wid = self.subscriber.resume(st.source, st.rank, p.seq, p.fingerprint, st.engine.topic)
            assert wid == st.worker, (wid, st.worker)  # named as its batches will be
            st.resume = (p.seq, p.fingerprint)
            st.resume_ends = st.replay_ends
            st.applied_seq = st.last_seq = p.seq
            st.last_fingerprint = p.fingerprint
            st.missed = not p.complete
            seeded.add(wid)
        for wid in self.index.workers():
            if wid not in seeded:
                self.index.remove_worker(wid)
        logger.warning(
            "bootstrap: index restored (%d workers); %d stream(s) resume from the snapshot's "
            "points, checked by replay",
            len(seeded), len(seeded),
        )  # fmt: skip

    def _finish_init(self) -> None:
        self.anomalies: Counter[str] = Counter()
        self._snapshot_requests: deque[tuple[threading.Event, list[Any]]] = deque()
        self.unexpected: Counter[str] = Counter()
        """Batches naming a worker no rank has (see the module), by ``SOURCE:RANK``."""
        self._unexpected_seen: set[tuple[str, str]] = set()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvevents-serve-consumer", daemon=True
        )

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.subscriber.close()
        for s in self._sources:
            s.close()

    # --- lookups -----------------------------------------------------------------------
    def rank_for(self, source: str, dp_rank: int | None) -> RankState | None:
        """The rank whose worker is ``(source, dp_rank)``; with ``dp_rank`` None (an anomaly
        of a stream rather than of a worker), the rank whose stream ``source`` names (its
        source name, with or without ``#TOPIC``).  None for anything else."""
        if dp_rank is not None:
            return self._by_worker.get((source, dp_rank))
        return self._by_source.get(source.partition("#")[0])

    def is_up(self, engine: str, now: float | None = None) -> bool:
        until = self.down_until.get(engine)
        return until is None or (now if now is not None else time.monotonic()) >= until

    def mark_down(self, engine: str, reason: str) -> None:
        if engine not in self.down_until:
            logger.warning("engine %s marked down: %s", engine, reason)
        self.down_until[engine] = time.monotonic() + self.config.retry_after_s
        self.down_reason[engine] = reason

    def mark_up(self, engine: str) -> None:
        if self.down_until.pop(engine, None) is not None:
            logger.warning("engine %s is back", engine)
        self.down_reason.pop(engine, None)

    def scrape_failed(self, engine: str, reason: str) -> bool:
        """Count one failed metrics scrape of ``engine`` (in ``scrape_failures``, reset by
        :meth:`scrape_ok`); mark it down when this is the ``config.scrape_failures``-th
        failure in a row, or when it is marked down already and not seen back since (it
        stays down).  True when it was marked down."""
        n = self.scrape_failures.get(engine, 0) + 1
        self.scrape_failures[engine] = n
        if n < self.config.scrape_failures and engine not in self.down_until:
            return False
        self.mark_down(engine, f"{reason} ({n} failed scrapes in a row)")
        return True

    def scrape_ok(self, engine: str) -> None:
        """A metrics scrape of ``engine`` answered: its failure count restarts and it is
        marked up."""
        self.scrape_failures[engine] = 0
        self.mark_up(engine)

    def not_ready(self) -> list[str]:
        """Ranks that have never been ready, as ``NAME:RANK (why)``.  A rank that was ready
        and later lost its engine is reported by :meth:`is_up` and ``/workers``, not here:
        the service goes on routing to the others."""
        out = []
        for st in self.ranks:
            if not st.ready and not st.was_ready:
                why = "events stream not connected" if not st.connected else "replay not answered"
                out.append(f"{st.label} ({why})")
        return out

    def incomplete(self, now: float | None = None) -> list[str]:
        """Ranks of engines that are up whose index is not complete, as
        ``NAME:RANK (completeness)``."""
        now = time.monotonic() if now is None else now
        return [
            f"{st.label} ({st.completeness})"
            for st in self.ranks
            if st.completeness != "complete" and self.is_up(st.engine.name, now)
        ]

    def snapshot(self, timeout_s: float = 60.0) -> PeerSnapshot:
        """The index snapshot and every stream's resume point, taken at one instant by
        the consumer thread (between two batches).  Blocks up to ``timeout_s`` seconds;
        :class:`ConfigError` when the consumer thread does not answer."""
        done = threading.Event()
        box: list[Any] = []
        self._snapshot_requests.append((done, box))
        if not self._thread.is_alive() and not self._stop.is_set():
            if self.error is not None:
                raise ConfigError(f"the consumer thread failed: {self.error!r}")
            self._serve_snapshots()  # not started yet: nothing runs concurrently
        if not done.wait(timeout_s):
            raise ConfigError(f"no snapshot within {timeout_s:g} s (consumer thread busy)")
        result = box[0]
        if isinstance(result, BaseException):
            raise ConfigError(f"snapshot failed: {result!r}")
        assert isinstance(result, PeerSnapshot)
        return result

    def _take_snapshot(self) -> PeerSnapshot:
        """On the consumer thread, the index's only writer: while it writes the snapshot
        nothing changes the index, so routing goes on reading it (the layout, the one
        cache a reader fills, is brought up to date first: snapshots of equal indexes
        are equal bytes)."""
        points = []
        with self.lock:
            self.index.layout()
            for st in self.ranks:
                rp = st.resume_point()
                if rp is None:
                    continue
                points.append(
                    StreamPoint(st.engine.name, st.rank, st.worker, rp[0], rp[1], not st.missed)
                )
        return PeerSnapshot(self.index.snapshot(), tuple(points), time.time())

    def _serve_snapshots(self) -> None:
        while self._snapshot_requests:
            done, box = self._snapshot_requests.popleft()
            try:
                box.append(self._take_snapshot())
            except Exception as exc:  # pragma: no cover - reported to the caller
                box.append(exc)
            done.set()

    # --- the consumer thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # pragma: no cover - surfaced in /healthz and /workers
            logger.exception("the consumer thread failed")
            self.error = exc

    def _loop(self) -> None:
        sub = self.subscriber
        while not self._stop.is_set():
            if self._snapshot_requests:
                self._serve_snapshots()
            item = sub.receive(timeout=0.05)
            if item is None:
                self._settle_resumes()
                continue
            if isinstance(item, ReceivedBatch):
                if self.capture is not None:
                    self.capture.write(
                        item.source,
                        item.topic,
                        item.seq,
                        item.payload,
                        recv_ts=item.recv_ts,
                        replayed=item.replayed,
                    )
                st = self._by_worker.get((item.source, item.dp_rank))
                if st is None:
                    self._unexpected(item)
                    continue
                batch = _gpu_events(item.batch) if self.gpu_only else item.batch
                with self.lock:
                    self.index.apply(item.source, item.dp_rank, batch)
                if st.resume is not None:
                    # the first batch after the resume point: the check passed
                    logger.warning(
                        "%s: resumed from the snapshot's seq %d (checked by replay)",
                        st.label,
                        st.resume[0],
                    )
                    st.resume = None
                st.applied_seq = item.seq
                st.last_payload = item.payload
                st.batches += 1
                st.events += len(item.batch.events)
                st.last_seq = max(st.last_seq, item.seq)
                st.last_event_ts = time.time()
                st.note_events(time.monotonic(), len(item.batch.events))
            elif isinstance(item, Anomaly):
                self._anomaly(item)

    def _unexpected(self, item: ReceivedBatch) -> None:
        """Count and report a batch naming a worker no rank has (see the module); it is
        not indexed.  Counted by the worker it names (at most :data:`_UNEXPECTED_KEYS`
        names, the rest as ``other``) and, when it came on a rank's stream, for that rank
        by what differs from its spec; one line is logged per (rank, worker named)."""
        named = f"{item.source}:{item.dp_rank}"
        fresh = named in self.unexpected or len(self.unexpected) < _UNEXPECTED_KEYS
        self.unexpected[named if fresh else "other"] += 1
        st = self.rank_for(item.source, None)
        if st is None:
            if fresh and ("", named) not in self._unexpected_seen:
                self._unexpected_seen.add(("", named))
                logger.warning(
                    "batches of worker %s are skipped: it is no engine rank of this service",
                    named,
                )
            return
        topic = item.topic.decode("utf-8", "backslashreplace")
        differs = []
        if topic != st.engine.topic:
            differs.append("topic")
        if item.dp_rank != st.rank:
            differs.append("dp_rank")
            if item.dp_rank is not None and len(st.other_ranks) < _UNEXPECTED_KEYS:
                st.other_ranks.add(item.dp_rank)
        st.unexpected[",".join(differs) or "worker"] += 1
        if fresh and (st.label, named) not in self._unexpected_seen:
            self._unexpected_seen.add((st.label, named))
            line = (
                f"batches of topic {topic!r}, data_parallel_rank {item.dp_rank} came on its "
                f"stream ({st.events_endpoint}); its spec gives it topic {st.engine.topic!r} "
                f"and rank {st.rank}: skipped ({_hint(st, item.dp_rank, topic)})"
            )
            st.recent_anomalies.append(
                f"{time.strftime('%H:%M:%S')} unexpected_batch: {line}"[:200]
            )
            logger.warning("%s: %s", st.label, line)

    def _anomaly(self, item: Anomaly) -> None:
        """Count ``item`` for its rank, reset its worker when it needs one, and follow
        its trust and completeness.  An anomaly of a worker no rank has (a stream of
        unexpected batches) is counted in :attr:`anomalies` only."""
        self.anomalies[item.kind] += 1
        st = self.rank_for(item.source, item.dp_rank)
        if st is None:
            return
        if item.needs_reset and item.dp_rank is not None:
            with self.lock:
                self.index.reset_worker(st.worker)
        kind = item.kind
        st.anomalies[kind] += 1
        st.recent_anomalies.append(f"{time.strftime('%H:%M:%S')} {kind}: {item.detail}"[:200])
        n = 0
        if item.first_seq is not None and item.last_seq is not None:
            n = item.last_seq - item.first_seq + 1
        if kind == GAP:
            st.gaps += 1
        elif kind in (UNDECODABLE, BAD_FRAME_KIND):
            st.decode_failures[kind] += 1
        elif kind in (HISTORY_MISSED, UNRECOVERABLE_LOSS):
            st.batches_missing += n
            st.missed = True
            if st.resume is not None:
                logger.warning(
                    "%s: the snapshot's resume point (seq %d) is no longer in the engine's "
                    "replay ring: its index starts over from what the ring holds (incomplete)",
                    st.label, st.resume[0],
                )  # fmt: skip
                st.resume = None
        elif kind == PUBLISHER_RESTART:
            st.restarts += 1
            st.missed = False  # a new stream: its history starts again at seq 0
            st.applied_seq, st.last_payload, st.last_fingerprint = -1, None, None
            if st.resume is not None:
                logger.warning(
                    "%s: the snapshot's resume point (seq %d) does not match the engine's "
                    "stream (%s): its index starts over from the engine's ring",
                    st.label, st.resume[0], item.detail,
                )  # fmt: skip
                st.resume = None
        elif kind == STALE and not st.stale:
            st.stale = True
            st.stale_periods += 1
            with self.lock:
                self.index.set_stale(st.worker)
            logger.warning(
                "%s: untrusted: no event and no replay answer for %s s; its KV credit is "
                "not used (routed by load alone) until its events return",
                st.label, self.config.stale_after_s,
            )  # fmt: skip
        elif kind == LIVE_AGAIN and st.stale:
            st.stale = False
            with self.lock:
                self.index.set_stale(st.worker, False)
            logger.warning("%s: trusted again: its events are back", st.label)

    def _settle_resumes(self) -> None:
        """Nothing is left to take: a rank whose resume check has been answered (its end
        marker read) with no anomaly resumed at its point (an idle engine)."""
        for st in self.ranks:
            if st.resume is not None and st.replay_ends > st.resume_ends:
                logger.warning(
                    "%s: resumed from the snapshot's seq %d (checked by replay; nothing new)",
                    st.label, st.resume[0],
                )  # fmt: skip
                st.resume = None


def _hint(st: RankState, dp_rank: int | None, topic: str) -> str:
    """What to check in the spec of ``st``, whose stream brought a batch of ``dp_rank``
    and ``topic``.  A single-rank spec whose stream brings one other rank only is an API
    server started with ``--data-parallel-rank K`` (external load balancing): it
    publishes as global rank K on vLLM's endpoint moved up by K, so the spec wants
    ``;rank=K`` with the endpoint vLLM was given (this stream's moved back by K, when
    that is a valid one)."""
    spec = st.engine
    if (
        dp_rank is None
        or dp_rank == st.rank
        or topic != spec.topic
        or spec.dp_size != 1
        or st.other_ranks != {dp_rank}
    ):
        return "check the engine's ;topic=, ;dp= and ;rank="
    hint = (
        f"an API server started with --data-parallel-rank {dp_rank} publishes as that "
        f"global rank: give its spec ;rank={dp_rank}"
    )
    base = _unoffset(st.events_endpoint, dp_rank)
    if base is not None:
        hint += f" and the endpoint vLLM was configured with ({base} for this stream)"
    return hint


def _unoffset(endpoint: str, rank: int) -> str | None:
    """The endpoint that vLLM's offset for ``rank`` turns into ``endpoint`` (tcp port -
    rank, or the ``_dp<rank>`` suffix of an inproc name removed), None if there is none."""
    if endpoint.startswith("inproc://"):
        suffix = f"_dp{rank}"
        return endpoint[: -len(suffix)] if endpoint.endswith(suffix) else None
    base, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        return None
    if int(port) - rank < 1:
        return None
    return f"{base}:{int(port) - rank}"


def _gpu_events(batch: KVEventBatch) -> KVEventBatch:
    """The batch without its CPU/STORAGE events (``medium`` None is GPU, vLLM <= 0.10):
    what a router that drops events without tokens sees (the ``kv-aware-gpu`` policy)."""
    events = [e for e in batch.events if getattr(e, "medium", None) in (None, MEDIUM_GPU)]
    if len(events) == len(batch.events):
        return batch
    return KVEventBatch(batch.ts, events, batch.data_parallel_rank)
