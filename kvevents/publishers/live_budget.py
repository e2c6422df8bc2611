"""A byte budget on what subscribers can pin in the PUB socket's send queues.

One job: decide the PUB socket's high-water mark so that the memory subscribers that
stop reading can make the publisher hold stays under a number of bytes, per subscriber
and over all of them.  ZeroMQ bounds a subscriber's queue only in messages
(``ZMQ_SNDHWM``, one queue per connection), so the mark is derived from the budget and
a batch size::

    mark <= min(per_subscriber_bytes, total_bytes / subscribers) / (batch bytes + overhead)

The socket opens with the mark :func:`budget_hwm` gives for ``batch_bytes_hint`` and
one subscriber (the *base* mark).  The mark is never changed on a live socket: libzmq
pushes a new ``SNDHWM`` to every pipe of the socket, including one whose peer has just
disconnected and is being torn down, and the I/O thread then touches the freed peer (a
crash of the engine process).  Instead, when the mark in use is above what the budget
allows, :class:`LiveBudget` asks the sender to re-create the socket with a smaller mark
(:attr:`LiveBudget.wanted`); its subscribers reconnect by themselves and recover the
batches they missed by replay.

The marks are the base halved ``k`` times (``base >> k``), so the mark falls by a
factor of two at least each time and there are at most ``log2(base)`` re-creations in
a row.  A smaller mark is asked for as soon as the budget is exceeded (the subscriber
count rose, or the batches grew); a larger one only when the budget allows four times
the mark in use and ``grow_after_s`` has passed since the last re-creation, and then
with a factor of two to spare, so the mark cannot swing back and forth.  The batch size
is the mean of blocks of :data:`BLOCK_BATCHES` batches, taken at once when it is
higher than the estimate and followed slowly (an eighth per block) when lower: what a
stalled queue holds is a run of consecutive batches, so a mean, not the largest batch,
is what bounds it.

Subscribers stalled together pin the same messages (ZeroMQ shares one payload between
the queues of all subscribers), so the bound ``subscribers x mark x batch size`` is
cautious; subscribers that stalled at different times hold different batches and can
reach it.  Imports the stats and the rate-limited log.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvevents.publishers.publisher_stats import PublisherStats
from kvevents.ratelimit import RateLimitedLog

__all__ = ["BLOCK_BATCHES", "GROW_AFTER_S", "QUEUED_FRAME_BYTES", "LiveBudget", "budget_hwm"]

QUEUED_FRAME_BYTES = 64
"""What ZeroMQ holds per queued frame besides a shared payload (a ``zmq_msg_t``)."""

BLOCK_BATCHES = 64
"""Batches whose mean size updates the estimate (and when a re-creation is decided)."""

GROW_AFTER_S = 60.0
"""Seconds after a re-creation before the mark may grow again."""


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
    """Decides the mark the budget allows; reports what the mark in use lets queues pin.

    ``hwm`` is the base mark the socket was created with (messages);
    ``per_subscriber_bytes`` and ``total_bytes`` the budget; ``batch_bytes_hint`` the
    batch size assumed until :data:`BLOCK_BATCHES` batches were seen;
    ``envelope_bytes`` the topic and seq frames' length.  ``adaptive=False`` (an
    ``inproc://`` socket, whose peers do not reconnect, or a bound ``ipc://*``, whose
    file the old socket removes) only watches: it never sets :attr:`wanted`.  When the
    mark in use lets one subscriber's queue hold more than ``per_subscriber_bytes``, or
    all of them more than ``total_bytes``, and no re-creation is asked for (watching
    only, or a budget below one batch), it counts ``live_budget_overruns`` and warns,
    once per episode (until neither is exceeded again).  ``clock`` gives seconds
    (monotonic).  Only the sender thread calls the methods.
    """

    def __init__(
        self,
        stats: PublisherStats,
        log: RateLimitedLog,
        *,
        hwm: int,
        per_subscriber_bytes: int,
        total_bytes: int,
        batch_bytes_hint: int,
        envelope_bytes: int,
        adaptive: bool = True,
        grow_after_s: float = GROW_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stats = stats
        self.log = log
        self.base = hwm
        self.hwm = hwm
        """The mark of the socket in use (messages)."""
        self.per_subscriber_bytes = per_subscriber_bytes
        self.total_bytes = total_bytes
        self.hint = batch_bytes_hint
        self.overhead_bytes = envelope_bytes + 3 * QUEUED_FRAME_BYTES
        self.adaptive = adaptive
        self.grow_after_s = grow_after_s
        self.clock = clock
        self.subscribers = 0
        """Matching subscriptions now."""
        self.estimate = 0.0
        """Estimated payload bytes of a batch (0 before the first block of batches)."""
        self.wanted: tuple[int, str] | None = None
        """``(mark, reason)`` when the socket should be re-created with another mark;
        reason ``"subscribers"`` or ``"batch_size"`` (smaller) or ``"grow"``."""
        self._block_bytes = 0
        self._block_batches = 0
        self._changed_at = clock()
        self._batch_at_change = self._batch_bytes()
        self._over = False

    # --- inputs ---------------------------------------------------------------------

    def observe(self, payload_bytes: int) -> None:
        """Account for one batch of ``payload_bytes`` about to be sent."""
        self._block_bytes += payload_bytes
        self._block_batches += 1
        if self._block_batches < BLOCK_BATCHES:
            return
        mean = self._block_bytes / self._block_batches
        self._block_bytes = self._block_batches = 0
        if mean > self.estimate:
            self.estimate = mean
        else:
            self.estimate += (mean - self.estimate) / 8
        self._update()

    def set_subscribers(self, count: int) -> None:
        """The number of matching subscriptions changed to ``count``."""
        self.subscribers = count
        self.stats.live_subscribers = count
        self._update()

    def recreated(self, hwm: int) -> None:
        """The socket was re-created with mark ``hwm`` (it has no subscriber yet)."""
        self.hwm = hwm
        self.wanted = None
        self._changed_at = self.clock()
        self.subscribers = 0
        self.stats.live_subscribers = 0
        self.stats.live_hwm = hwm
        self._batch_at_change = self._batch_bytes()
        self._update()

    # --- the decision ----------------------------------------------------------------

    def _share(self) -> int:
        """The bytes one subscriber may pin now."""
        return min(self.per_subscriber_bytes, self.total_bytes // max(1, self.subscribers))

    def _batch_bytes(self) -> float:
        return (self.estimate or self.hint) + self.overhead_bytes

    def allowed(self) -> int:
        """The largest mark the budget allows now (messages, at least 1)."""
        return max(1, int(self._share() // self._batch_bytes()))

    def _level_at_most(self, limit: int) -> int:
        """The largest ``base >> k`` not above ``limit`` (at least 1)."""
        mark = self.base
        while mark > limit and mark > 1:
            mark >>= 1
        return mark

    def _update(self) -> None:
        stats = self.stats
        stats.live_batch_bytes = int(self.estimate)
        batch = self._batch_bytes()
        per_subscriber = int(self.hwm * batch)
        bound = per_subscriber * max(1, self.subscribers)
        stats.live_pinned_bytes_bound = bound
        if self.adaptive:
            self._decide()
        over_total = bound > self.total_bytes
        over_client = per_subscriber > self.per_subscriber_bytes
        # One episode while either part of the budget is exceeded and no re-creation
        # is coming to fix it: one warning and one count at its start.
        over = (over_total or over_client) and self.wanted is None
        if over and not self._over:
            stats.live_budget_overruns += 1
            if over_total:
                self.log.warning(
                    "live",
                    "subscribers could pin up to %d bytes (%d subscribers x %d batches of "
                    "about %d bytes), above the %d-byte budget",
                    bound,
                    max(1, self.subscribers),
                    self.hwm,
                    int(batch),
                    self.total_bytes,
                )
            else:
                self.log.warning(
                    "live",
                    "one subscriber could pin up to %d bytes (%d batches of about %d "
                    "bytes), above the %d-byte budget per subscriber",
                    per_subscriber,
                    self.hwm,
                    int(batch),
                    self.per_subscriber_bytes,
                )
        self._over = over

    def _decide(self) -> None:
        allowed = self.allowed()
        hwm = self.hwm
        if allowed < hwm:
            # Would the mark in use still fit with the batch size it was chosen for?
            fits = self._share() // self._batch_at_change >= hwm
            reason = "batch_size" if fits else "subscribers"
            self.wanted = (self._level_at_most(allowed), reason)
        elif (
            hwm < self.base
            and allowed >= 4 * hwm
            and self.clock() - self._changed_at >= self.grow_after_s
        ):
            self.wanted = (self._level_at_most(allowed // 2), "grow")
        else:
            self.wanted = None
