"""Follow a JetStream stream of KV event batches as a :class:`Subscriber` follows engines.

:class:`AsyncJetStreamSubscriber` (asyncio) and :class:`JetStreamSubscriber` (blocking,
on a private loop thread) read the stream written by :class:`~kvevents.jetstream.JetStreamRelay`
from its start, from a stream sequence, or from a :class:`StreamPosition` stored with an
index snapshot, and yield the same :class:`~kvevents.consumers.ReceivedBatch` and
:class:`~kvevents.consumers.Anomaly` values as the ZMQ subscriber, so an index and a
router do not know which transport fed them.  The anomalies come from the headers
(:mod:`kvevents.jetstream.naming`), per worker ``(engine, rank)``:

* the first batch of a worker with seq > 0: ``history_missed`` (seqs ``0..seq-1``: the
  relay started late or the stream's retention dropped them);
* a higher epoch: ``publisher_restart`` (reset the worker), plus ``history_missed`` if
  the new life does not start at seq 0;
* a seq past the next one in the same epoch: ``unrecoverable_loss`` (the relay lost them;
  reset the worker);
* a seq already delivered, or an older epoch: dropped and counted (``duplicate``, ``late``).

Ordering comes from JetStream (one stream, one ordered consumer), so nothing is reordered.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from kvevents.codec import BatchDecoder
from kvevents.consumers.subscriber import UNDECODABLE, Anomaly, ReceivedBatch
from kvevents.errors import ConfigError, DecodeError, KVEventsError
from kvevents.jetstream.connection import NatsLink, connect_jetstream
from kvevents.jetstream.loop import LoopThread
from kvevents.jetstream.naming import DEFAULT_STREAM, SUBJECT_PREFIX, BatchHeaders
from kvevents.seqtrack import PUBLISHER_RESTART, UNRECOVERABLE_LOSS

__all__ = [
    "HISTORY_MISSED",
    "AsyncJetStreamSubscriber",
    "HeaderTracker",
    "JetStreamStats",
    "JetStreamSubscriber",
    "StreamPosition",
]

logger = logging.getLogger(__name__)

HISTORY_MISSED = "history_missed"
BAD_HEADERS = "bad_headers"

WorkerKey = tuple[str, int]
Item = ReceivedBatch | Anomaly
Mark = tuple[int, "WorkerKey | None", "tuple[int, int] | None"]
"""What handing an item out moves a reader's position to: ``(stream_seq, worker, (epoch, seq))``."""


@dataclass
class StreamPosition:
    """Where a reader stands: the last stream sequence it processed and, per worker
    ``(engine, rank)``, the ``(epoch, seq)`` of the last batch it delivered.

    Stored with an index snapshot, so a reader restored from it resumes at
    ``stream_seq + 1`` knowing what every worker had already applied.
    """

    stream_seq: int = 0
    workers: dict[WorkerKey, tuple[int, int]] = field(default_factory=dict)

    def copy(self) -> StreamPosition:
        return StreamPosition(self.stream_seq, dict(self.workers))

    def advance(self, mark: Mark) -> None:
        """Move to ``mark`` (the position after one handed-out item)."""
        stream_seq, key, value = mark
        self.stream_seq = max(self.stream_seq, stream_seq)
        if key is not None and value is not None:
            self.workers[key] = value

    def to_dict(self) -> dict[str, Any]:
        return {
            "stream_seq": self.stream_seq,
            "workers": [[s, r, e, q] for (s, r), (e, q) in sorted(self.workers.items())],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StreamPosition:
        try:
            workers = {(str(s), int(r)): (int(e), int(q)) for s, r, e, q in data["workers"]}
            return cls(int(data["stream_seq"]), workers)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"bad stream position: {exc}") from exc


@dataclass
class JetStreamStats:
    """Counters of a JetStream reader: ``messages`` read, ``batches``/``events`` delivered,
    ``lost_batches`` reported unrecoverable, ``anomalies`` by kind, ``dropped`` by reason."""

    messages: int = 0
    batches: int = 0
    events: int = 0
    replayed_batches: int = 0  # always 0: a stream has no replay; kept for Subscriber parity
    lost_batches: int = 0
    anomalies: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)


class HeaderTracker:
    """Per-worker ``(epoch, seq)`` bookkeeping; the anomaly rules of the module docstring."""

    def __init__(self, position: StreamPosition | None = None) -> None:
        self.position = position if position is not None else StreamPosition()

    def observe(self, h: BatchHeaders) -> tuple[list[Anomaly], str | None]:
        """The anomalies to report before this batch, and ``None`` to deliver it or the
        reason it is dropped (``"duplicate"``, ``"late"``)."""
        key = (h.source, h.rank)
        cur = self.position.workers.get(key)
        out: list[Anomaly] = []
        if cur is None or h.epoch > cur[0]:
            if cur is not None:
                out.append(
                    Anomaly(
                        PUBLISHER_RESTART,
                        h.source,
                        h.rank,
                        cur[1],
                        h.seq,
                        f"epoch {cur[0]} -> {h.epoch}",
                    )
                )
            if h.seq > 0:
                out.append(
                    Anomaly(
                        HISTORY_MISSED,
                        h.source,
                        h.rank,
                        0,
                        h.seq - 1,
                        f"epoch {h.epoch} starts at seq {h.seq} in the stream",
                    )
                )
        elif h.epoch < cur[0]:
            return out, "late"
        elif h.seq <= cur[1]:
            return out, "duplicate"
        elif h.seq > cur[1] + 1:
            out.append(
                Anomaly(
                    UNRECOVERABLE_LOSS,
                    h.source,
                    h.rank,
                    cur[1] + 1,
                    h.seq - 1,
                    "missing from the stream",
                )
            )
        self.position.workers[key] = (h.epoch, h.seq)
        return out, None


class AsyncJetStreamSubscriber:
    """Read KV event batches from JetStream stream ``stream`` on the NATS server ``url``.

    Start at ``start_seq`` (a stream sequence, 1 = the beginning; default: the stream's
    first message) or right after ``position`` (from a snapshot).  ``subjects`` filters
    (default ``kvevents.>``: every engine).  Use as an async iterator or call
    :meth:`receive`; :meth:`close` when done.  Raises :class:`ConfigError` if the server
    cannot be reached or the stream does not exist.
    """

    def __init__(
        self,
        url: str,
        stream: str = DEFAULT_STREAM,
        *,
        subjects: str = f"{SUBJECT_PREFIX}.>",
        start_seq: int | None = None,
        position: StreamPosition | None = None,
        decoder: BatchDecoder | None = None,
        connect_timeout_s: float = 2.0,
        idle_heartbeat_s: float = 2.0,
    ) -> None:
        if start_seq is not None and position is not None:
            raise ConfigError("give start_seq or position, not both")
        if start_seq is not None and start_seq < 1:
            raise ConfigError(f"start_seq is a stream sequence (>= 1), not {start_seq}")
        self.url = url
        self.stream = stream
        self.subjects = subjects
        self.decoder = decoder if decoder is not None else BatchDecoder()
        self.stats = JetStreamStats()
        self.tracker = HeaderTracker(position.copy() if position is not None else None)
        self._delivered = position.copy() if position is not None else StreamPosition()
        self._start_seq = start_seq if position is None else position.stream_seq + 1
        self._connect_timeout_s = connect_timeout_s
        self._idle_heartbeat_s = idle_heartbeat_s
        self._nc: Any = None
        self._link: NatsLink | None = None
        self._sub: Any = None
        self._out: deque[tuple[Item, Mark]] = deque()

    @property
    def position(self) -> StreamPosition:
        """The position after the last item handed out: store it with a snapshot of an
        index that has applied every item so far (a copy: it moves on)."""
        return self._delivered.copy()

    async def start(self) -> AsyncJetStreamSubscriber:
        """Connect and create the ordered consumer (idempotent)."""
        if self._sub is not None:
            return self
        from nats.js import api
        from nats.js.errors import NotFoundError

        self._link = await connect_jetstream(self.url, self._connect_timeout_s)
        self._nc = self._link.nc
        js = self._nc.jetstream()
        try:
            await js.stream_info(self.stream)
        except NotFoundError:
            await self._link.close()
            raise ConfigError(
                f"no JetStream stream {self.stream!r} at {self.url} (kvevents relay creates it)"
            ) from None
        if self._start_seq is None:
            policy, config = api.DeliverPolicy.ALL, None
        else:
            policy = api.DeliverPolicy.BY_START_SEQUENCE
            config = api.ConsumerConfig(opt_start_seq=self._start_seq)
        self._sub = await js.subscribe(
            self.subjects,
            stream=self.stream,
            ordered_consumer=True,
            deliver_policy=policy,
            config=config,
            idle_heartbeat=self._idle_heartbeat_s,
        )
        return self

    def _handle(self, msg: Any) -> None:
        self.stats.messages += 1
        stream_seq = int(msg.metadata.sequence.stream)
        self.tracker.position.stream_seq = stream_seq
        try:
            h = BatchHeaders.from_nats(msg.headers)
        except ConfigError as exc:
            self.stats.dropped[BAD_HEADERS] += 1
            bad = Anomaly(BAD_HEADERS, self.stream, None, detail=f"#{stream_seq}: {exc}")
            self._report(bad, (stream_seq, None, None))
            return
        anomalies, drop = self.tracker.observe(h)
        mark: Mark = (stream_seq, (h.source, h.rank), (h.epoch, h.seq))
        for a in anomalies:
            self._report(a, mark)
        if drop is not None:
            self.stats.dropped[drop] += 1
            return
        try:
            batch = self.decoder.decode(msg.data)
        except DecodeError as exc:
            self.stats.dropped[UNDECODABLE] += 1
            self._report(Anomaly(UNDECODABLE, h.source, h.rank, h.seq, h.seq, str(exc)), mark)
            return
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self._out.append(
            (
                ReceivedBatch(
                    source=h.source,
                    dp_rank=h.rank,
                    seq=h.seq,
                    batch=batch,
                    replayed=False,
                    topic=h.topic,
                    payload=bytes(msg.data),
                    recv_ts=time.time(),
                ),
                mark,
            )
        )

    def _report(self, a: Anomaly, mark: Mark) -> None:
        self.stats.anomalies[a.kind] += 1
        if a.kind == UNRECOVERABLE_LOSS:
            self.stats.lost_batches += a.seq_count
        self._out.append((a, mark))

    async def receive(self, timeout: float | None = None) -> Item | None:
        """The next batch or anomaly, or ``None`` if nothing arrived within ``timeout`` s."""
        got = await self.next_marked(timeout)
        if got is None:
            return None
        self._delivered.advance(got[1])
        return got[0]

    async def next_marked(self, timeout: float | None = None) -> tuple[Item, Mark] | None:
        """:meth:`receive` with the position mark of the item, for wrappers that hand
        items out later (the blocking :class:`JetStreamSubscriber`)."""
        await self.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._out:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                return None
            try:
                msg = await self._sub.next_msg(timeout=wait if wait is not None else 3600.0)
            except asyncio.TimeoutError:
                continue
            except Exception as exc:
                if type(exc).__name__ == "TimeoutError":
                    continue
                raise
            self._handle(msg)
        return self._out.popleft()

    def __aiter__(self) -> AsyncJetStreamSubscriber:
        return self

    async def __anext__(self) -> Item:
        item = await self.receive()
        if item is None:  # pragma: no cover - receive(None) waits until something arrives
            raise StopAsyncIteration
        return item

    async def close(self) -> None:
        """Unsubscribe and disconnect (idempotent)."""
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # the connection may already be gone
                logger.debug("unsubscribe failed", exc_info=True)
            self._sub = None
        if self._link is not None:
            await self._link.close()
            self._link = None
        self._nc = None

    async def __aenter__(self) -> AsyncJetStreamSubscriber:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class JetStreamSubscriber:
    """The blocking twin of :class:`AsyncJetStreamSubscriber` (same arguments).

    A private loop thread reads the stream; :meth:`receive` and iteration hand out the
    items in order.  Items are buffered up to ``max_buffered`` (the reader then waits, so
    memory stays bounded).
    """

    def __init__(
        self, url: str, stream: str = DEFAULT_STREAM, *, max_buffered: int = 10_000, **kwargs: Any
    ) -> None:
        self._reader = AsyncJetStreamSubscriber(url, stream, **kwargs)
        self._loop = LoopThread("kvevents-jetstream-reader")
        self._queue: queue.Queue[tuple[Item, Mark] | BaseException] = queue.Queue(
            maxsize=max_buffered
        )
        self._position = self._reader.position
        self._stop = threading.Event()
        try:
            self._loop.run(
                self._reader.start(), timeout_s=kwargs.get("connect_timeout_s", 2.0) + 10
            )
        except BaseException:
            self._loop.close()
            raise
        self._task = self._loop.submit(self._pump())
        self._closed = False

    @property
    def stats(self) -> JetStreamStats:
        return self._reader.stats

    @property
    def decoder(self) -> BatchDecoder:
        """The decoder of the payloads (its ``stats`` count what it skipped)."""
        return self._reader.decoder

    @property
    def position(self) -> StreamPosition:
        """The position after the last item handed out (a copy); see
        :attr:`AsyncJetStreamSubscriber.position`."""
        return self._position.copy()

    @property
    def pending(self) -> int:
        """Items read from the stream and not handed out yet."""
        return self._queue.qsize()

    async def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                item = await self._reader.next_marked(timeout=0.2)
                if item is None:
                    continue
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        await asyncio.sleep(0)  # let the loop breathe while the consumer is slow
        except BaseException as exc:  # handed to the consumer thread
            if not self._stop.is_set():
                self._queue.put(exc)

    def receive(self, timeout: float | None = None) -> Item | None:
        """The next item, or ``None`` after ``timeout`` seconds without one."""
        if self._closed:
            return None
        try:
            got = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(got, BaseException):
            if isinstance(got, KVEventsError):
                raise got
            raise ConfigError(f"JetStream reader failed: {got}") from got
        item, mark = got
        self._position.advance(mark)
        return item

    def __iter__(self) -> JetStreamSubscriber:
        return self

    def __next__(self) -> Item:
        while True:
            if self._closed:
                raise StopIteration
            item = self.receive(timeout=0.5)
            if item is not None:
                return item

    def close(self) -> None:
        """Stop reading and disconnect (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        try:
            self._task.result(timeout=5.0)
        except Exception:
            logger.debug("reader task ended with an error", exc_info=True)
        try:
            self._loop.run(self._reader.close(), timeout_s=5.0)
        except Exception:
            logger.debug("close failed", exc_info=True)
        self._loop.close()

    def __enter__(self) -> JetStreamSubscriber:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
