"""The publisher's sender thread: encodes and sends live batches, drives replay, flushes.

One job: the loop of the one daemon thread (``"kvevents-zmq-publisher"``) that owns a
publisher's sockets.  Each round sends a burst of up to ``live_burst`` queued batches,
then takes new replay requests and sends one replay slice
(:class:`~kvevents.publishers.replay_service.ReplayService`); when the live byte budget
(:class:`~kvevents.publishers.live_budget.LiveBudget`) wants another high-water mark,
it re-creates the PUB socket with it.  On stop it counts what is
still queued as dropped, waits (within the shutdown budget) for ZeroMQ to confirm the
last batch written (:class:`~kvevents.publishers.delivery.DeliveryMarks`), and closes the
sockets.  Imports the codec, the stats, the replay service, the delivery marks and the
sockets; the facade (:mod:`~kvevents.publishers.zmq_publisher`) imports it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import zmq

from kvevents.codec import encode_batch, pack_seq
from kvevents.errors import ConfigError, EncodeError
from kvevents.events import EventBatch
from kvevents.publishers.delivery import DeliveryMarks
from kvevents.publishers.head_hold import HeadHold
from kvevents.publishers.live_budget import LiveBudget
from kvevents.publishers.publisher_stats import PublisherStats, count_drop
from kvevents.publishers.replay_service import ReplayService
from kvevents.publishers.subscriptions import SubscriptionCounter
from kvevents.publishers.zmq_sockets import PublisherSockets
from kvevents.ratelimit import RateLimitedLog

__all__ = ["STOP", "SenderThread"]

_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)

# The publisher's one logger, whichever room writes.
logger = logging.getLogger("kvevents.publishers.zmq_publisher")

STOP: Any = object()
"""The queue item :meth:`SenderThread.request_stop` puts after the last batch."""


class SenderThread:
    """The sender loop over ``batches`` (a queue of ``(seq, batch)`` and :data:`STOP`).

    ``lock`` guards the drop counters of ``stats`` (shared with ``publish()`` callers).
    ``buffer`` is the replay ring the loop appends ``(seq, payload)`` to; ``replay`` the
    replay service (``None`` without a replay endpoint).  ``live_burst`` (batches) bounds
    one burst; ``idle_poll_s`` (seconds) how long an idle loop waits for a batch before
    looking at the replay socket.  :meth:`start` starts the thread;
    :meth:`request_stop` asks it to flush and stop within a budget.
    """

    def __init__(
        self,
        *,
        sockets: PublisherSockets,
        batches: queue.Queue[Any],
        lock: threading.Lock,
        stats: PublisherStats,
        buffer: deque[tuple[int, bytes]],
        marks: DeliveryMarks,
        replay: ReplayService | None,
        topic_frame: bytes,
        live_burst: int,
        idle_poll_s: float,
        error_log: RateLimitedLog,
        subscriptions: SubscriptionCounter,
        budget: LiveBudget | None = None,
        head: HeadHold | None = None,
        ring_max_bytes: int = 1 << 62,
    ) -> None:
        self.sockets = sockets
        self.batches = batches
        self.lock = lock
        self.stats = stats
        self.buffer = buffer
        self.marks = marks
        self.replay = replay
        self.topic_frame = topic_frame
        self.live_burst = live_burst
        self.idle_poll_s = idle_poll_s
        self.error_log = error_log
        self.subscriptions = subscriptions
        self.ring_max_bytes = ring_max_bytes
        self.ring_bytes = 0
        """Payload bytes in the replay ring."""
        self.budget = budget
        self.recreated_at = 0.0
        """``time.monotonic()`` of the last re-creation of the PUB socket."""
        self.head = head
        self.closing = threading.Event()
        """Set by :meth:`request_stop`: flush, then stop."""
        self.deadline = 0.0
        """``time.monotonic()`` by which the thread must have closed its sockets."""
        self.budget_s = 0.0
        """The shutdown budget the deadline was set from (seconds)."""
        # A way to stall the loop deterministically (tests, benchmarks).
        self._pause_requested = False
        self._paused = threading.Event()
        self._resume = threading.Event()
        self.thread = threading.Thread(target=self.run, name="kvevents-zmq-publisher", daemon=True)

    # --- control (caller threads) -------------------------------------------------------

    def start(self) -> None:
        """Start the thread."""
        self.thread.start()

    def request_stop(self, budget_s: float) -> None:
        """Ask the loop to send what is queued and close within ``budget_s`` seconds."""
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s
        self.closing.set()
        # On a full queue the thread sees ``closing`` within idle_poll_s instead.
        try:
            self.batches.put_nowait(STOP)
        except queue.Full:
            pass

    def pause(self, timeout_s: float = 5.0) -> None:
        """Stall the loop at the top of its next round; wait until it is stalled.

        Raises ``TimeoutError`` if it does not stall within ``timeout_s``.
        """
        self._resume.clear()
        self._paused.clear()
        self._pause_requested = True
        if not self._paused.wait(timeout_s):
            raise TimeoutError("the publisher thread did not pause")

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        self._pause_requested = False
        self._resume.set()

    # --- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        """The thread's body: rounds until stopped, then count, flush and close."""
        flushed = False
        try:
            while True:
                if self._pause_requested:
                    self._paused.set()
                    self._resume.wait()
                try:
                    stop = self.step()
                except Exception:
                    self.stats.internal_errors += 1
                    logger.exception("unexpected error in the KV event publisher thread")
                    stop = self.closing.is_set()
                if stop:
                    break
            self._finish()
            flushed = self._await_flush()
        finally:
            self._close(linger_ms=self._remaining_ms(), flushed=flushed)

    def _flush_deadline(self) -> float:
        """When sending and waiting must stop: the deadline less a linger reserve."""
        return self.deadline - min(0.1, self.budget_s / 4)

    def _remaining_ms(self) -> int:
        return int(max(0.0, self.deadline - time.monotonic()) * 1000)

    def step(self) -> bool:
        """One round: a burst of live batches, new replay requests, one replay slice.

        Returns True when the thread should stop.
        """
        closing = self.closing.is_set()
        if closing and time.monotonic() >= self._flush_deadline():
            return True
        budget = self.budget
        head = self.head
        subscriptions = self.subscriptions
        if subscriptions.read():
            if budget is not None:
                budget.set_subscribers(subscriptions.count)
            if head is not None and not head.subscribed:
                head.subscribed = True
                self._release_head(head)
        if budget is not None:
            self._keep_budget(budget)
        replay = self.replay
        # Block for the next batch unless a replay can make progress right now; a
        # replay whose client is full is retried after at most idle_poll_s.
        holding = head is not None and bool(head.held)
        wait = (replay is None or not replay.pending or replay.stalled) and (not closing or holding)
        timeout = (
            self.idle_poll_s
            if replay is not None or (head is not None and not head.subscribed)
            else max(self.idle_poll_s, 0.1)
        )
        batches = self.batches
        marks = self.marks
        track_every = marks.track_every
        sent = 0
        while sent < self.live_burst:
            try:
                item = batches.get(timeout=timeout) if wait and sent == 0 else batches.get_nowait()
            except queue.Empty:
                break
            if item is STOP:
                if holding:
                    break  # wait for the collector until the flush deadline
                return True
            # While closing, ask ZeroMQ about the last batch (the queue holds at most
            # the stop sentinel after it) so shutdown knows when everything has left.
            track = marks.since_mark + 1 >= track_every or (closing and batches.qsize() <= 1)
            self._send_live(*item, track=track)
            sent += 1
        if budget is not None and sent:
            self._keep_budget(budget)
        if replay is not None:
            replay.accept_requests()
            if replay.peers:
                replay.serve()
        if head is not None and head.held:
            return False  # held until the collector subscribes or the budget ends
        return closing and sent == 0 and batches.empty()

    def _keep_budget(self, budget: LiveBudget) -> None:
        """Re-create the PUB socket when the budget wants another mark; bind a
        re-created one whose address was still busy."""
        sockets = self.sockets
        # Not while closing: the old socket's queues (the last batches, which shutdown
        # waits to see written) would be dropped for a mark nobody uses any more.
        if budget.wanted is not None and not self.closing.is_set():
            self._recreate(budget, *budget.wanted)
        if (
            sockets.attach_pending
            and not sockets.retry_attach()
            and time.monotonic() - self.recreated_at > 1.0
        ):
            # The old listener usually lets go of the address within a millisecond.
            self.error_log.warning(
                "rebind",
                "KV event publisher: %s is still busy; binding the re-created PUB socket "
                "again in the next round",
                sockets.endpoint,
            )

    def _recreate(self, budget: LiveBudget, hwm: int, reason: str) -> None:
        """Replace the PUB socket by one with ``SNDHWM`` ``hwm`` (never set on a socket
        with peers: libzmq would push it to pipes being torn down).  Its subscribers
        reconnect by themselves and recover what they missed by replay; in connect mode
        the head is held again until the collector's subscription arrives."""
        sockets = self.sockets
        old, subscribers = sockets.hwm_messages, budget.subscribers
        try:
            sockets.reopen_pub(hwm)
        except (ConfigError, zmq.ZMQError) as exc:  # the old socket is kept
            budget.wanted = None  # asked again at the next block of batches
            self.error_log.warning(
                "recreate", "KV event publisher: cannot re-create the PUB socket: %s", exc
            )
            return
        self.recreated_at = time.monotonic()
        self.subscriptions = SubscriptionCounter(sockets.pub, self.topic_frame)
        budget.recreated(hwm)
        stats = self.stats
        stats.live_recreations += 1
        stats.live_recreation_reasons[reason] += 1
        if self.head is not None:
            self.head.subscribed = False
        logger.warning(
            "KV event publisher %s: re-created the PUB socket with a high-water mark of %d "
            "batches (was %d; %s: %d subscribers, batches of about %d bytes, budget %d "
            "bytes each and %d in all); its subscribers reconnect and recover by replay",
            sockets.endpoint,
            hwm,
            old,
            reason,
            subscribers,
            int(budget.estimate or budget.hint),
            budget.per_subscriber_bytes,
            budget.total_bytes,
        )

    def _release_head(self, head: HeadHold) -> None:
        """Send the batches held until the first subscription, in seq order."""
        held = head.release()
        for i, (seq, payload, events) in enumerate(held):
            self._send_payload(seq, payload, events, track=i == len(held) - 1)

    def _send_live(self, seq: int, batch: EventBatch, *, track: bool = False) -> None:
        try:
            payload = encode_batch(batch)
        except EncodeError as exc:
            self.stats.encode_errors += 1
            with self.lock:
                count_drop(self.stats, "encode_error", len(batch.events))
            self.error_log.warning("error", "dropped KV event batch seq %d: %s", seq, exc)
            return
        head = self.head
        if head is not None and not head.subscribed:
            if head.hold(seq, payload, len(batch.events)):
                self.stats.head_batches_held += 1
            else:
                with self.lock:
                    count_drop(self.stats, "no_subscriber", len(batch.events))
                self.error_log.warning(
                    "drop",
                    "no subscriber yet: dropped KV event batch seq %d (%d bytes held)",
                    seq,
                    head.held_bytes,
                )
            return
        self._send_payload(seq, payload, len(batch.events), track=track)

    def _send_payload(self, seq: int, payload: bytes, events: int, *, track: bool) -> None:
        if self.budget is not None:
            self.budget.observe(len(payload))
        pub = self.sockets.pub
        tracker = None
        try:
            # The three frames sent one by one with int flags: what ``send_multipart``
            # does, without its per-frame checks and enum arithmetic.
            pub.send(self.topic_frame, _MORE)
            pub.send(pack_seq(seq), _MORE)
            if track:
                tracker = pub.send(
                    zmq.Frame(payload, track=True, copy=False), _LAST, copy=False, track=True
                )
            else:
                pub.send(payload, _LAST)
        except zmq.ZMQError as exc:
            self.stats.send_errors += 1
            with self.lock:
                count_drop(self.stats, "send_error", events)
            self.error_log.warning("error", "could not send KV event batch seq %d: %s", seq, exc)
            return
        stats = self.stats
        stats.batches_published += 1
        stats.events_published += events
        if self.buffer.maxlen:
            self._remember(seq, payload)
        self.marks.sent(seq, tracker)

    def _remember(self, seq: int, payload: bytes) -> None:
        """Append to the replay ring; keep it within ``ring_max_bytes`` (one batch at least)."""
        buffer = self.buffer
        ring_bytes = self.ring_bytes
        if len(buffer) == buffer.maxlen:
            ring_bytes -= len(buffer[0][1])  # the append below evicts it
        buffer.append((seq, payload))
        ring_bytes += len(payload)
        while ring_bytes > self.ring_max_bytes and len(buffer) > 1:
            ring_bytes -= len(buffer.popleft()[1])
        self.ring_bytes = ring_bytes
        self.stats.replay_buffer_bytes = ring_bytes

    # --- stopping ----------------------------------------------------------------------

    def _finish(self) -> None:
        """After the loop: count what could not be sent in time; drop open replays."""
        batches = events = 0
        while True:
            try:
                item = self.batches.get_nowait()
            except queue.Empty:
                break
            if item is not STOP:
                batches += 1
                events += len(item[1].events)
        if self.head is not None:
            for _, _, held_events in self.head.release():
                batches += 1
                events += held_events
        if batches:
            with self.lock:
                count_drop(self.stats, "shutdown", events, batches)
        if self.replay is not None:
            self.replay.abandon_all("shutdown")

    def _await_flush(self) -> bool:
        """Wait (until the flush deadline) for ZeroMQ to write out every batch sent.

        Returns True when the last batch sent is confirmed written, or when what is not
        confirmed has been moved from published to dropped (``shutdown_unflushed``);
        False when our own context's termination may still prove it written.
        """
        if self.sockets.endpoint.startswith("inproc://"):
            return True  # an inproc send lands in the subscriber's own queue
        if self.marks.wait_for_last(self._flush_deadline() - time.monotonic()):
            return True
        if self.sockets.own_context:
            return False  # the context's termination may still prove them written
        self.marks.uncount_unflushed(self.sockets.endpoint)
        return True

    def _close(self, linger_ms: int, flushed: bool = True) -> None:
        """Close the sockets (PUB with ``linger_ms``) and, if ours, the context.

        ``flushed=False``: batches after the confirmed point may still be in ZeroMQ;
        terminating our own context waits (up to the linger) until they are written,
        and whatever the linger did not cover is counted as unflushed.
        """
        start = time.monotonic()
        sockets = self.sockets
        sockets.close(linger_ms)
        if not sockets.own_context:
            return
        if flushed or linger_ms == 0:
            sockets.context.term()
            if not flushed:
                self.marks.uncount_unflushed(sockets.endpoint)
            return
        watch_until = start + linger_ms / 1000 - 0.01
        if not self.marks.watch_termination(sockets.context.term, watch_until, time.monotonic):
            self.marks.uncount_unflushed(sockets.endpoint)
