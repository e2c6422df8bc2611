"""``ZmqEventPublisher``: vLLM's wire protocol, without ever blocking the engine.

What a consumer of vLLM's publisher sees is unchanged (the live frames and the replay
protocol of vLLM's ``ZmqEventPublisher``):

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

Deliberate differences from vLLM 0.33's ``ZmqEventPublisher`` (its queue and sender thread):

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
* What subscribers that stop reading can pin is bounded in bytes
  (``live_max_client_bytes`` each, ``live_max_bytes_in_flight`` in all): the PUB
  socket's high-water mark is derived from the budget, the subscriber count and the
  batch size, never above ``hwm``; when it must fall, the socket is re-created with
  the smaller mark at the same address (its subscribers reconnect and replay what they
  missed; :mod:`~kvevents.publishers.live_budget`).  The socket is an XPUB (the same
  protocol) so that the sender sees who subscribes.
* In connect mode the batches published before the first subscription arrives are held
  (bounded, counted) and sent once it has, instead of being lost
  (:mod:`~kvevents.publishers.head_hold`).
* The replay ring keeps at most ``replay_max_buffer_bytes`` of payload as well as
  ``buffer_steps`` batches; without a replay endpoint none is kept.
* Optional CURVE security on both sockets (``curve_secret_key_file``, and
  ``curve_authorized_keys_dir`` to accept only listed clients); off by default.
* A batch that fails to encode or send is lost (its seq consumed, counted, logged at a
  limited rate); the sender does not pause 0.1 s as vLLM's does.

Threading: ``publish()`` may be called from any number of threads; seq order equals
queue order, so batches arrive with strictly increasing seq.  One daemon thread
(``"kvevents-zmq-publisher"``) owns both sockets, encodes, sends and serves replay.

This module is the façade: settings, ``publish()``, ``shutdown()`` and the counters.
The rooms behind it: :mod:`~kvevents.publishers.zmq_sockets` (opening and closing the
sockets), :mod:`~kvevents.publishers.zmq_sender` (the sender thread),
:mod:`~kvevents.publishers.replay_service` (the ROUTER replay service),
:mod:`~kvevents.publishers.subscriptions`, :mod:`~kvevents.publishers.live_budget` and
:mod:`~kvevents.publishers.head_hold` (who subscribed, the byte budget, the held head),
:mod:`~kvevents.publishers.delivery` (what ZeroMQ confirmed written, for shutdown) and
:mod:`~kvevents.publishers.publisher_stats` (the counters).  It imports those, the
setting rules and :mod:`kvevents.endpoints`; never the config, registry or factory.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any

import zmq

from kvevents.endpoints import is_bind_endpoint, offset_endpoint, validate_endpoint
from kvevents.errors import ConfigError, EncodeError, PublisherClosedError
from kvevents.events import EventBatch
from kvevents.publishers.delivery import DeliveryMarks
from kvevents.publishers.head_hold import HeadHold
from kvevents.publishers.live_budget import LiveBudget, budget_hwm
from kvevents.publishers.publisher_stats import REFUSAL_REASONS, PublisherStats, count_drop
from kvevents.publishers.replay_service import ReplayService
from kvevents.publishers.settings import validate_publisher_fields, validate_zmq_tuning
from kvevents.publishers.subscriptions import SubscriptionCounter
from kvevents.publishers.zmq_sender import SenderThread
from kvevents.publishers.zmq_sockets import PublisherSockets
from kvevents.ratelimit import RateLimitedLog
from kvevents.security import CurveServerConfig

__all__ = [
    "REFUSAL_REASONS",
    "PublisherStats",
    "ZmqEventPublisher",
    "is_bind_endpoint",
]

logger = logging.getLogger(__name__)

_MiB = 1024 * 1024


class ZmqEventPublisher:
    """Publish :class:`~kvevents.events.EventBatch` es over ZeroMQ, vLLM-compatibly.

    Parameters mirror :class:`~kvevents.publishers.config.KVEventsConfig` (and vLLM's
    constructor).  Both endpoints are first offset for ``data_parallel_rank`` with
    :func:`~kvevents.endpoints.offset_endpoint`.  After construction the
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
    * ``replay_max_buffer_bytes``: payload bytes the replay ring keeps at most (its
      oldest batches go first; one batch at least); ``buffer_steps`` bounds it in batches.
    * ``replay_max_message_bytes``: ``ZMQ_MAXMSGSIZE`` of the ROUTER (bytes per frame).
    * ``max_subscription_bytes``: ``ZMQ_MAXMSGSIZE`` of the PUB socket, which receives
      only subscriptions; a peer sending a bigger frame is dropped by ZeroMQ.
    * ``idle_poll_s``: how long the idle sender waits for a batch before checking the
      replay socket (seconds); bounds the latency of a replay when nothing is published.
    * ``warn_interval_s``: minimum seconds between two warnings of the same kind.
    * ``bind``: bind (True) or connect (False) the PUB socket; default ``None`` follows
      vLLM's rule (:func:`is_bind_endpoint`), under which ``tcp://127.0.0.1:P`` connects.
    * ``live_max_client_bytes``: what one subscriber that stops reading can make the
      publisher hold in its send queue (bytes, default 64 MiB);
      ``live_max_bytes_in_flight``: the same over all subscribers (default 256 MiB).
      The PUB socket opens with the ``SNDHWM`` they allow one subscriber of batches of
      ``live_batch_bytes_hint`` (payload bytes, default 16 KiB), never above ``hwm``;
      when the subscriber count or the batch size seen makes that too much, the socket
      is re-created with half the mark or less (a live change of the mark can crash
      libzmq; :mod:`~kvevents.publishers.live_budget`): every subscriber reconnects
      and recovers the gap by replay.  A subscriber at its budget misses batches (a
      seq gap it recovers by replay).
      ``None`` for both: vLLM's behaviour, ``hwm`` messages per subscriber whatever
      their size.
    * ``hold_until_subscribed``: hold the batches published before the first
      subscription arrives (up to ``live_max_client_bytes`` and ``hwm`` batches; more
      are dropped as ``no_subscriber``) and send them once it has; default ``None``:
      when the PUB socket connects (:mod:`~kvevents.publishers.head_hold`).

    Raises :class:`~kvevents.errors.ConfigError` for invalid values, unreadable CURVE
    keys, or a socket that cannot be bound or connected.
    """

    offset_endpoint_port = staticmethod(offset_endpoint)
    """vLLM's name for :func:`~kvevents.endpoints.offset_endpoint`."""

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
        replay_max_buffer_bytes: int = 256 * _MiB,
        replay_max_message_bytes: int = 4096,
        max_subscription_bytes: int = 4096,
        idle_poll_s: float = 0.01,
        warn_interval_s: float = 10.0,
        bind: bool | None = None,
        live_max_client_bytes: int | None = 64 * _MiB,
        live_max_bytes_in_flight: int | None = 256 * _MiB,
        live_batch_bytes_hint: int = 16 * 1024,
        hold_until_subscribed: bool | None = None,
    ) -> None:
        validate_publisher_fields(
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
        validate_zmq_tuning(
            topic,
            counts={
                "track_every": track_every,
                "replay_slice": replay_slice,
                "live_burst": live_burst,
                "max_pending_replays": max_pending_replays,
                "replay_max_clients": replay_max_clients,
                "replay_max_reply_bytes": replay_max_reply_bytes,
                "replay_max_client_bytes": replay_max_client_bytes,
                "replay_max_bytes_in_flight": replay_max_bytes_in_flight,
                "replay_sndhwm": replay_sndhwm,
                "replay_max_buffer_bytes": replay_max_buffer_bytes,
                "replay_max_message_bytes": replay_max_message_bytes,
                "max_subscription_bytes": max_subscription_bytes,
                "live_batch_bytes_hint": live_batch_bytes_hint,
                **{
                    name: value
                    for name, value in (
                        ("live_max_client_bytes", live_max_client_bytes),
                        ("live_max_bytes_in_flight", live_max_bytes_in_flight),
                    )
                    if value is not None
                },
            },
            seconds={
                "shutdown_timeout_s": shutdown_timeout_s,
                "replay_stall_timeout_s": replay_stall_timeout_s,
                "idle_poll_s": idle_poll_s,
                "warn_interval_s": warn_interval_s,
            },
        )

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
        self.replay_max_buffer_bytes = replay_max_buffer_bytes
        self.replay_max_message_bytes = replay_max_message_bytes
        self.max_subscription_bytes = max_subscription_bytes
        self.idle_poll_s = float(idle_poll_s)
        self.stats = PublisherStats()
        self.curve: CurveServerConfig | None = (
            CurveServerConfig(curve_secret_key_file, curve_authorized_keys_dir)
            if curve_secret_key_file is not None
            else None
        )

        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue_size)
        self._lock = threading.Lock()  # seq + enqueue order; drop counters
        self._next_seq = 0
        self._closed = False
        self._drop_log = RateLimitedLog(logger, warn_interval_s)
        self.binds = is_bind_endpoint(self.requested_endpoint) if bind is None else bind
        if hold_until_subscribed is not None and not isinstance(hold_until_subscribed, bool):
            raise ConfigError(
                f"hold_until_subscribed must be a bool or None, got {hold_until_subscribed!r}"
            )
        self.hold_until_subscribed = (
            not self.binds if hold_until_subscribed is None else hold_until_subscribed
        )
        budgeted = live_max_client_bytes is not None or live_max_bytes_in_flight is not None
        self.live_max_client_bytes = live_max_client_bytes
        self.live_max_bytes_in_flight = live_max_bytes_in_flight
        self.live_batch_bytes_hint = live_batch_bytes_hint
        unlimited = 1 << 62
        live_hwm = hwm
        if budgeted:
            live_hwm = budget_hwm(
                per_subscriber_bytes=live_max_client_bytes or unlimited,
                total_bytes=live_max_bytes_in_flight or unlimited,
                batch_bytes_hint=live_batch_bytes_hint,
                envelope_bytes=len(topic.encode("utf-8")) + 8,
                max_hwm=hwm,
            )
        sockets = PublisherSockets(
            context=context,
            endpoint=self.requested_endpoint,
            replay_endpoint=self.requested_replay_endpoint,
            bind=self.binds,
            hwm_messages=live_hwm,
            max_subscription_bytes=max_subscription_bytes,
            replay_sndhwm_messages=replay_sndhwm,
            replay_max_message_bytes=replay_max_message_bytes,
            curve=self.curve,
        )
        self.endpoint = sockets.endpoint
        self.replay_endpoint: str | None = sockets.replay_endpoint
        topic_frame = topic.encode("utf-8")
        error_log = RateLimitedLog(logger, warn_interval_s)
        # Without a replay socket nobody reads the ring: keep none.
        ring = buffer_steps if sockets.router is not None else 0
        buffer: deque[tuple[int, bytes]] = deque(maxlen=ring)
        self._replay: ReplayService | None = None
        if sockets.router is not None:
            self._replay = ReplayService(
                sockets.router,
                sockets.monitor,
                buffer,
                self.stats,
                topic_frame,
                slice_replies=replay_slice,
                stall_timeout_s=self.replay_stall_timeout_s,
                max_pending=max_pending_replays,
                max_clients=replay_max_clients,
                max_reply_bytes=replay_max_reply_bytes,
                max_client_bytes=replay_max_client_bytes,
                max_bytes_in_flight=replay_max_bytes_in_flight,
                sndhwm_messages=replay_sndhwm,
                request_log=RateLimitedLog(logger, warn_interval_s),
                error_log=error_log,
            )
        self.stats.live_hwm = live_hwm
        budget = None
        if budgeted:
            budget = LiveBudget(
                self.stats,
                RateLimitedLog(logger, warn_interval_s),
                hwm=live_hwm,
                per_subscriber_bytes=live_max_client_bytes or unlimited,
                total_bytes=live_max_bytes_in_flight or unlimited,
                batch_bytes_hint=live_batch_bytes_hint,
                envelope_bytes=len(topic_frame) + 8,
                # Only watch where a re-created socket cannot take the old one's place:
                # inproc peers do not reconnect to it, and a wildcard ipc address's
                # file (and folder) is removed by the old listener as it closes.
                adaptive=not (
                    self.endpoint.startswith("inproc://")
                    or (self.binds and self.requested_endpoint.startswith("ipc://*"))
                ),
            )
        head = None
        if self.hold_until_subscribed:
            head = HeadHold(max_bytes=live_max_client_bytes or 64 * _MiB, max_batches=hwm)
        self._sender = SenderThread(
            sockets=sockets,
            batches=self._queue,
            lock=self._lock,
            stats=self.stats,
            buffer=buffer,
            marks=DeliveryMarks(track_every, hwm, self.stats, self._lock),
            replay=self._replay,
            topic_frame=topic_frame,
            live_burst=live_burst,
            idle_poll_s=self.idle_poll_s,
            error_log=error_log,
            subscriptions=SubscriptionCounter(sockets.pub, topic_frame),
            budget=budget,
            head=head,
            ring_max_bytes=replay_max_buffer_bytes,
        )
        self._thread = self._sender.thread
        self._sender.start()

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
                count_drop(self.stats, "queue_full", len(batch.events))
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
            self._sender.request_stop(budget)
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
        return 0 if self._replay is None else self._replay.inflight_total

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

    # --- views for tests and benchmarks ---------------------------------------------------

    @property
    def _buffer(self) -> deque[tuple[int, bytes]]:  # the replay ring of (seq, payload)
        return self._sender.buffer

    @property
    def _pending(self) -> int:  # replays in progress
        return 0 if self._replay is None else self._replay.pending

    def _pause_sender(self, timeout_s: float = 5.0) -> None:
        """Test hook: stall the sender thread at the top of its loop; wait until it is."""
        self._sender.pause(timeout_s)

    def _resume_sender(self) -> None:
        """Test hook: undo :meth:`_pause_sender`."""
        self._sender.resume()
