"""The subscriber's engine without a way to wait: :class:`SubscriberCore`.

One job: compose the rooms (stream table, outbox, replay scheduler, in-band replays,
liveness) and route each source message to the one that handles it, behind a small
public driving interface that the blocking :class:`~kvevents.consumers.subscriber.Subscriber`
and the asyncio :class:`~kvevents.consumers.aio.AsyncSubscriber` both use.  May import
every room of the subscriber package, the source protocol, :mod:`kvevents.codec` and
:mod:`kvevents.ratelimit`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Generator, Iterable, Sequence
from typing import Any

import zmq

from kvevents.codec import BatchDecoder
from kvevents.consumers.source_protocol import (
    BAD_FRAME,
    CONNECTED,
    DISCONNECTED,
    LIVE,
    REPLAY,
    REPLAY_DISCONNECTED,
    REPLAY_END,
    Source,
    SourceMessage,
)
from kvevents.consumers.subscriber.capacity import ensure_open_files, fleet_context
from kvevents.consumers.subscriber.inband import InbandReplays
from kvevents.consumers.subscriber.items import (
    BAD_FRAME_KIND,
    Anomaly,
    SubscriberItem,
    SubscriberStats,
)
from kvevents.consumers.subscriber.liveness import Liveness
from kvevents.consumers.subscriber.options import (
    EndpointSpec,
    ReplaySpec,
    SubscriberOptions,
    open_sources,
    zmq_links,
)
from kvevents.consumers.subscriber.outbox import Outbox
from kvevents.consumers.subscriber.replay import ReplayScheduler
from kvevents.consumers.subscriber.replies import ReplyRouter
from kvevents.consumers.subscriber.streams import HeldBatch, StreamKey, fingerprint
from kvevents.consumers.subscriber.table import StreamTable
from kvevents.consumers.subscriber.waiting import SourceWaits
from kvevents.errors import ConfigError, DecodeError
from kvevents.ratelimit import RateLimitedLog
from kvevents.security import CurveClientConfig
from kvevents.seqtrack import StreamTracker

__all__ = ["SubscriberCore"]

logger = logging.getLogger("kvevents.consumers.subscriber")


_Run = tuple[str, bytes, int, StreamKey, StreamTracker[HeldBatch]]
"""The stream of the batch a read just delivered in order: the batch's origin (as sent),
topic and rank, the stream's key and its tracker (a tuple: it is read once a batch)."""


def _earlier(wait: float | None, w: float | None) -> float | None:
    """The shorter of two waits in seconds (None: no limit)."""
    return wait if w is None or (wait is not None and wait <= w) else w


class SubscriberCore:
    """The subscriber's engine without a way to wait: decoding, seq tracking, replay
    scheduling, liveness.  :class:`~kvevents.consumers.subscriber.Subscriber` (blocking)
    and :class:`~kvevents.consumers.aio.AsyncSubscriber` (asyncio) drive it through this
    public interface:

    * :meth:`take` - the next item ready, or None;
    * :meth:`receiving` - the receive loop without the wait: it yields how long to wait
      and is sent the sources with input, which :meth:`select` (blocking) finds, or
      :meth:`select` with no wait once :meth:`wait_fd` is readable (both wrappers run
      it);
    * :meth:`wait_sockets`, :meth:`wait_seconds`, :meth:`ready_sources` and :meth:`step`
      - the pieces of that loop, for a caller with its own event loop that polls the
      sockets itself;
    * :meth:`finished` / :attr:`closed` / :meth:`close`.

    Arguments: see :class:`~kvevents.consumers.subscriber.Subscriber`; every setting is
    a field of :class:`~kvevents.consumers.subscriber.SubscriberOptions`.
    """

    def __init__(
        self,
        endpoints: EndpointSpec | Sequence[EndpointSpec],
        topic: bytes | str = b"",
        replay_endpoints: ReplaySpec = None,
        *,
        options: SubscriberOptions | None = None,
        decoder: BatchDecoder | None = None,
        context: zmq.Context[Any] | None = None,
        curve: CurveClientConfig | None = None,
    ) -> None:
        self._closed = True  # until the sources are open
        self.options = options = options if options is not None else SubscriberOptions()
        """The settings (read-only: the rooms were built from them)."""
        if isinstance(topic, str):
            topic = topic.encode()
        links = zmq_links(endpoints, replay_endpoints)
        ensure_open_files(links)
        self._own_context = None if context is not None else fleet_context(links)
        try:
            self._sources = open_sources(
                endpoints,
                topic,
                replay_endpoints,
                options,
                context=context or self._own_context,
                curve=curve,
            )
        except BaseException:
            if self._own_context is not None:
                self._own_context.destroy(0)
            raise
        self.stats = SubscriberStats()
        self.decoder = decoder if decoder is not None else BatchDecoder()
        outbox = self._outbox = Outbox(self.stats, RateLimitedLog(logger))
        table = self._table = StreamTable(
            outbox,
            self.decoder,
            catch_up=options.catch_up,
            history=options.history,
            max_pending=options.max_pending,
        )
        self._inband = InbandReplays(table.streams, outbox, options.inband_window)
        self._replays = ReplayScheduler(
            self._sources,
            table,
            outbox,
            self._inband,
            replay_timeout_s=options.replay_timeout_s,
            max_concurrent_replays=options.max_concurrent_replays,
            replay_cooldown_s=options.replay_cooldown_s,
            max_replay_batches=options.max_replay_batches,
        )
        # The rooms refer to each other, never to this object: dropping the last
        # reference to a subscriber closes it at once (``__del__``).
        probe = functools.partial(self._replays.schedule, probe=True)
        self._liveness = Liveness(table.streams, outbox, options.stale_after_s, probe)
        self._replies = ReplyRouter(table, outbox, self._liveness, self._replays)
        self._batch = options.receive_batch
        self._waits = SourceWaits(self._sources)
        self._reads: deque[tuple[Source, list[SourceMessage]]] = deque()
        """The last wake-up's reads held raw, in read order."""
        self._wake: tuple[list[Source], float] | None = None
        """The sources and time of the last wake-up while it has reads held (its duties
        run after the last of them)."""
        self._closed = False
        if options.catch_up:
            self._replays.catch_up_sources()
            self._waits.settle(self._replays.take_touched())

    # --- the driving interface ----------------------------------------------------------
    @property
    def sources(self) -> tuple[Source, ...]:
        """The sources, in the order given."""
        return tuple(self._sources)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def stale_workers(self) -> list[tuple[str, int]]:
        """The workers currently stale (see the package docstring), sorted."""
        return sorted(k for k, s in self._table.streams.items() if s.stale)

    def resume(
        self, source: str, dp_rank: int, seq: int, fingerprint: int, topic: bytes | str = b""
    ) -> tuple[str, int]:
        """Follow the stream of ``source`` (a source's name), ``topic`` and ``dp_rank``
        from a resume point instead of from its ring's start: its batch ``seq``, whose
        payload fingerprint (:func:`~kvevents.consumers.subscriber.streams.fingerprint`)
        was ``fingerprint``, is taken as applied (the caller restored an index taken
        there).  A replay from ``seq`` checks it before anything new is delivered (once
        the live socket connects, for a source that reports connections; that source's
        start-up catch-up is skipped): see
        :meth:`~kvevents.seqtrack.StreamTracker.check_resume` for what a point the ring
        no longer holds, or another payload under that seq, reports.  Call before
        receiving; returns the stream's worker ``(source, dp_rank)``.  Raises
        :class:`~kvevents.errors.ConfigError` for an unknown source or a stream already
        followed."""
        src = next((s for s in self._sources if s.name == source), None)
        if src is None:
            raise ConfigError(f"no source named {source!r}")
        if isinstance(topic, str):
            topic = topic.encode()
        table = self._table
        key = (table.worker_source(source, topic), dp_rank)
        st = table.open(key, src, topic, time.monotonic())
        st.tracker.resume_at(seq, fingerprint)
        replays = self._replays
        if getattr(src, "monitored", False):
            replays.check_on_connect(src, key)
        else:
            req = st.tracker.check_resume()
            if req is not None:
                replays.schedule(key, req)
        return key

    def gauges(self, now: float | None = None) -> dict[str, float]:
        """Current state, for metrics (``now``: wall-clock seconds, default the time now).

        ``workers``: ``(source, dp_rank)`` streams seen (the stale ones are in
        ``stats.stale_workers``); ``replays_in_flight``: replay requests sent and not finished;
        ``replay_lag_batches``: live batches held back behind gaps being replayed;
        ``replay_lag_seconds``: how long the stream held back longest has delivered
        nothing (seconds since its last delivered batch; 0 when no stream is replaying).
        Reads copies of the subscriber's tables, so a scrape thread may call it."""
        now = time.time() if now is None else now
        last = dict(self._outbox.last_delivery)
        streams = list(self._table.streams.items())
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
            "replays_in_flight": self._replays.in_flight,
            "replay_lag_batches": held,
            "replay_lag_seconds": max(lag, 0.0),
        }

    def take(self) -> SubscriberItem | None:
        """The next batch or anomaly already read, or None (a wake-up's reads not yet
        processed are processed up to the next item)."""
        out = self._outbox.items
        if not out and self._wake is not None:
            self._advance()
        return out.popleft() if out else None

    def finished(self) -> bool:
        """Every source is exhausted (capture files read to the end) and nothing is left."""
        for src in self._sources:  # (a loop, not all() over a generator: once a wake-up)
            if not src.exhausted:
                return False
        return self._inband.idle and not self._outbox.items and self._wake is None

    def receiving(
        self, timeout_s: float | None
    ) -> Generator[float | None, Iterable[Source], SubscriberItem | None]:
        """The receive loop, without the wait: returns the next batch or anomaly, or None
        after ``timeout_s`` seconds (None: no limit), after :meth:`close`, or when every
        source is exhausted and nothing is left.

        Until then it yields how long to wait (seconds; None: until input; 0.0: do not
        wait, just let others run) and is sent the sources with input after that wait:
        :meth:`select`'s answer.  Call it when :meth:`take` found nothing.  The one
        receive loop: the blocking subscriber drives it with :meth:`select`, the asyncio
        one with its event loop's wait."""
        out = self._outbox.items
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if not out and self._wake is not None:
                self._advance()
            if out:
                return out.popleft()
            if self._closed or self.finished():
                return None
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                # Read what is already there before giving up.
                ready = yield 0.0
                if self._closed:
                    return None
                self.step(ready, now)
                return self.take()
            ready = yield self.wait_seconds(now, deadline)
            if self._closed:
                return None
            self.step(ready, time.monotonic())

    def select(self, timeout_s: float | None) -> list[Source]:
        """Wait up to ``timeout_s`` seconds (None: until input) for input, and return the
        sources that have some (a source with input already waiting ends the wait at
        once).  Its cost does not grow with the number of sources."""
        return self._waits.select(timeout_s)

    def wait_fd(self) -> int | None:
        """A file descriptor that becomes readable when a source may have input, for an
        event loop to wait on before :meth:`select` with no wait (None where the
        platform's selector has none)."""
        return self._waits.fileno()

    def wait_sockets(self) -> list[Any]:
        """The sockets to wait on for input (readable: call :meth:`step`)."""
        return self._waits.sockets()

    def wait_seconds(self, now: float, deadline: float | None) -> float | None:
        """How long a wait may last (None: until input): until ``deadline``, the next
        replay deadline, redial or liveness check; 0 when a source has input already
        (a file with more to read, a socket whose read stopped at its budget).  ``now``
        and ``deadline`` are ``time.monotonic()`` seconds."""
        waits = self._waits
        if waits.pending or self._wake is not None:
            return 0.0
        wait = None if deadline is None else deadline - now
        # (each timer is asked only when it has something timed: once a wake-up)
        if self._replays.queues:
            wait = _earlier(wait, self._replays.next_deadline_s(now))
        if waits.redialing:
            wait = _earlier(wait, waits.next_redial_s(now))
        liveness = self._liveness
        if liveness.stale_after_s is not None:
            wait = _earlier(wait, liveness.check_at - now)
        return None if wait is None else max(0.0, wait)

    def ready_sources(self, sockets: Iterable[Any]) -> list[Source]:
        """The sources owning ``sockets`` (readable ones from a poll of
        :meth:`wait_sockets`), plus every source with input already waiting."""
        return self._waits.ready(sockets)

    def step(self, ready: Iterable[Source] | None, now: float) -> None:
        """Read what the ``ready`` sources have (None: every source) and process it, then
        enforce replay deadlines and liveness.  ``ready`` is what :meth:`select` or
        :meth:`ready_sources` returned: they also note which connection monitors
        signalled, and a source's monitor is read only then (or with None).  ``now`` is
        ``time.monotonic()``.

        Every ready source is read now, but once a read has yielded an item the later
        reads are held raw: each is decoded and tracked when the items before it have
        been taken (:meth:`take`), so a wake-up over many sources holds their raw
        messages, not their decoded batches.  The deadlines and liveness are enforced
        once the wake-up's last read is processed; until then :meth:`wait_seconds` is 0.
        A call while reads are still held processes them all first."""
        if self._wake is not None:  # (a previous wake-up's reads are processed first)
            self._advance(everything=True)
        batch = self._batch
        reads = self._reads
        out = self._outbox.items
        sources = self._waits.everything() if ready is None else list(ready)
        for src in sources:
            msgs = src.receive(batch)
            if not out:
                self._read(src, msgs, now)
            elif msgs or src.replay_inband:  # (an item is out: hold the rest raw)
                reads.append((src, msgs))
        if reads:
            self._wake = (sources, now)
        else:
            self._duties(sources, now)

    def _advance(self, everything: bool = False) -> None:
        """Process the reads held from the last wake-up, in order, until one yields an
        item (``everything``: until none is left); after the last, run the wake-up's
        duties."""
        wake = self._wake
        if wake is None:
            return
        reads = self._reads
        out = self._outbox.items
        now = wake[1]
        while reads:
            src, msgs = reads.popleft()
            self._read(src, msgs, now)
            if out and reads and not everything:
                return
        self._wake = None
        self._duties(wake[0], now)

    def _duties(self, sources: list[Source], now: float) -> None:
        """After a wake-up's reads of ``sources`` are processed: replay deadlines,
        liveness, source maintenance, and the sockets' state read afresh before the next
        wait."""
        replays = self._replays
        # (each timed duty is called only when it may have something due)
        if replays.queues:
            replays.check_deadlines(now)
        liveness = self._liveness
        if now >= liveness.check_at:
            liveness.check(now)
        waits = self._waits
        maintained = waits.to_maintain()
        for src in maintained:
            src.maintain(now)  # type: ignore[attr-defined]
        # Everything called above: its sockets' state is read afresh before the next wait.
        waits.settle(sources, read=True)
        if replays.touched:
            waits.settle(replays.take_touched())
        if maintained:
            waits.settle(maintained)

    def close(self) -> None:
        """Close every source's sockets (the ZMQ context is left alone, unless the
        subscriber opened one of its own for a large fleet).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._reads.clear()
        self._wake = None
        for src in self._sources:
            try:
                src.close()
            except Exception:  # pragma: no cover - closing must not raise
                logger.exception("error closing %s", src.name)
        self._waits.close()
        if self._own_context is not None:
            self._own_context.destroy(0)

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # --- message routing --------------------------------------------------------------
    def _read(self, src: Source, msgs: list[SourceMessage], now: float) -> None:
        """Every message of one read of ``src``, made at ``now``, in order: the one live
        path, and the other kinds routed by :meth:`_process`.

        A live batch is decoded and fingerprinted, its stream found (the first batch of a
        stream starts it), a silence it ends is checked, the stream is marked heard and
        revived if stale, and the batch is handed to the stream's tracker: the usual
        batch, next in order, is delivered without building actions.  A batch that
        follows one delivered in order on the same stream (same origin, topic and rank)
        in the same read skips the stream's lookup, silence check and marking: they were
        done at this same ``now`` for the batch before.  A capture's record (a source
        with in-band replay) is offered to its in-band replay first, and is never such a
        follower (each record may answer a recorded replay)."""
        replays = self._replays
        if replays.cut_channels:
            replays.new_read()
        name = src.name
        inband = src.replay_inband
        decode = self.decoder.decode
        deliver = self._outbox.deliver
        table = self._table
        run: _Run | None = None
        for msg in msgs:
            if msg.kind != LIVE:
                self._process(src, msg, now)
                run = None
                continue
            payload = msg.payload
            try:
                decoded = decode(payload)
            except DecodeError as exc:
                table.undecodable(msg.origin or name, msg, exc)
                continue
            topic = msg.topic
            rank = decoded.data_parallel_rank or 0
            fp = fingerprint(payload)
            if run is not None and rank == run[2] and topic == run[1] and msg.origin == run[0]:
                key = run[3]
                tracker = run[4]
            else:
                run = None
                st = table.live_stream(src, msg.origin or name, topic, rank, now)
                key = st.key
                tracker = st.tracker
                if inband:
                    item = HeldBatch(topic, payload, decoded, msg.recv_ts, msg.replayed)
                    if self._inband.live(key, tracker, msg, item, fp):
                        continue
                elif self._liveness.resumed_after_silence(st, now):
                    replays.apply(key, tracker.verify())
                st.heard = st.live_at = now
                if st.stale:
                    self._liveness.revive(st)
            seq = msg.seq
            if tracker.live_in_order(seq, fp):  # the usual batch: no actions to build
                deliver(key, seq, decoded, msg.replayed, topic, payload, msg.recv_ts)
                if run is None and not inband:
                    run = (msg.origin, topic, rank, key, tracker)
                continue
            run = None
            item = HeldBatch(topic, payload, decoded, msg.recv_ts, msg.replayed)
            replays.apply(key, tracker.live(seq, item, fp))
        if inband and src.exhausted:
            self._inband.end(src, everything=True)

    def _process(self, src: Source, msg: SourceMessage, now: float) -> None:
        """A message of ``src`` that is not a live batch, read at ``now``."""
        kind = msg.kind
        origin = msg.origin or src.name
        if kind == REPLAY:
            self._replies.reply(src, msg, origin, now)
        elif kind == REPLAY_END:
            if src.replay_inband:
                self._inband.end(src, everything=False, origin=origin)
            else:
                self._replies.end(src, msg, now)
        elif kind == BAD_FRAME:
            self.stats.dropped["bad_frame"] += 1
            self._outbox.log.warning(
                "bad_frame:" + origin, "%s: skipped a malformed message: %s", origin, msg.detail
            )
            self._outbox.emit(Anomaly(BAD_FRAME_KIND, origin, None, None, None, msg.detail))
        elif kind == DISCONNECTED:
            self._replies.disconnected(src)
        elif kind == CONNECTED:
            self._replies.connected(src, now, catch_up=self.options.catch_up)
        elif kind == REPLAY_DISCONNECTED:
            self._replies.replay_disconnected(src, msg.channel, now)
