"""``ZmqEventPublisher``: vLLM's wire protocol, without ever blocking the engine.

What a consumer of vLLM's publisher sees is unchanged (C§2.1–2.2, C§9.4–9.5):

* live messages on a PUB socket, exactly ``[topic, seq, payload]``; ``seq`` is an
  8-byte big-endian unsigned batch counter that starts at 0 for each publisher and
  grows by 1 per ``publish()`` call; ``payload`` is :func:`kvevents.codec.encode_batch`;
* the PUB socket binds when the endpoint contains ``*`` or ``::`` or is ``ipc://`` /
  ``inproc://``, and connects otherwise; its high-water mark is ``hwm``;
* an optional ROUTER replay socket (always bound, SNDHWM ``2 * (buffer_steps + 1)``)
  answers ``[identity, b"", start]`` with every buffered batch whose seq ≥ ``start``
  as ``[identity, b"", topic, seq, payload]``, in order, then the end marker
  ``[identity, b"", b"", ff×8, b""]``.  A request of any other frame count gets no reply and
  is counted in ``stats.malformed_requests``.

Deliberate differences from vLLM 0.33 (C§2.3, C§9.8):

* ``publish()`` never blocks.  It assigns the seq and does a ``put_nowait``; when the
  queue is full the batch is dropped and counted (``dropped_batches``,
  ``dropped_events``, ``drop_reasons["queue_full"]``) with a rate-limited warning.
  Because the seq was consumed, consumers see the loss as a seq gap.
* Replay is served incrementally: each request gets a cursor over a snapshot of the
  buffer, and the sender thread sends at most ``replay_slice`` replies per client
  between bursts of live messages, so a long replay delays live publishing by one slice
  at a time, not its whole length.  Replay sends never block: a client whose queue is
  full is retried later and abandoned after ``replay_stall_timeout_s`` without
  progress; a client that disconnected is dropped (both counted).
* ``shutdown()`` never raises, sends what is queued within ``shutdown_timeout_s`` and
  closes the sockets; the replay socket with linger 0, the PUB socket with a linger of
  whatever remains of that budget so messages already handed to ZeroMQ can still go
  out.  ``publish()`` afterwards raises :class:`~kvevents.errors.PublisherClosedError`.
* A batch that fails to encode or send is lost (its seq consumed, counted, logged at a
  limited rate); the sender does not pause 0.1 s as vLLM's does.

Threading: ``publish()`` may be called from any number of threads; seq order equals
queue order, so batches arrive with strictly increasing seq.  One daemon thread
(``"kvevents-zmq-publisher"``) owns both sockets, encodes, sends and serves replay.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvevents.codec import (
    encode_batch,
    pack_live,
    pack_replay_end,
    pack_replay_reply,
    parse_replay_request,
)
from kvevents.errors import ConfigError, EncodeError, FrameError, PublisherClosedError
from kvevents.events import EventBatch
from kvevents.publishers.config import validate_endpoint
from kvevents.publishers.factory import offset_endpoint

__all__ = [
    "PublisherStats",
    "ZmqEventPublisher",
    "is_bind_endpoint",
]

logger = logging.getLogger(__name__)

_STOP: Any = object()  # queue sentinel put by shutdown()


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's bind-or-connect rule for the PUB socket (C§2.1).

    Bind when the endpoint contains ``*`` or ``::`` or starts with ``ipc://`` or
    ``inproc://``; connect otherwise (``tcp://host:5557`` connects, e.g. to an XSUB).
    """
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


@dataclass
class PublisherStats:
    """Counters of a :class:`ZmqEventPublisher` (all monotonic; units in the names).

    * ``batches_published`` / ``events_published``: handed to the PUB socket.  (PUB
      itself may still drop for a subscriber above its HWM; that is invisible here and
      shows downstream as a seq gap.)
    * ``dropped_batches`` / ``dropped_events``: lost before the PUB socket, by reason in
      ``drop_reasons``: ``queue_full`` (``publish()`` found the queue full),
      ``encode_error``, ``send_error``, ``shutdown`` (still queued when the shutdown
      budget ran out).
    * ``encode_errors`` / ``send_errors``: batches lost to each failure.
    * ``replay_requests``: well-formed requests received; ``replays_completed``: end
      markers sent; ``replay_batches_sent``: replayed batches sent.
    * ``replay_batches_dropped`` by reason in ``replay_drop_reasons``: ``client_gone``
      (disconnected), ``client_stalled`` (no progress for the stall timeout),
      ``shutdown``.  Each counts the replies (batches plus end marker) never sent.
    * ``replay_requests_refused``: well-formed requests refused because
      ``max_pending_replays`` replays were already in progress (no reply sent).
    * ``malformed_requests``: replay requests without exactly 3 frames (no reply sent).
    * ``internal_errors``: unexpected exceptions in the sender thread (logged).
    """

    batches_published: int = 0
    events_published: int = 0
    dropped_batches: int = 0
    dropped_events: int = 0
    drop_reasons: Counter[str] = field(default_factory=Counter)
    encode_errors: int = 0
    send_errors: int = 0
    replay_requests: int = 0
    replays_completed: int = 0
    replay_batches_sent: int = 0
    replay_batches_dropped: int = 0
    replay_drop_reasons: Counter[str] = field(default_factory=Counter)
    replay_requests_refused: int = 0
    malformed_requests: int = 0
    internal_errors: int = 0


class _RateLimitedLog:
    """Log a warning at most once per ``interval_s``, reporting how many were suppressed."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._next = 0.0
        self._suppressed = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        suppressed, self._suppressed = self._suppressed, 0
        self._next = now + self.interval_s
        if suppressed:
            logger.warning(msg + " (%d similar messages suppressed)", *args, suppressed)
        else:
            logger.warning(msg, *args)


@dataclass
class _ReplayCursor:
    """One replay in progress: a snapshot of the buffer and the next index to send."""

    identity: bytes
    snapshot: list[tuple[int, bytes]]
    position: int
    end_sent: bool = False
    stalled_since: float | None = None

    @property
    def remaining(self) -> int:
        """Replies not yet sent, the end marker included."""
        return len(self.snapshot) - self.position + (0 if self.end_sent else 1)


class ZmqEventPublisher:
    """Publish :class:`~kvevents.events.EventBatch` es over ZeroMQ, vLLM-compatibly.

    Parameters mirror :class:`~kvevents.publishers.config.KVEventsConfig` (and vLLM's
    constructor).  Both endpoints are first offset for ``data_parallel_rank`` with
    :func:`~kvevents.publishers.factory.offset_endpoint`.  After construction the
    sockets are bound or connected and :attr:`endpoint` / :attr:`replay_endpoint` hold
    the resolved addresses (the real port when port 0 was asked for).

    Keyword-only tuning (not part of vLLM's config):

    * ``context``: the ZMQ context; default ``zmq.Context.instance()`` (never
      terminated by the publisher).
    * ``shutdown_timeout_s``: how long ``shutdown()`` may spend flushing (seconds).
    * ``replay_slice``: replies sent to one replay client before live work resumes.
    * ``live_burst``: live batches sent before the sender looks at replay again.
    * ``replay_stall_timeout_s``: a replay client that accepts nothing for this long is
      abandoned (seconds).
    * ``max_pending_replays``: replay requests in progress at once; more are refused.
    * ``idle_poll_s``: how long the idle sender waits for a batch before checking the
      replay socket (seconds); bounds the latency of a replay when nothing is published.
    * ``warn_interval_s``: minimum seconds between two warnings of the same kind.
    * ``bind``: bind (True) or connect (False) the PUB socket; default ``None`` follows
      vLLM's rule (:func:`is_bind_endpoint`), under which ``tcp://127.0.0.1:P`` connects.

    Raises :class:`~kvevents.errors.ConfigError` for invalid values or a socket that
    cannot be bound or connected.
    """

    offset_endpoint_port = staticmethod(offset_endpoint)
    """vLLM's name for :func:`~kvevents.publishers.factory.offset_endpoint`."""

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        *,
        context: zmq.Context[Any] | None = None,
        shutdown_timeout_s: float = 1.0,
        replay_slice: int = 64,
        live_burst: int = 64,
        replay_stall_timeout_s: float = 5.0,
        max_pending_replays: int = 256,
        idle_poll_s: float = 0.01,
        warn_interval_s: float = 10.0,
        bind: bool | None = None,
    ) -> None:
        # Reuse the config's validation so both paths give the same messages.
        from kvevents.publishers.config import KVEventsConfig

        KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=endpoint,
            replay_endpoint=replay_endpoint,
            buffer_steps=buffer_steps,
            hwm=hwm,
            max_queue_size=max_queue_size,
            topic=topic,
        )
        if isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, int):
            raise ConfigError(f"data_parallel_rank must be an int, got {data_parallel_rank!r}")
        for name, value in (
            ("replay_slice", replay_slice),
            ("live_burst", live_burst),
            ("max_pending_replays", max_pending_replays),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        for name, seconds in (
            ("shutdown_timeout_s", shutdown_timeout_s),
            ("replay_stall_timeout_s", replay_stall_timeout_s),
            ("idle_poll_s", idle_poll_s),
            ("warn_interval_s", warn_interval_s),
        ):
            if not isinstance(seconds, (int, float)) or seconds < 0:
                raise ConfigError(f"{name} must be a number of seconds >= 0, got {seconds!r}")

        self.data_parallel_rank = data_parallel_rank
        self.requested_endpoint: str = offset_endpoint(endpoint, data_parallel_rank) or endpoint
        self.requested_replay_endpoint = offset_endpoint(replay_endpoint, data_parallel_rank)
        validate_endpoint(self.requested_endpoint, "endpoint")
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.max_queue_size = max_queue_size
        self.topic = topic
        self.shutdown_timeout_s = float(shutdown_timeout_s)
        self.replay_slice = replay_slice
        self.live_burst = live_burst
        self.replay_stall_timeout_s = float(replay_stall_timeout_s)
        self.max_pending_replays = max_pending_replays
        self.idle_poll_s = float(idle_poll_s)
        self.stats = PublisherStats()

        self._topic_frame = topic.encode("utf-8")
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._replays: dict[bytes, deque[_ReplayCursor]] = {}
        self._replays_stalled = False  # no replay client accepted anything last round
        self._lock = threading.Lock()  # seq + enqueue order; drop counters
        self._next_seq = 0
        self._closed = False
        self._closing = threading.Event()
        self._deadline = 0.0
        self._drop_log = _RateLimitedLog(warn_interval_s)
        self._error_log = _RateLimitedLog(warn_interval_s)
        self._request_log = _RateLimitedLog(warn_interval_s)
        # Test hook: a way to stall the sender thread deterministically.
        self._pause_requested = False
        self._paused = threading.Event()
        self._resume = threading.Event()

        self._ctx: zmq.Context[Any] = context if context is not None else zmq.Context.instance()
        self.binds = is_bind_endpoint(self.requested_endpoint) if bind is None else bind
        self._pub: zmq.Socket[Any] = self._ctx.socket(zmq.PUB)
        self._router: zmq.Socket[Any] | None = None
        try:
            self._pub.set_hwm(hwm)
            _enable_ipv6_if_needed(self._pub, self.requested_endpoint)
            self.endpoint = self._attach(
                self._pub, self.requested_endpoint, bind=self.binds, what="PUB"
            )
            self.replay_endpoint: str | None = None
            if self.requested_replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                # Report a full or vanished peer instead of dropping silently.
                self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                _enable_ipv6_if_needed(self._router, self.requested_replay_endpoint)
                self.replay_endpoint = self._attach(
                    self._router, self.requested_replay_endpoint, bind=True, what="replay ROUTER"
                )
        except BaseException:
            self._pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
            raise

        self._thread = threading.Thread(
            target=self._run, name="kvevents-zmq-publisher", daemon=True
        )
        self._thread.start()

    # --- caller side ----------------------------------------------------------------

    def publish(self, batch: EventBatch) -> None:
        """Queue ``batch`` for sending; never blocks.

        Sets ``batch.data_parallel_rank`` to this publisher's rank when it is ``None``
        (as vLLM does; a rank the caller set is kept) and assigns the next seq.  If the queue is full the batch is dropped and counted;
        its seq is still consumed so consumers see a gap.  The caller must not mutate
        ``batch`` afterwards.  Raises :class:`PublisherClosedError` after
        :meth:`shutdown`, and :class:`~kvevents.errors.EncodeError` (a ``TypeError``)
        if ``batch`` is not an :class:`~kvevents.events.EventBatch` (no seq is used).
        """
        if not isinstance(batch, EventBatch):
            raise EncodeError(
                f"publish() takes a KVEventBatch (an EventBatch), got {type(batch).__name__}"
            )
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        with self._lock:
            if self._closed:
                raise PublisherClosedError(
                    f"publish() called after shutdown() on the ZMQ publisher for "
                    f"{self.endpoint}; create a new publisher to publish again"
                )
            seq = self._next_seq
            self._next_seq = seq + 1
            try:
                self._queue.put_nowait((seq, batch))
                return
            except queue.Full:
                self._count_drop("queue_full", len(batch.events))
        self._drop_log.warning(
            "KV event queue full (max_queue_size=%d): dropped batch seq %d; "
            "dropped %d batches so far",
            self.max_queue_size,
            seq,
            self.stats.dropped_batches,
        )

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop publishing: flush within ``timeout_s`` (default ``shutdown_timeout_s``).

        Batches still queued when the budget runs out are counted as dropped
        (``shutdown``); replays in progress are abandoned.  Never raises; idempotent;
        returns within about ``timeout_s`` even if the sender thread is stuck (it then
        closes the sockets itself when it resumes).  Does not terminate the context.
        """
        try:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            budget = self.shutdown_timeout_s if timeout_s is None else max(0.0, timeout_s)
            self._deadline = time.monotonic() + budget
            self._closing.set()
            # On a full queue the thread sees _closing within idle_poll_s instead.
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(_STOP)
            self._thread.join(budget + 0.05)
            if self._thread.is_alive():
                logger.warning(
                    "KV event publisher thread for %s did not stop within %.2f s; "
                    "it will close its sockets when it does",
                    self.endpoint,
                    budget,
                )
        except Exception:  # pragma: no cover - shutdown must never raise
            logger.exception("error while shutting down the KV event publisher")

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` has been called."""
        return self._closed

    @property
    def queue_size(self) -> int:
        """Batches waiting for the sender thread (approximate)."""
        return self._queue.qsize()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (
            f"ZmqEventPublisher(endpoint={self.endpoint!r}, "
            f"replay_endpoint={self.replay_endpoint!r}, rank={self.data_parallel_rank}, "
            f"topic={self.topic!r}, closed={self._closed})"
        )

    # --- helpers ----------------------------------------------------------------------

    def _count_drop(self, reason: str, events: int) -> None:
        """Count one lost batch; the caller holds ``self._lock``."""
        self.stats.dropped_batches += 1
        self.stats.dropped_events += events
        self.stats.drop_reasons[reason] += 1

    def _count_drop_locked(self, reason: str, events: int) -> None:
        with self._lock:
            self._count_drop(reason, events)

    def _attach(self, sock: zmq.Socket[Any], endpoint: str, *, bind: bool, what: str) -> str:
        try:
            if bind:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as exc:
            verb = "bind" if bind else "connect"
            raise ConfigError(f"cannot {verb} the {what} socket to {endpoint!r}: {exc}") from exc
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        resolved = last.decode("utf-8") if isinstance(last, bytes) else str(last)
        return resolved or endpoint

    def _pause_sender(self, timeout_s: float = 5.0) -> None:
        """Test hook: stall the sender thread at the top of its loop; wait until it is."""
        self._resume.clear()
        self._paused.clear()
        self._pause_requested = True
        if not self._paused.wait(timeout_s):
            raise TimeoutError("the publisher thread did not pause")

    def _resume_sender(self) -> None:
        """Test hook: undo :meth:`_pause_sender`."""
        self._pause_requested = False
        self._resume.set()

    # --- sender thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if self._pause_requested:
                    self._paused.set()
                    self._resume.wait()
                try:
                    stop = self._step()
                except Exception:
                    self.stats.internal_errors += 1
                    logger.exception("unexpected error in the KV event publisher thread")
                    stop = self._closing.is_set()
                if stop:
                    break
            self._finish()
        finally:
            self._close_sockets()

    def _step(self) -> bool:
        """One round: a burst of live batches, new replay requests, one replay slice.

        Returns True when the thread should stop.
        """
        closing = self._closing.is_set()
        if closing and time.monotonic() >= self._deadline:
            return True
        # Block for the next batch unless a replay can make progress right now; a
        # replay whose client is full is retried after at most idle_poll_s.
        wait = (not self._replays or self._replays_stalled) and not closing
        timeout = self.idle_poll_s if self._router is not None else max(self.idle_poll_s, 0.1)
        sent = 0
        while sent < self.live_burst:
            try:
                item = (
                    self._queue.get(timeout=timeout)
                    if wait and sent == 0
                    else (self._queue.get_nowait())
                )
            except queue.Empty:
                break
            if item is _STOP:
                return True
            self._send_live(*item)
            sent += 1
        if self._router is not None:
            self._accept_requests()
            if self._replays:
                self._replays_stalled = not self._serve_replays()
        return closing and sent == 0 and self._queue.empty()

    def _send_live(self, seq: int, batch: EventBatch) -> None:
        try:
            payload = encode_batch(batch)
        except EncodeError as exc:
            self.stats.encode_errors += 1
            self._count_drop_locked("encode_error", len(batch.events))
            self._error_log.warning("dropped KV event batch seq %d: %s", seq, exc)
            return
        try:
            self._pub.send_multipart(pack_live(self._topic_frame, seq, payload), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.stats.send_errors += 1
            self._count_drop_locked("send_error", len(batch.events))
            self._error_log.warning("could not send KV event batch seq %d: %s", seq, exc)
            return
        self.stats.batches_published += 1
        self.stats.events_published += len(batch.events)
        self._buffer.append((seq, payload))

    def _accept_requests(self) -> None:
        router = self._router
        assert router is not None
        for _ in range(self.max_pending_replays):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                identity, start = parse_replay_request(frames)
            except FrameError as exc:
                self.stats.malformed_requests += 1
                self._request_log.warning("ignored invalid replay request: %s", exc)
                continue
            self.stats.replay_requests += 1
            pending = sum(len(q) for q in self._replays.values())
            if pending >= self.max_pending_replays:
                self.stats.replay_requests_refused += 1
                self._request_log.warning(
                    "refused a replay request: %d replays already in progress", pending
                )
                continue
            snapshot = list(self._buffer)
            position = bisect.bisect_left(snapshot, start, key=_seq_of)
            cursor = _ReplayCursor(identity, snapshot, position)
            self._replays.setdefault(identity, deque()).append(cursor)

    def _serve_replays(self) -> bool:
        """Send at most ``replay_slice`` replies to each client with a replay pending.

        Returns whether any client accepted a reply (False: every client was full).
        """
        router = self._router
        assert router is not None
        now = time.monotonic()
        progressed = False
        for identity in list(self._replays):
            cursors = self._replays[identity]
            cursor = cursors[0]
            outcome = self._advance(router, cursor)
            if outcome == "progress":
                progressed = True
                cursor.stalled_since = None
            elif outcome == "stalled":
                if cursor.stalled_since is None:
                    cursor.stalled_since = now
                elif now - cursor.stalled_since >= self.replay_stall_timeout_s:
                    # Its later requests would stall behind this one: drop them all.
                    while cursors:
                        self._abandon(cursors.popleft(), "client_stalled")
            elif outcome == "gone":
                progressed = True
                while cursors:
                    self._abandon(cursors.popleft(), "client_gone")
            if cursor.end_sent and cursors and cursors[0] is cursor:
                cursors.popleft()
            if not cursors:
                del self._replays[identity]
        return progressed

    def _advance(self, router: zmq.Socket[Any], cursor: _ReplayCursor) -> str:
        """Send up to one slice for ``cursor``: ``progress``, ``stalled`` or ``gone``."""
        sent = 0
        try:
            while cursor.position < len(cursor.snapshot) and sent < self.replay_slice:
                seq, payload = cursor.snapshot[cursor.position]
                router.send_multipart(
                    pack_replay_reply(cursor.identity, self._topic_frame, seq, payload),
                    zmq.NOBLOCK,
                )
                cursor.position += 1
                sent += 1
                self.stats.replay_batches_sent += 1
            if cursor.position >= len(cursor.snapshot) and sent < self.replay_slice:
                router.send_multipart(pack_replay_end(cursor.identity), zmq.NOBLOCK)
                cursor.end_sent = True
                self.stats.replays_completed += 1
        except zmq.Again:
            return "progress" if sent else "stalled"
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return "gone"
            self.stats.send_errors += 1
            self._error_log.warning("replay send failed: %s", exc)
            return "gone"
        return "progress"

    def _abandon(self, cursor: _ReplayCursor, reason: str) -> None:
        self.stats.replay_batches_dropped += cursor.remaining
        self.stats.replay_drop_reasons[reason] += cursor.remaining
        self._request_log.warning(
            "abandoned a replay (%s) with %d replies unsent", reason, cursor.remaining
        )

    def _finish(self) -> None:
        """After the loop: count what could not be sent in time; drop open replays."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                self._count_drop_locked("shutdown", len(item[1].events))
        for cursors in self._replays.values():
            for cursor in cursors:
                self._abandon(cursor, "shutdown")
        self._replays.clear()

    def _close_sockets(self) -> None:
        remaining_ms = int(max(0.0, self._deadline - time.monotonic()) * 1000)
        try:
            self._pub.close(linger=remaining_ms)
        finally:
            if self._router is not None:
                self._router.close(linger=0)


def _seq_of(entry: tuple[int, bytes]) -> int:
    return entry[0]


def _enable_ipv6_if_needed(sock: zmq.Socket[Any], endpoint: str) -> None:
    if endpoint.startswith("tcp://") and ("[" in endpoint or "::" in endpoint):
        sock.setsockopt(zmq.IPV6, 1)
