"""``kvevents relay``: follow engines over ZMQ and append their batches to JetStream.

The relay subscribes to every engine (catch-up from the oldest seq each still holds, gap
replay, restart detection: all of :class:`~kvevents.consumers.Subscriber`) and appends
each batch's raw payload bytes, unchanged, to a JetStream stream (created if missing) on
subject ``kvevents.<engine>.<rank>`` with the headers of :mod:`kvevents.jetstream.naming`.

The epoch is stored state, not per process: on start the relay reads the last message of
each of an engine's subjects; when the engine still replays that seq with the same payload
it keeps that epoch and appends only what follows it, otherwise it starts epoch + 1.  A
restart of the publisher seen while relaying bumps the epoch too.  Together with
``Nats-Msg-Id`` this lets a restarted relay, or two relays run for redundancy, append each
batch exactly once, without relying on JetStream's duplicate window alone.  Appends are
acknowledged by JetStream; a batch whose acknowledgement fails (server restarting) is
sent again, in order, until it is stored.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import zmq

from kvevents.codec import pack_replay_request, parse_replay_reply
from kvevents.consumers.subscriber import Anomaly, ReceivedBatch, Subscriber, SubscriberOptions
from kvevents.consumers.zmq_source import ZmqSource
from kvevents.engines import EngineSpec
from kvevents.errors import ConfigError, FrameError
from kvevents.jetstream.connection import NatsLink, connect_jetstream
from kvevents.jetstream.loop import LoopThread
from kvevents.jetstream.naming import (
    DEFAULT_STREAM,
    SUBJECT_PREFIX,
    BatchHeaders,
    subject_for,
)
from kvevents.seqtrack import PUBLISHER_RESTART

__all__ = ["JetStreamRelay", "RelayStats", "ensure_stream"]

logger = logging.getLogger(__name__)


@dataclass
class RelayStats:
    """Counters of a relay: ``appended`` batches acknowledged by JetStream,
    ``duplicates`` acknowledged as already stored, ``skipped`` batches the stream already
    held from an earlier run, ``retries`` appends sent again, ``epochs`` bumped (restarts),
    ``anomalies`` the subscriber reported, by kind."""

    appended: int = 0
    duplicates: int = 0
    skipped: int = 0
    retries: int = 0
    epochs: int = 0
    anomalies: Counter[str] = field(default_factory=Counter)


@dataclass
class _Cursor:
    epoch: int
    skip_through: int | None = None  # seqs <= this are already in the stream (same life)


async def ensure_stream(
    js: Any,
    stream: str,
    *,
    max_age_s: float | None = None,
    max_bytes: int | None = None,
) -> None:
    """Create stream ``stream`` over ``kvevents.>`` if missing; apply the limits given."""
    from nats.js import api
    from nats.js.errors import NotFoundError

    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        await js.add_stream(
            name=stream,
            subjects=[f"{SUBJECT_PREFIX}.>"],
            max_age=max_age_s,
            max_bytes=max_bytes if max_bytes is not None else -1,
            storage=api.StorageType.FILE,
        )
        return
    cfg = info.config
    changed = False
    if max_age_s is not None and cfg.max_age != max_age_s:
        cfg.max_age, changed = max_age_s, True
    if max_bytes is not None and cfg.max_bytes != max_bytes:
        cfg.max_bytes, changed = max_bytes, True
    if changed:
        await js.update_stream(cfg)


class JetStreamRelay:
    """Relay ``engines`` into stream ``stream`` on the NATS server ``nats_url``.

    Call :meth:`run` (blocks until ``stop`` is set or :meth:`close`); ``on_batch`` is
    called after each batch is stored (tests and ``--snapshot-every`` use it).

    ``max_age_s`` / ``max_bytes`` bound a stream the relay creates; ``ack_timeout_s`` is how
    long one append waits for JetStream's acknowledgement before it is sent again;
    ``chunk_batches`` is the most batches appended in one burst; ``verify_timeout_s``
    bounds the replay that checks, on start, whether an engine still holds the stream's
    last batch; ``connect_window_s`` is how long the first connection is tried before
    :class:`ConfigError` (``cannot reach nats://...``); ``subscriber_options`` are the
    settings of the subscriber that follows the engines.  A server lost later is
    reconnected to with backoff (:mod:`kvevents.jetstream.connection`) while the batches
    wait; :meth:`run` returns once ``stop`` is set even then.
    """

    def __init__(
        self,
        nats_url: str,
        engines: Sequence[EngineSpec],
        *,
        stream: str = DEFAULT_STREAM,
        max_age_s: float | None = None,
        max_bytes: int | None = None,
        ack_timeout_s: float = 5.0,
        chunk_batches: int = 256,
        verify_timeout_s: float = 2.0,
        context: zmq.Context[Any] | None = None,
        subscriber_options: SubscriberOptions | None = None,
        connect_window_s: float = 2.0,
    ) -> None:
        if not engines:
            raise ConfigError("the relay needs at least one engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ConfigError(f"engine names must be unique: {names}")
        self.nats_url = nats_url
        self.engines = list(engines)
        self.stream = stream
        self.stats = RelayStats()
        self._ack_timeout_s = ack_timeout_s
        self._chunk_batches = chunk_batches
        self._verify_timeout_s = verify_timeout_s
        self._connect_window_s = connect_window_s
        self._link: NatsLink | None = None
        self._run_stop: threading.Event | None = None
        self._ctx = context if context is not None else zmq.Context.instance()
        self._loop = LoopThread("kvevents-relay")
        self._stop = threading.Event()
        self._cursors: dict[tuple[str, int], _Cursor] = {}
        self._engine_of: dict[str, str] = {}
        self._replay_of: dict[tuple[str, int], str | None] = {}
        try:
            self._nc, self._js = self._loop.run(self._connect(max_age_s, max_bytes), timeout_s=30)
            self._resume()
            sources = []
            for spec in self.engines:
                for rank, events, replay in spec.rank_endpoints():
                    src_name = spec.name if spec.dp_size == 1 else f"{spec.name}@{rank}"
                    self._engine_of[src_name] = spec.name
                    self._replay_of[(spec.name, rank)] = replay
                    sources.append(
                        ZmqSource(
                            events,
                            spec.topic.encode(),
                            replay,
                            name=src_name,
                            context=self._ctx,
                        )
                    )
            self.subscriber = Subscriber(sources, options=subscriber_options)
        except BaseException:
            self._loop.close()
            raise

    async def _connect(self, max_age_s: float | None, max_bytes: int | None) -> tuple[Any, Any]:
        self._link = await connect_jetstream(self.nats_url, self._connect_window_s)
        nc = self._link.nc
        js = nc.jetstream()
        await ensure_stream(js, self.stream, max_age_s=max_age_s, max_bytes=max_bytes)
        return nc, js

    # --- the stored epoch -------------------------------------------------------------
    def _resume(self) -> None:
        """Read each engine's last stored batch per rank and decide its epoch (see module).

        The rank stored is the one on the wire (the global rank, as the spec's
        :attr:`~kvevents.engines.EngineSpec.ranks` name it when ``;rank=`` is given), which
        need not be the spec's: a publisher given with its own endpoints and no ``;rank=``
        (``dp_size`` 1) may still publish as rank 1.
        The replay asked is therefore found by where the batch came from: the spec's
        endpoint for that rank first, then each other endpoint of the engine; the one
        that still holds the stored seq with the same payload proves the same life.
        """
        for spec in self.engines:
            last = self._loop.run(self._last_messages(spec.name), timeout_s=30)
            replays = {r: rep for r, _ev, rep in spec.rank_endpoints() if rep is not None}
            for h, payload in last:
                first = replays.get(h.rank)
                order = [first] if first is not None else []
                order += [rep for rep in replays.values() if rep != first]
                same = any(self._engine_still_has(rep, h.seq, payload) for rep in order)
                if same:
                    self._cursors[(spec.name, h.rank)] = _Cursor(h.epoch, h.seq)
                    logger.info(
                        "%s rank %d: resuming epoch %d after seq %d",
                        spec.name,
                        h.rank,
                        h.epoch,
                        h.seq,
                    )
                else:
                    self._cursors[(spec.name, h.rank)] = _Cursor(h.epoch + 1)
                    self.stats.epochs += 1
                    logger.info("%s rank %d: new epoch %d", spec.name, h.rank, h.epoch + 1)

    async def _last_messages(self, engine: str) -> list[tuple[BatchHeaders, bytes]]:
        from nats.js.errors import NotFoundError

        info = await self._js.stream_info(
            self.stream, subjects_filter=f"{SUBJECT_PREFIX}.{engine}.*"
        )
        out = []
        for subject in sorted(info.state.subjects or {}):
            try:
                msg = await self._js.get_last_msg(self.stream, subject)
            except NotFoundError:
                continue
            try:
                out.append((BatchHeaders.from_nats(msg.headers), bytes(msg.data or b"")))
            except ConfigError as exc:
                logger.warning("ignoring the last message of %s: %s", subject, exc)
        return out

    def _engine_still_has(self, replay_endpoint: str, seq: int, payload: bytes) -> bool:
        """Ask the engine's replay socket for ``seq``: True if it answers with ``payload``."""
        dealer: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(replay_endpoint)
            dealer.send_multipart(pack_replay_request(seq))
            if not dealer.poll(int(self._verify_timeout_s * 1000)):
                return False
            frames = dealer.recv_multipart()
        finally:
            dealer.close(0)
        try:
            reply = parse_replay_reply(frames)
        except FrameError:
            return False
        return not reply.is_end and reply.seq == seq and reply.payload == payload

    # --- relaying ---------------------------------------------------------------------
    def _headers_for(self, rb: ReceivedBatch) -> BatchHeaders | None:
        engine = self._engine_name(rb.source)
        cur = self._cursors.setdefault((engine, rb.dp_rank), _Cursor(0))
        if cur.skip_through is not None:
            if rb.seq <= cur.skip_through:
                self.stats.skipped += 1
                return None
            cur.skip_through = None
        return BatchHeaders(engine, rb.topic, rb.dp_rank, rb.seq, cur.epoch)

    def _engine_name(self, worker_source: str) -> str:
        """The engine a subscriber worker source belongs to (``NAME`` or ``NAME#topic``)."""
        name = worker_source.partition("#")[0]
        return self._engine_of.get(name, name)

    def _on_anomaly(self, a: Anomaly) -> None:
        self.stats.anomalies[a.kind] += 1
        if a.kind == PUBLISHER_RESTART and a.dp_rank is not None:
            engine = self._engine_name(a.source)
            cur = self._cursors.setdefault((engine, a.dp_rank), _Cursor(-1))
            cur.epoch += 1
            cur.skip_through = None
            self.stats.epochs += 1
            logger.info("%s rank %d restarted: epoch %d", engine, a.dp_rank, cur.epoch)
        else:
            logger.info("%s: %s %s..%s %s", a.source, a.kind, a.first_seq, a.last_seq, a.detail)

    def _stopping(self) -> bool:
        return self._stop.is_set() or (self._run_stop is not None and self._run_stop.is_set())

    async def _append(self, msgs: list[tuple[str, bytes, dict[str, str]]]) -> int:
        """Store ``msgs`` in order; resend from the first unacknowledged one until done.
        While the server is away, wait for the connection to return (the link says so
        once).  Returns how many were stored: all, unless the relay was stopped first."""
        start = 0
        while start < len(msgs):
            link = self._link
            if link is not None and not link.is_up and not await link.wait_up(self._stopping):
                break
            futures = []
            try:
                for subject, payload, headers in msgs[start:]:
                    futures.append(await self._js.publish_async(subject, payload, headers=headers))

                for fut in futures:
                    ack = await asyncio.wait_for(fut, self._ack_timeout_s)
                    if getattr(ack, "duplicate", False):
                        self.stats.duplicates += 1
                    else:
                        self.stats.appended += 1

                start = len(msgs)
            except Exception as exc:  # timeouts, a server going away: send the rest again
                for fut in futures:
                    if not fut.done():
                        fut.cancel()
                acked = sum(
                    1 for f in futures if f.done() and not f.cancelled() and f.exception() is None
                )
                # Acks arrive in order for one connection; resend from the first not acked.
                start += acked
                self.stats.retries += 1
                if self._stopping():
                    break
                if self._link is None or self._link.is_up:
                    logger.warning(
                        "JetStream append failed (%s); resending %d",
                        exc or type(exc).__name__,
                        len(msgs) - start,
                    )
                await asyncio.sleep(0.2)
        if start < len(msgs):
            logger.warning(
                "stopped with %d batch(es) not stored; the next relay run appends them",
                len(msgs) - start,
            )
        return start

    def run(
        self,
        stop: threading.Event | None = None,
        on_batch: Callable[[ReceivedBatch], None] | None = None,
    ) -> None:
        """Relay until ``stop`` is set (or :meth:`close` is called)."""
        stop = stop or self._stop
        self._run_stop = stop
        while not stop.is_set() and not self._stop.is_set():
            pending: list[tuple[str, bytes, dict[str, str]]] = []
            done: list[ReceivedBatch] = []
            item = self.subscriber.receive(timeout=0.2)
            while item is not None:
                if isinstance(item, Anomaly):
                    self._on_anomaly(item)
                else:
                    h = self._headers_for(item)
                    if h is not None:
                        pending.append((subject_for(h.source, h.rank), item.payload, h.to_nats()))
                        done.append(item)
                if len(pending) >= self._chunk_batches:
                    break
                item = self.subscriber.receive(timeout=0)
            if pending:
                stored = self._loop.run(self._append(pending))
                if on_batch is not None:
                    for rb in done[:stored]:
                        on_batch(rb)

    def close(self) -> None:
        """Stop relaying, close the subscriber and the NATS connection (idempotent)."""
        if self._stop.is_set() and self._loop.loop.is_closed():
            return
        self._stop.set()
        self.subscriber.close()
        if self._link is not None:
            try:
                self._loop.run(self._link.close(drain=True), timeout_s=5)
            except Exception:
                logger.debug("NATS drain failed", exc_info=True)
        self._loop.close()

    def __enter__(self) -> JetStreamRelay:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def wait_appended(self, n: int, timeout_s: float) -> bool:
        """For tests: wait until ``appended + duplicates + skipped >= n``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.stats
            if s.appended + s.duplicates + s.skipped >= n:
                return True
            time.sleep(0.01)
        return False
