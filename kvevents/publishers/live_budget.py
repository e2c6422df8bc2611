"""A byte budget on what subscribers can pin in the PUB socket's send queues.

One job: keep the memory a subscriber that stops reading can make the publisher hold
under a number of bytes.  ZeroMQ bounds a subscriber's queue only in messages
(``ZMQ_SNDHWM``, one queue per connection), so the high-water mark is derived, once,
before the socket binds or connects, from the per-subscriber budget and a batch-size
hint (:func:`budget_hwm`)::

    hwm = min(per_subscriber_bytes, total_bytes) / (batch_bytes_hint + per-batch overhead)

The mark is never changed on a live socket: libzmq pushes a new ``SNDHWM`` to every
pipe of the socket, including one whose peer has just disconnected and is being torn
down, and the I/O thread then touches the freed peer (a crash of the engine process,
seen with subscribers killed while the mark was being re-derived).  So the bound in
bytes holds for batches up to the hint; :class:`LiveBudget` watches the batch size
actually sent and the subscriber count, reports what the queues can pin at most
(``live_pinned_bytes_bound``), and warns (rate-limited) and counts
(``live_budget_overruns``) when that exceeds ``total_bytes``.

Subscribers stalled together pin the same messages (ZeroMQ shares one payload between
the queues of all subscribers), so N subscribers that stopped reading at the same time
hold about one budget, not N.  A subscriber whose queue is full misses the batches sent
meanwhile: it sees a gap in the seqs and recovers them from the replay service.
Imports the stats only.
"""

from __future__ import annotations

from kvevents.publishers.publisher_stats import PublisherStats
from kvevents.ratelimit import RateLimitedLog

__all__ = ["QUEUED_FRAME_BYTES", "LiveBudget", "budget_hwm"]

QUEUED_FRAME_BYTES = 64
"""What ZeroMQ holds per queued frame besides a shared payload (a ``zmq_msg_t``)."""


def budget_hwm(
    *,
    per_subscriber_bytes: int,
    total_bytes: int,
    batch_bytes_hint: int,
    envelope_bytes: int,
    max_hwm: int,
) -> int:
    """The ``SNDHWM`` (messages, at least 1) that keeps one subscriber's queue of batches
    of ``batch_bytes_hint`` payload bytes within ``min(per_subscriber_bytes,
    total_bytes)``; never above ``max_hwm`` (0: no cap)."""
    per_batch = batch_bytes_hint + envelope_bytes + 3 * QUEUED_FRAME_BYTES
    hwm = max(1, min(per_subscriber_bytes, total_bytes) // per_batch)
    return min(hwm, max_hwm) if max_hwm > 0 else hwm


class LiveBudget:
    """Watches what the fixed ``SNDHWM`` lets subscribers pin, in bytes.

    ``hwm`` is the mark the socket was created with (messages); ``total_bytes`` the
    budget over all subscribers; ``envelope_bytes`` the topic and seq frames' length.
    Only the sender thread calls the methods.
    """

    def __init__(
        self,
        stats: PublisherStats,
        log: RateLimitedLog,
        *,
        hwm: int,
        total_bytes: int,
        envelope_bytes: int,
    ) -> None:
        self.stats = stats
        self.log = log
        self.hwm = hwm
        self.total_bytes = total_bytes
        self.overhead_bytes = envelope_bytes + 3 * QUEUED_FRAME_BYTES
        self.subscribers = 0
        """Matching subscriptions now."""
        self.estimate = 0.0
        """Estimated payload bytes of a batch (0 before the first batch)."""
        self._over = False
        stats.live_hwm = hwm

    def observe(self, payload_bytes: int) -> None:
        """Account for one batch of ``payload_bytes`` about to be sent."""
        estimate = self.estimate
        if payload_bytes > estimate:
            estimate = float(payload_bytes)
        else:
            estimate += (payload_bytes - estimate) / 64
        if int(estimate) != int(self.estimate):
            self.estimate = estimate
            self._update()
        else:
            self.estimate = estimate

    def set_subscribers(self, count: int) -> None:
        """The number of matching subscriptions changed to ``count``."""
        self.subscribers = count
        self.stats.live_subscribers = count
        self._update()

    def _update(self) -> None:
        stats = self.stats
        stats.live_batch_bytes = int(self.estimate)
        bound = self.hwm * int(self.estimate + self.overhead_bytes) * max(1, self.subscribers)
        stats.live_pinned_bytes_bound = bound
        over = bound > self.total_bytes
        if over and not self._over:
            stats.live_budget_overruns += 1
            self.log.warning(
                "live",
                "subscribers could pin up to %d bytes (%d subscribers x %d batches of about "
                "%d bytes), above the %d-byte budget: lower live_batch_bytes_hint's "
                "assumption by raising it to the batch size seen",
                bound,
                max(1, self.subscribers),
                self.hwm,
                int(self.estimate),
                self.total_bytes,
            )
        self._over = over
