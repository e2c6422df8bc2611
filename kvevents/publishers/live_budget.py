"""A byte budget on what subscribers can pin in the PUB socket's send queues.

One job: keep the memory a subscriber that stops reading can make the publisher hold
under a number of bytes, per subscriber and over all subscribers.  ZeroMQ bounds a
subscriber's queue only in messages (``ZMQ_SNDHWM``, one queue per connection), so
:class:`LiveBudget` derives that high-water mark from the budget and the batch size it
observes::

    hwm = min(per_subscriber_bytes, total_bytes / subscribers) / bytes_per_batch

where ``bytes_per_batch`` is an estimate of the encoded payload (it rises at once with
bigger batches and falls slowly) plus the topic and seq frames and the three message
headers each queue holds per batch.  ``subscribers`` is the number of matching
subscriptions (:class:`~kvevents.publishers.subscriptions.SubscriptionCounter`): only
those queues receive batches.  The high-water mark is set again when the estimate
drifts by an eighth, when the count changes (a new subscriber is covered before the
next burst: ZeroMQ gives a new connection the mark the socket had when it was bound or
connected, and a change reaches only the connections attached at the time) and once a
second.

A subscriber whose queue is full misses the batches sent meanwhile: it sees a gap in
the seqs and recovers them from the replay service.  Imports pyzmq and the stats.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvevents.publishers.publisher_stats import PublisherStats

__all__ = ["QUEUED_FRAME_BYTES", "LiveBudget"]

QUEUED_FRAME_BYTES = 64
"""What ZeroMQ holds per queued frame besides a shared payload (a ``zmq_msg_t``)."""

_REAPPLY_EVERY_S = 1.0
_DRIFT = 1 / 8


class LiveBudget:
    """Derives and sets the PUB socket's ``SNDHWM`` from a byte budget.

    ``pub`` is the PUB socket.  ``per_subscriber_bytes`` and ``total_bytes`` are the
    budget; ``max_hwm`` the configured high-water mark (messages; 0: none), which the
    derived one never exceeds; ``envelope_bytes`` the topic and seq frames' length.
    Only the sender thread calls the methods.
    """

    def __init__(
        self,
        pub: zmq.Socket[Any],
        stats: PublisherStats,
        *,
        per_subscriber_bytes: int,
        total_bytes: int,
        max_hwm: int,
        envelope_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pub = pub
        self.stats = stats
        self.per_subscriber_bytes = per_subscriber_bytes
        self.total_bytes = total_bytes
        self.max_hwm = max_hwm
        self.overhead_bytes = envelope_bytes + 3 * QUEUED_FRAME_BYTES
        self.clock = clock
        self.subscribers = 0
        """Matching subscriptions now (at least one is assumed)."""
        self.hwm = max_hwm
        """The ``SNDHWM`` last set (messages; 0: unlimited)."""
        self.estimate = 0.0
        """Estimated payload bytes of a batch (0 before the first batch)."""
        self._low = self._high = 0.0
        self._next_reapply = 0.0

    def observe(self, payload_bytes: int) -> None:
        """Account for one batch of ``payload_bytes`` about to be sent."""
        estimate = self.estimate
        if payload_bytes > estimate:
            estimate = float(payload_bytes)
        else:
            estimate += (payload_bytes - estimate) / 64
        self.estimate = estimate
        if estimate > self._high or estimate < self._low:
            self.retune()

    def set_subscribers(self, count: int) -> None:
        """The number of matching subscriptions changed to ``count``."""
        self.subscribers = count
        self.stats.live_subscribers = count
        self.retune(force=True)

    def tick(self) -> None:
        """Set the high-water mark again when a second has passed since the last time."""
        if self.estimate and self.clock() >= self._next_reapply:
            self.retune(force=True)

    def target(self) -> int:
        """The high-water mark the budget allows now (messages, at least 1)."""
        share = min(self.per_subscriber_bytes, self.total_bytes // max(1, self.subscribers))
        hwm = max(1, int(share // (self.estimate + self.overhead_bytes)))
        return min(hwm, self.max_hwm) if self.max_hwm > 0 else hwm

    def retune(self, *, force: bool = False) -> None:
        """Set the derived high-water mark (``force``: even when unchanged)."""
        if not self.estimate:
            return
        hwm = self.target()
        self._low = self.estimate * (1 - _DRIFT)
        self._high = self.estimate * (1 + _DRIFT)
        stats = self.stats
        stats.live_batch_bytes = int(self.estimate)
        stats.live_pinned_bytes_bound = (
            hwm * int(self.estimate + self.overhead_bytes) * max(1, self.subscribers)
        )
        if hwm == self.hwm and not force:
            return
        # Reading the socket's events first makes it attach the connections ZeroMQ
        # has handed over, so the new mark reaches them too.
        with contextlib.suppress(zmq.ZMQError):
            self.pub.getsockopt(zmq.EVENTS)
            self.pub.setsockopt(zmq.SNDHWM, hwm)
            if hwm != self.hwm:
                stats.live_hwm_updates += 1
            self.hwm = hwm
            stats.live_hwm = hwm
        self._next_reapply = self.clock() + _REAPPLY_EVERY_S
