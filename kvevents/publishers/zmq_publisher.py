"""``ZmqEventPublisher``: vLLM's wire protocol, without ever blocking the engine.

What a consumer of vLLM's publisher sees is unchanged (C§2.1–2.2, C§9.4–9.5):

* live messages on a PUB socket, exactly ``[topic, seq, payload]``; ``seq`` is an
  8-byte big-endian unsigned batch counter that starts at 0 for each publisher and
  grows by 1 per ``publish()`` call; ``payload`` is :func:`kvevents.codec.encode_batch`;
* the PUB socket binds when the endpoint contains ``*`` or ``::`` or is ``ipc://`` /
  ``inproc://``, and connects otherwise; its high-water mark is ``hwm``;
* an optional ROUTER replay socket (always bound) answers ``[identity, b"", start]``
  with every buffered batch whose seq ≥ ``start`` as ``[identity, b"", topic, seq,
  payload]``, in order, then the end marker ``[identity, b"", b"", ff×8, b""]``.  The
  payload of a replayed seq is byte-for-byte the payload published live under that seq,
  so a subscriber can tell a restarted publisher (whose seq N is another batch) from the
  one it followed by replaying its last applied seq and comparing.

Deliberate differences from vLLM 0.33 (C§2.3, C§9.8):

* ``publish()`` never blocks.  It assigns the seq and does a ``put_nowait``; when the
  queue is full the batch is dropped and counted (``dropped_batches``,
  ``dropped_events``, ``drop_reasons["queue_full"]``) with a rate-limited warning.
  Because the seq was consumed, consumers see the loss as a seq gap.
* The replay service is bounded (each refusal counted with its reason in
  ``stats.replay_refusals``; a refused request gets no reply, as a malformed one does in
  vLLM): the ``start`` frame must be exactly 8 bytes (vLLM reads any length); frames
  above ``replay_max_message_bytes`` make ZeroMQ drop the peer before they are read
  (``ZMQ_MAXMSGSIZE``); at most ``replay_max_clients`` peers are served at once and
  ``max_pending_replays`` requests are pending; one reply holds at most
  ``replay_max_reply_bytes`` of payload (then the end marker: ask again from the next
  seq); bytes handed to ZeroMQ for a peer and not yet taken by its connection are capped
  per peer (``replay_max_client_bytes``) and in total (``replay_max_bytes_in_flight``);
  the ROUTER's per-peer send queue is ``replay_sndhwm`` messages (vLLM:
  ``2 * (buffer_steps + 1)``).
* Replay is served incrementally: each request gets a cursor over a snapshot of the
  buffer, and the sender thread sends at most ``replay_slice`` replies per client
  between bursts of live messages, so a long replay delays live publishing by one slice
  at a time, not its whole length.  Replay sends never block: a client whose queue is
  full is retried later and abandoned after ``replay_stall_timeout_s`` without
  progress; a client that disconnected is dropped (both counted).
* ``shutdown()`` never raises and keeps its budget (``shutdown_timeout_s``): it sends
  what is queued, then waits for ZeroMQ to hand what was sent to the subscribers'
  connections.  A batch still queued, or sent but not confirmed taken by every connected
  subscriber when the budget ends, is counted as dropped (``shutdown`` /
  ``shutdown_unflushed``) and taken out of ``batches_published``: after ``shutdown()``
  returns, ``batches_published`` counts only batches that left the process.  ZeroMQ
  confirms in steps (a tracked frame every ``track_every`` batches and for the last batch
  sent while shutting down; terminating the publisher's own context confirms the rest),
  so when the budget runs out with a subscriber behind, about ``track_every`` batches
  counted as ``shutdown_unflushed`` may still arrive; none counted as published is lost.
  ``publish()`` afterwards raises :class:`~kvevents.errors.PublisherClosedError`.
* Optional CURVE security on both sockets (``curve_secret_key_file``, and
  ``curve_authorized_keys_dir`` to accept only listed clients); off by default.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvevents.codec import (
    encode_batch,
    pack_live,
    pack_replay_end,
    pack_seq,
)
from kvevents.endpoints import enable_ipv6_if_needed, is_bind_endpoint
from kvevents.errors import ConfigError, EncodeError, PublisherClosedError
from kvevents.events import EventBatch
from kvevents.publishers.config import validate_endpoint
from kvevents.publishers.factory import offset_endpoint
from kvevents.ratelimit import RateLimitedLog
from kvevents.security import CurveServerConfig, apply_curve_server

__all__ = [
    "REFUSAL_REASONS",
    "PublisherStats",
    "ZmqEventPublisher",
    "is_bind_endpoint",
]

logger = logging.getLogger(__name__)

_STOP: Any = object()  # queue sentinel put by shutdown()
_MiB = 1024 * 1024

REFUSAL_REASONS = (
    "bad_frame_count",
    "bad_start_frame",
    "too_many_pending",
    "too_many_clients",
    "client_backlog",
    "memory",
)
"""Why a replay request got no reply (keys of ``PublisherStats.replay_refusals``)."""


@dataclass
class PublisherStats:
    """Counters of a :class:`ZmqEventPublisher` (units in the names).

    * ``batches_published`` / ``events_published``: handed to the PUB socket.  (PUB
      itself may still drop for a subscriber above its HWM; that is invisible here and
      shows downstream as a seq gap.)  At ``shutdown()`` the batches ZeroMQ could not
      confirm sent are moved from these counters to ``dropped_*``
      (``shutdown_unflushed``), so after shutdown they count batches that left.
    * ``dropped_batches`` / ``dropped_events``: lost, by reason in ``drop_reasons``:
      ``queue_full`` (``publish()`` found the queue full), ``encode_error``,
      ``send_error``, ``shutdown`` (still queued when the shutdown budget ran out),
      ``shutdown_unflushed`` (sent to ZeroMQ but not confirmed taken by every connected
      subscriber's connection when the budget ran out).
    * ``encode_errors`` / ``send_errors``: batches lost to each failure.
    * ``replay_requests``: well-formed requests received (served or refused for
      capacity); ``replays_completed``: end markers sent; ``replay_batches_sent``:
      replayed batches sent; ``replays_truncated``: replies cut at
      ``replay_max_reply_bytes`` (the end marker follows; the client asks again).
    * ``replay_batches_dropped`` by reason in ``replay_drop_reasons``: ``client_gone``
      (disconnected), ``client_stalled`` (no progress for the stall timeout),
      ``shutdown``.  Each counts the replies (batches plus end marker) never sent.
    * ``replay_refusals``: requests that got no reply, by reason
      (:data:`REFUSAL_REASONS`): ``bad_frame_count`` (not 3 frames), ``bad_start_frame``
      (start not 8 bytes), ``too_many_pending`` (``max_pending_replays`` in progress),
      ``too_many_clients`` (``replay_max_clients`` peers being served),
      ``client_backlog`` (this peer has ``replay_max_client_bytes`` not yet taken),
      ``memory`` (``replay_max_bytes_in_flight`` reached).
      ``malformed_requests`` sums the first two, ``replay_requests_refused`` the rest.
    * ``replay_peer_disconnects``: replay peers whose connection ended, including those
      ZeroMQ dropped for a frame above ``replay_max_message_bytes``.
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
    replays_truncated: int = 0
    replay_batches_dropped: int = 0
    replay_drop_reasons: Counter[str] = field(default_factory=Counter)
    replay_requests_refused: int = 0
    malformed_requests: int = 0
    replay_refusals: Counter[str] = field(default_factory=Counter)
    replay_peer_disconnects: int = 0
    internal_errors: int = 0


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


@dataclass
class _Peer:
    """A replay peer: its pending replays and the bytes ZeroMQ still holds for it.

    ``inflight`` is a FIFO of ``(tracker, bytes, messages)``, one per slice sent: the tracker of a
    slice's last payload is done once ZeroMQ let go of it (written to the peer's
    connection, or the peer is gone), and then so are the earlier ones.
    """

    cursors: deque[_ReplayCursor] = field(default_factory=deque)
    inflight: deque[tuple[Any, int, int]] = field(default_factory=deque)
    inflight_bytes: int = 0
    inflight_messages: int = 0
    carry_bytes: int = 0  # sent untracked (a slice cut short), released with the next
    carry_messages: int = 0


class ZmqEventPublisher:
    """Publish :class:`~kvevents.events.EventBatch` es over ZeroMQ, vLLM-compatibly.

    Parameters mirror :class:`~kvevents.publishers.config.KVEventsConfig` (and vLLM's
    constructor).  Both endpoints are first offset for ``data_parallel_rank`` with
    :func:`~kvevents.publishers.factory.offset_endpoint`.  After construction the
    sockets are bound or connected and :attr:`endpoint` / :attr:`replay_endpoint` hold
    the resolved addresses (the real port when port 0 was asked for).

    CURVE (off by default, as in vLLM): ``curve_secret_key_file`` (the server's
    ``.key_secret`` file) makes both sockets CURVE servers; ``curve_authorized_keys_dir``
    (a directory of client ``.key`` files) further accepts only those clients.  See
    :mod:`kvevents.security`.

    Keyword-only tuning (not part of vLLM's config):

    * ``context``: the ZMQ context.  Default: a context of the publisher's own (so that
      ``shutdown()`` can tell when everything sent has left), or
      ``zmq.Context.instance()`` when an endpoint is ``inproc://`` (inproc peers must
      share the context).  A context passed in is never terminated.
    * ``shutdown_timeout_s``: how long ``shutdown()`` may spend flushing (seconds).
    * ``track_every``: every this many live batches (and the last one before an idle
      spell at shutdown), ZeroMQ is asked to report when it has sent the batch; this is
      how ``shutdown()`` counts what never left.  Lower is more precise and costs more.
    * ``replay_slice``: replies sent to one replay client before live work resumes.
    * ``live_burst``: live batches sent before the sender looks at replay again.
    * ``replay_stall_timeout_s``: a replay client that accepts nothing for this long is
      abandoned (seconds).
    * ``max_pending_replays``: replay requests in progress at once; more are refused.
    * ``replay_max_clients``: peers served at once; requests from others are refused.
    * ``replay_max_reply_bytes``: payload bytes in one reply (at least one batch).
    * ``replay_max_client_bytes``: payload bytes handed to ZeroMQ for one peer and not
      yet written to its connection; sending to that peer pauses above it.
    * ``replay_max_bytes_in_flight``: the same, summed over all peers.
    * ``replay_sndhwm``: the ROUTER's send high-water mark (messages per peer).
    * ``replay_max_message_bytes``: ``ZMQ_MAXMSGSIZE`` of the ROUTER (bytes per frame).
    * ``max_subscription_bytes``: ``ZMQ_MAXMSGSIZE`` of the PUB socket, which receives
      only subscriptions; a peer sending a bigger frame is dropped by ZeroMQ.
    * ``idle_poll_s``: how long the idle sender waits for a batch before checking the
      replay socket (seconds); bounds the latency of a replay when nothing is published.
    * ``warn_interval_s``: minimum seconds between two warnings of the same kind.
    * ``bind``: bind (True) or connect (False) the PUB socket; default ``None`` follows
      vLLM's rule (:func:`is_bind_endpoint`), under which ``tcp://127.0.0.1:P`` connects.

    Raises :class:`~kvevents.errors.ConfigError` for invalid values, unreadable CURVE
    keys, or a socket that cannot be bound or connected.
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
        curve_secret_key_file: str | None = None,
        curve_authorized_keys_dir: str | None = None,
        *,
        context: zmq.Context[Any] | None = None,
        shutdown_timeout_s: float = 1.0,
        track_every: int = 64,
        replay_slice: int = 64,
        live_burst: int = 64,
        replay_stall_timeout_s: float = 5.0,
        max_pending_replays: int = 256,
        replay_max_clients: int = 16,
        replay_max_reply_bytes: int = 32 * _MiB,
        replay_max_client_bytes: int = 8 * _MiB,
        replay_max_bytes_in_flight: int = 64 * _MiB,
        replay_sndhwm: int = 1024,
        replay_max_message_bytes: int = 4096,
        max_subscription_bytes: int = 4096,
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
            curve_secret_key_file=curve_secret_key_file,
            curve_authorized_keys_dir=curve_authorized_keys_dir,
        )
        if isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, int):
            raise ConfigError(f"data_parallel_rank must be an int, got {data_parallel_rank!r}")
        for name, value in (
            ("track_every", track_every),
            ("replay_slice", replay_slice),
            ("live_burst", live_burst),
            ("max_pending_replays", max_pending_replays),
            ("replay_max_clients", replay_max_clients),
            ("replay_max_reply_bytes", replay_max_reply_bytes),
            ("replay_max_client_bytes", replay_max_client_bytes),
            ("replay_max_bytes_in_flight", replay_max_bytes_in_flight),
            ("replay_sndhwm", replay_sndhwm),
            ("replay_max_message_bytes", replay_max_message_bytes),
            ("max_subscription_bytes", max_subscription_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if replay_max_message_bytes < 64:
            raise ConfigError(
                f"replay_max_message_bytes must be >= 64 (a request is 8 bytes plus "
                f"framing), got {replay_max_message_bytes}"
            )
        if max_subscription_bytes <= len(topic.encode("utf-8")):
            raise ConfigError(
                f"max_subscription_bytes must exceed the topic's length (a subscription "
                f"is the topic prefix plus one byte), got {max_subscription_bytes}"
            )
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
        self.track_every = track_every
        self.replay_slice = replay_slice
        self.live_burst = live_burst
        self.replay_stall_timeout_s = float(replay_stall_timeout_s)
        self.max_pending_replays = max_pending_replays
        self.replay_max_clients = replay_max_clients
        self.replay_max_reply_bytes = replay_max_reply_bytes
        self.replay_max_client_bytes = replay_max_client_bytes
        self.replay_max_bytes_in_flight = replay_max_bytes_in_flight
        self.replay_sndhwm = replay_sndhwm
        self.replay_max_message_bytes = replay_max_message_bytes
        self.max_subscription_bytes = max_subscription_bytes
        self.idle_poll_s = float(idle_poll_s)
        self.stats = PublisherStats()
        self.curve: CurveServerConfig | None = (
            CurveServerConfig(curve_secret_key_file, curve_authorized_keys_dir)
            if curve_secret_key_file is not None
            else None
        )
        if self.curve is None and curve_authorized_keys_dir is not None:
            raise ConfigError(
                "curve_authorized_keys_dir needs curve_secret_key_file (the server's "
                ".key_secret file) as well"
            )

        self._topic_frame = topic.encode("utf-8")
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._peers: dict[bytes, _Peer] = {}
        self._pending = 0  # replay cursors over all peers
        self._inflight_total = 0  # replay payload bytes ZeroMQ holds, all peers
        self._replays_stalled = False  # no replay client accepted anything last round
        # Live delivery confirmation: (seq, tracker, batches, events published so far).
        self._marks: deque[tuple[int, Any, int, int]] = deque()
        self._confirmed = (-1, 0, 0)  # newest (seq, batches, events) known sent
        self._since_mark = 0
        self._last_sent_seq = -1
        self._lock = threading.Lock()  # seq + enqueue order; drop counters
        self._next_seq = 0
        self._closed = False
        self._closing = threading.Event()
        self._deadline = 0.0
        self._budget = self.shutdown_timeout_s
        self._drop_log = RateLimitedLog(logger, warn_interval_s)
        self._error_log = RateLimitedLog(logger, warn_interval_s)
        self._request_log = RateLimitedLog(logger, warn_interval_s)
        # Test hook: a way to stall the sender thread deterministically.
        self._pause_requested = False
        self._paused = threading.Event()
        self._resume = threading.Event()

        inproc = self.requested_endpoint.startswith("inproc://") or (
            self.requested_replay_endpoint or ""
        ).startswith("inproc://")
        self._own_ctx = context is None and not inproc
        if context is not None:
            self._ctx: zmq.Context[Any] = context
        elif self._own_ctx:
            self._ctx = zmq.Context(io_threads=1)
        else:
            self._ctx = zmq.Context.instance()
        self.binds = is_bind_endpoint(self.requested_endpoint) if bind is None else bind
        self._releases: list[Callable[[], None]] = []
        self._router: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._pub: zmq.Socket[Any] = self._ctx.socket(zmq.PUB)
        try:
            self._pub.set_hwm(hwm)
            # Subscribers only send subscriptions (a topic prefix): a bigger frame makes
            # ZeroMQ drop that peer before allocating it.
            self._pub.setsockopt(zmq.MAXMSGSIZE, max_subscription_bytes)
            self._releases.append(apply_curve_server(self._pub, self.curve))
            enable_ipv6_if_needed(self._pub, self.requested_endpoint)
            self.endpoint = self._attach(
                self._pub, self.requested_endpoint, bind=self.binds, what="PUB"
            )
            self.replay_endpoint: str | None = None
            if self.requested_replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.SNDHWM, replay_sndhwm)
                self._router.setsockopt(zmq.MAXMSGSIZE, replay_max_message_bytes)
                # Report a full or vanished peer instead of dropping silently.
                self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._releases.append(apply_curve_server(self._router, self.curve))
                enable_ipv6_if_needed(self._router, self.requested_replay_endpoint)
                self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                self.replay_endpoint = self._attach(
                    self._router, self.requested_replay_endpoint, bind=True, what="replay ROUTER"
                )
        except BaseException:
            self._close_all(linger_ms=0)
            raise

        self._thread = threading.Thread(
            target=self._run, name="kvevents-zmq-publisher", daemon=True
        )
        self._thread.start()

    # --- caller side ----------------------------------------------------------------

    def publish(self, batch: EventBatch) -> None:
        """Queue ``batch`` for sending; never blocks.

        Sets ``batch.data_parallel_rank`` to this publisher's rank when it is ``None``
        (as vLLM does; a rank the caller set is kept) and assigns the next seq.  If the
        queue is full the batch is dropped and counted; its seq is still consumed so
        consumers see a gap.  The caller must not mutate ``batch`` afterwards.  Raises
        :class:`PublisherClosedError` after :meth:`shutdown`, and
        :class:`~kvevents.errors.EncodeError` (a ``TypeError``) if ``batch`` is not an
        :class:`~kvevents.events.EventBatch` (no seq is used).
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
            "drop",
            "KV event queue full (max_queue_size=%d): dropped batch seq %d; "
            "dropped %d batches so far",
            self.max_queue_size,
            seq,
            self.stats.dropped_batches,
        )

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop publishing: flush within ``timeout_s`` (default ``shutdown_timeout_s``).

        Sends what is queued, then waits for ZeroMQ to write what was sent to the
        connected subscribers.  What is still queued when the budget runs out is counted
        as dropped (``shutdown``); what was sent but not confirmed written is moved from
        ``batches_published`` to dropped (``shutdown_unflushed``).  Replays in progress
        are abandoned.  Never raises; idempotent; returns within about ``timeout_s`` even
        if the sender thread is stuck (it then closes the sockets itself when it
        resumes).  A context passed in is not terminated.
        """
        try:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            budget = self.shutdown_timeout_s if timeout_s is None else max(0.0, timeout_s)
            self._budget = budget
            self._deadline = time.monotonic() + budget
            self._closing.set()
            # On a full queue the thread sees _closing within idle_poll_s instead.
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(_STOP)
            self._thread.join(budget + 0.25)
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

    @property
    def replay_bytes_in_flight(self) -> int:
        """Replay payload bytes handed to ZeroMQ and not yet written out (all peers)."""
        return self._inflight_total

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

    def _count_drop(self, reason: str, events: int, batches: int = 1) -> None:
        """Count lost batches; the caller holds ``self._lock``."""
        self.stats.dropped_batches += batches
        self.stats.dropped_events += events
        self.stats.drop_reasons[reason] += batches

    def _count_drop_locked(self, reason: str, events: int, batches: int = 1) -> None:
        with self._lock:
            self._count_drop(reason, events, batches)

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
        flushed = False
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
            flushed = self._await_flush()
        finally:
            self._close_all(linger_ms=self._remaining_ms(), flushed=flushed)

    def _flush_deadline(self) -> float:
        """When sending and waiting must stop: the deadline less a linger reserve."""
        return self._deadline - min(0.1, self._budget / 4)

    def _remaining_ms(self) -> int:
        return int(max(0.0, self._deadline - time.monotonic()) * 1000)

    def _step(self) -> bool:
        """One round: a burst of live batches, new replay requests, one replay slice.

        Returns True when the thread should stop.
        """
        closing = self._closing.is_set()
        if closing and time.monotonic() >= self._flush_deadline():
            return True
        # Block for the next batch unless a replay can make progress right now; a
        # replay whose client is full is retried after at most idle_poll_s.
        wait = (not self._pending or self._replays_stalled) and not closing
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
            # While closing, ask ZeroMQ about the last batch (the queue holds at most
            # the stop sentinel after it) so shutdown knows when everything has left.
            track = self._since_mark + 1 >= self.track_every or (
                closing and self._queue.qsize() <= 1
            )
            self._send_live(*item, track=track)
            sent += 1
        if self._router is not None:
            self._accept_requests()
            if self._peers:
                self._replays_stalled = not self._serve_replays()
        return closing and sent == 0 and self._queue.empty()

    def _send_live(self, seq: int, batch: EventBatch, *, track: bool = False) -> None:
        try:
            payload = encode_batch(batch)
        except EncodeError as exc:
            self.stats.encode_errors += 1
            self._count_drop_locked("encode_error", len(batch.events))
            self._error_log.warning("error", "dropped KV event batch seq %d: %s", seq, exc)
            return
        tracker = None
        try:
            if track:
                self._pub.send(self._topic_frame, zmq.SNDMORE | zmq.NOBLOCK)
                self._pub.send(pack_seq(seq), zmq.SNDMORE | zmq.NOBLOCK)
                tracker = self._pub.send(
                    zmq.Frame(payload, track=True, copy=False), zmq.NOBLOCK, copy=False, track=True
                )
            else:
                self._pub.send_multipart(pack_live(self._topic_frame, seq, payload), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.stats.send_errors += 1
            self._count_drop_locked("send_error", len(batch.events))
            self._error_log.warning("error", "could not send KV event batch seq %d: %s", seq, exc)
            return
        self.stats.batches_published += 1
        self.stats.events_published += len(batch.events)
        self._buffer.append((seq, payload))
        self._last_sent_seq = seq
        self._since_mark += 1
        if tracker is not None:
            self._since_mark = 0
            self._marks.append(
                (seq, tracker, self.stats.batches_published, self.stats.events_published)
            )
            self._prune_marks()

    def _prune_marks(self) -> None:
        """Advance the confirmed point over marks ZeroMQ is done with; bound the list."""
        marks = self._marks
        while marks and marks[0][1].done:
            seq, _, batches, events = marks.popleft()
            self._confirmed = (seq, batches, events)
        # A subscriber that never reads holds its oldest marks forever; forgetting them
        # only makes the shutdown count more cautious.
        limit = max(64, self.hwm // self.track_every + 64)
        while len(marks) > limit:
            marks.popleft()

    # --- replay ---------------------------------------------------------------------------

    def _refuse(self, reason: str, detail: str) -> None:
        self.stats.replay_refusals[reason] += 1
        if reason in ("bad_frame_count", "bad_start_frame"):
            self.stats.malformed_requests += 1
        else:
            self.stats.replay_requests_refused += 1
        self._request_log.warning("request", "refused a replay request (%s): %s", reason, detail)

    def _accept_requests(self) -> None:
        router = self._router
        assert router is not None
        self._count_disconnects()
        for _ in range(self.max_pending_replays):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) != 3:
                self._refuse(
                    "bad_frame_count",
                    f"{len(frames)} frames, expected [identity, b'', start]",
                )
                continue
            identity, _delimiter, start_frame = frames
            if len(start_frame) != 8:
                self._refuse(
                    "bad_start_frame",
                    f"start frame of {len(start_frame)} bytes, expected an 8-byte seq",
                )
                continue
            start = int.from_bytes(start_frame, "big")
            self.stats.replay_requests += 1
            peer = self._peers.get(identity)
            serving = sum(1 for p in self._peers.values() if p.cursors)
            if self._pending >= self.max_pending_replays:
                self._refuse("too_many_pending", f"{self._pending} replays in progress")
                continue
            if (peer is None or not peer.cursors) and serving >= self.replay_max_clients:
                self._refuse("too_many_clients", f"{serving} clients being served")
                continue
            if peer is not None and peer.inflight_bytes >= self.replay_max_client_bytes:
                self._refuse(
                    "client_backlog",
                    f"{peer.inflight_bytes} bytes not yet taken by this client",
                )
                continue
            if self._inflight_total >= self.replay_max_bytes_in_flight:
                self._refuse("memory", f"{self._inflight_total} replay bytes in flight")
                continue
            if peer is None:
                peer = self._peers[identity] = _Peer()
            peer.cursors.append(_ReplayCursor(identity, self._snapshot(start), 0))
            self._pending += 1

    def _snapshot(self, start: int) -> list[tuple[int, bytes]]:
        """The buffered batches from ``start`` on, cut at ``replay_max_reply_bytes``."""
        buffer = self._buffer
        if not buffer or start > buffer[-1][0]:
            return []
        # Seqs in the buffer are increasing but may have holes (drops): search by seq.
        entries = list(buffer)
        position = bisect.bisect_left(entries, start, key=_seq_of)
        out: list[tuple[int, bytes]] = []
        total = 0
        for entry in entries[position:]:
            size = len(entry[1])
            if out and total + size > self.replay_max_reply_bytes:
                self.stats.replays_truncated += 1
                break
            out.append(entry)
            total += size
        return out

    def _count_disconnects(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        while True:
            try:
                monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.stats.replay_peer_disconnects += 1

    def _serve_replays(self) -> bool:
        """Send at most ``replay_slice`` replies to each client with a replay pending.

        Returns whether any client accepted a reply (False: every client was full).
        """
        router = self._router
        assert router is not None
        now = time.monotonic()
        progressed = False
        for identity in list(self._peers):
            peer = self._peers[identity]
            self._settle_inflight(peer)
            cursors = peer.cursors
            if cursors:
                cursor = cursors[0]
                outcome = self._advance(router, peer, cursor)
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
                if cursors and cursors[0] is cursor and cursor.end_sent:
                    cursors.popleft()
                    self._pending -= 1
            if not peer.cursors and not peer.inflight and not peer.carry_bytes:
                del self._peers[identity]
        return progressed

    def _settle_inflight(self, peer: _Peer) -> None:
        inflight = peer.inflight
        while inflight and inflight[0][0].done:
            _, size, messages = inflight.popleft()
            peer.inflight_bytes -= size
            peer.inflight_messages -= messages
            self._inflight_total -= size

    def _forget_inflight(self, peer: _Peer) -> None:
        """The peer is gone: ZeroMQ dropped its queue, so nothing is held for it."""
        self._inflight_total -= peer.inflight_bytes
        peer.inflight.clear()
        peer.inflight_bytes = peer.inflight_messages = 0
        peer.carry_bytes = peer.carry_messages = 0

    def _advance(self, router: zmq.Socket[Any], peer: _Peer, cursor: _ReplayCursor) -> str:
        """Send up to one slice for ``cursor``: ``progress``, ``stalled`` or ``gone``.

        Keeps the peer's unconfirmed messages below ``replay_sndhwm`` (so ZeroMQ never
        refuses part of a slice) and its bytes below the per-peer and total caps.  The
        slice's last payload is tracked; when ZeroMQ is done with it, the slice's bytes
        are released.
        """
        snapshot = cursor.snapshot
        room = self.replay_sndhwm - 1 - peer.inflight_messages  # one left for the end marker
        sent = size = 0
        plan: list[tuple[int, bytes]] = []
        while cursor.position + len(plan) < len(snapshot) and len(plan) < min(
            self.replay_slice, room
        ):
            entry = snapshot[cursor.position + len(plan)]
            # Within both caps; a batch larger than a cap goes alone, when nothing is held.
            mine = peer.inflight_bytes + size
            everyone = self._inflight_total + size
            if not (
                (mine + len(entry[1]) <= self.replay_max_client_bytes or mine == 0)
                and (everyone + len(entry[1]) <= self.replay_max_bytes_in_flight or everyone == 0)
            ):
                break
            plan.append(entry)
            size += len(entry[1])
        size = 0
        try:
            for k, (seq, payload) in enumerate(plan):
                router.send_multipart(
                    [cursor.identity, b"", self._topic_frame, pack_seq(seq)],
                    zmq.SNDMORE | zmq.NOBLOCK,
                )
                if k + 1 == len(plan):
                    tracker = router.send(
                        zmq.Frame(payload, track=True, copy=False),
                        zmq.NOBLOCK,
                        copy=False,
                        track=True,
                    )
                    size += len(payload)
                    # Earlier sends cut short are released with this one (FIFO).
                    peer.inflight.append(
                        (tracker, size + peer.carry_bytes, len(plan) + peer.carry_messages)
                    )
                    peer.inflight_bytes += size
                    peer.inflight_messages += len(plan)
                    self._inflight_total += size
                    peer.carry_bytes = peer.carry_messages = 0
                    size = 0
                else:
                    router.send(payload, zmq.NOBLOCK)
                    size += len(payload)
                cursor.position += 1
                sent += 1
                self.stats.replay_batches_sent += 1
            if cursor.position >= len(snapshot) and room - sent >= 0 and not cursor.end_sent:
                router.send_multipart(pack_replay_end(cursor.identity), zmq.NOBLOCK)
                cursor.end_sent = True
                self.stats.replays_completed += 1
        except zmq.Again:
            # Not expected (the peer's queue is kept below its HWM); retried later.  Bytes
            # of untracked sends stay counted until the peer's next tracked one is done.
            if size:
                peer.carry_bytes += size
                peer.carry_messages += sent
                peer.inflight_bytes += size
                peer.inflight_messages += sent
                self._inflight_total += size
            return "progress" if sent else "stalled"
        except zmq.ZMQError as exc:
            self._forget_inflight(peer)
            if exc.errno == zmq.EHOSTUNREACH:
                return "gone"
            self.stats.send_errors += 1
            self._error_log.warning("error", "replay send failed: %s", exc)
            return "gone"
        return "progress" if sent or cursor.end_sent else "stalled"

    def _abandon(self, cursor: _ReplayCursor, reason: str) -> None:
        self._pending -= 1
        self.stats.replay_batches_dropped += cursor.remaining
        self.stats.replay_drop_reasons[reason] += cursor.remaining
        self._request_log.warning(
            "request", "abandoned a replay (%s) with %d replies unsent", reason, cursor.remaining
        )

    # --- shutdown ---------------------------------------------------------------------

    def _finish(self) -> None:
        """After the loop: count what could not be sent in time; drop open replays."""
        batches = events = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                batches += 1
                events += len(item[1].events)
        if batches:
            self._count_drop_locked("shutdown", events, batches)
        for peer in self._peers.values():
            while peer.cursors:
                self._abandon(peer.cursors.popleft(), "shutdown")

    def _await_flush(self) -> bool:
        """Wait (until the flush deadline) for ZeroMQ to write out every batch sent.

        Returns True when the last batch sent is confirmed written; otherwise moves the
        batches after the newest confirmed one from published to dropped
        (``shutdown_unflushed``) and returns False.
        """
        if self.requested_endpoint.startswith("inproc://"):
            return True  # an inproc send lands in the subscriber's own queue
        self._prune_marks()
        if self.stats.batches_published == self._confirmed[1]:
            return True  # nothing sent since the last confirmation
        last = self._marks[-1] if self._marks else None
        if last is not None and last[0] == self._last_sent_seq:
            with contextlib.suppress(zmq.NotDone):
                last[1].wait(max(0.0, self._flush_deadline() - time.monotonic()))
        self._newest_done_mark()
        if self.stats.batches_published == self._confirmed[1]:
            return True
        if self._own_ctx:
            return False  # the context's termination may still prove them written
        self._uncount_unflushed()
        return True

    def _newest_done_mark(self) -> None:
        """Move the confirmed point to the newest mark ZeroMQ is done with (everything
        before it was written too: each subscriber's queue is FIFO)."""
        for mark in reversed(self._marks):
            if mark[1].done:
                if mark[0] > self._confirmed[0]:
                    self._confirmed = (mark[0], mark[2], mark[3])
                return

    def _uncount_unflushed(self) -> None:
        _, batches, events = self._confirmed
        lost_batches = self.stats.batches_published - batches
        lost_events = self.stats.events_published - events
        if lost_batches <= 0:
            return
        self.stats.batches_published = batches
        self.stats.events_published = events
        self._count_drop_locked("shutdown_unflushed", lost_events, lost_batches)
        logger.warning(
            "KV event publisher %s: %d batches sent to ZeroMQ were not written to every "
            "connected subscriber within the shutdown budget; counted as dropped",
            self.endpoint,
            lost_batches,
        )

    def _close_all(self, linger_ms: int, flushed: bool = True) -> None:
        """Close the sockets (PUB with ``linger_ms``) and, if ours, the context.

        ``flushed=False``: batches after the confirmed point may still be in ZeroMQ;
        terminating our own context waits (up to the linger) until they are written,
        and whatever the linger did not cover is counted as unflushed.
        """
        start = time.monotonic()
        try:
            if self._monitor is not None and self._router is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._router.disable_monitor()
                self._monitor.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
            self._pub.close(linger=linger_ms)
        finally:
            for release in self._releases:
                with contextlib.suppress(Exception):
                    release()
            self._releases.clear()
        if not self._own_ctx:
            return
        if flushed or linger_ms == 0:
            self._ctx.term()
            if not flushed:
                self._uncount_unflushed()
            return
        # term() returns once every pipe is empty or the linger expired; before the
        # linger expired means everything sent was written.  Meanwhile keep reading the
        # marks (until just before the linger ends, when ZeroMQ would free the rest).
        terminator = threading.Thread(target=self._ctx.term, name="kvevents-zmq-term")
        terminator.start()
        watch_until = start + linger_ms / 1000 - 0.01
        while terminator.is_alive() and time.monotonic() < watch_until:
            self._newest_done_mark()
            terminator.join(0.002)
        if terminator.is_alive() or time.monotonic() >= watch_until:
            self._uncount_unflushed()
        terminator.join()


def _seq_of(entry: tuple[int, bytes]) -> int:
    return entry[0]
