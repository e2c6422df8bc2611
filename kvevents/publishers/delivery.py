"""What the publisher knows ZeroMQ has written out: delivery marks for an honest shutdown.

One job: every ``track_every`` live batches (and for the last batch sent while shutting
down) the sender asks ZeroMQ for a tracker of the payload frame and records a mark
``(seq, tracker, batches published, events published)``.  A tracker is done once ZeroMQ
let go of the frame: written to every connected subscriber's connection (each queue is
FIFO, so everything sent before it was written too).  :class:`DeliveryMarks` keeps those
marks, moves the confirmed point forward, waits for the last one at shutdown and, when
the budget ends first, moves what is not confirmed from published to dropped
(``shutdown_unflushed``).  Imports pyzmq and the stats; nothing else of ``publishers``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from kvevents.publishers.publisher_stats import PublisherStats, count_drop

__all__ = ["DeliveryMarks"]

logger = logging.getLogger("kvevents.publishers.zmq_publisher")


class DeliveryMarks:
    """Delivery marks of one PUB socket and the newest point confirmed written.

    ``track_every`` (batches) is how often a live batch is tracked; ``hwm_messages`` the
    PUB socket's HWM, which bounds how many marks are kept.  ``stats`` are the publisher's
    counters and ``lock`` the lock guarding its drop counters.  Only the sender thread
    calls the methods.
    """

    def __init__(
        self, track_every: int, hwm_messages: int, stats: PublisherStats, lock: threading.Lock
    ) -> None:
        self.track_every = track_every
        self.hwm_messages = hwm_messages
        self.stats = stats
        self.lock = lock
        self.marks: deque[tuple[int, Any, int, int]] = deque()
        """``(seq, tracker, batches, events published so far)``, oldest first."""
        self.confirmed = (-1, 0, 0)
        """The newest ``(seq, batches, events)`` known written out."""
        self.since_mark = 0
        """Live batches sent since the last tracked one."""
        self.last_sent_seq = -1

    def sent(self, seq: int, tracker: Any) -> None:
        """Record that live batch ``seq`` was sent (``tracker``: its tracker, or ``None``).

        Call after the stats counted it as published.
        """
        self.last_sent_seq = seq
        self.since_mark += 1
        if tracker is not None:
            self.since_mark = 0
            stats = self.stats
            self.marks.append((seq, tracker, stats.batches_published, stats.events_published))
            self.prune()

    def prune(self) -> None:
        """Advance the confirmed point over marks ZeroMQ is done with; bound the list."""
        marks = self.marks
        while marks and marks[0][1].done:
            seq, _, batches, events = marks.popleft()
            self.confirmed = (seq, batches, events)
        # A subscriber that never reads holds its oldest marks forever; forgetting them
        # only makes the shutdown count more cautious.
        limit = max(64, self.hwm_messages // self.track_every + 64)
        while len(marks) > limit:
            marks.popleft()

    def newest_done(self) -> None:
        """Move the confirmed point to the newest mark ZeroMQ is done with (everything
        before it was written too: each subscriber's queue is FIFO)."""
        for mark in reversed(self.marks):
            if mark[1].done:
                if mark[0] > self.confirmed[0]:
                    self.confirmed = (mark[0], mark[2], mark[3])
                return

    def all_confirmed(self) -> bool:
        """Whether every batch counted as published is confirmed written."""
        return self.stats.batches_published == self.confirmed[1]

    def wait_for_last(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the last batch sent to be confirmed written.

        Returns True when everything published is confirmed.
        """
        self.prune()
        if self.all_confirmed():
            return True  # nothing sent since the last confirmation
        last = self.marks[-1] if self.marks else None
        if last is not None and last[0] == self.last_sent_seq:
            with contextlib.suppress(zmq.NotDone):
                last[1].wait(max(0.0, timeout_s))
        self.newest_done()
        return self.all_confirmed()

    def uncount_unflushed(self, endpoint: str) -> None:
        """Move the batches after the confirmed point from published to dropped
        (``shutdown_unflushed``) and log it; ``endpoint`` names the publisher."""
        _, batches, events = self.confirmed
        stats = self.stats
        lost_batches = stats.batches_published - batches
        lost_events = stats.events_published - events
        if lost_batches <= 0:
            return
        stats.batches_published = batches
        stats.events_published = events
        with self.lock:
            count_drop(stats, "shutdown_unflushed", lost_events, lost_batches)
        logger.warning(
            "KV event publisher %s: %d batches sent to ZeroMQ were not written to every "
            "connected subscriber within the shutdown budget; counted as dropped",
            endpoint,
            lost_batches,
        )

    def watch_termination(
        self, terminate: Callable[[], None], watch_until: float, clock: Callable[[], float]
    ) -> bool:
        """Run ``terminate`` (a context's ``term``) in a thread, reading the marks meanwhile.

        ``term()`` returns once every pipe is empty or the linger expired; returning
        before ``watch_until`` (a ``clock()`` time just before the linger ends, when
        ZeroMQ would free the rest) means everything sent was written.  Returns whether
        it did; waits for ``terminate`` to return either way.
        """
        terminator = threading.Thread(target=terminate, name="kvevents-zmq-term")
        terminator.start()
        while terminator.is_alive() and clock() < watch_until:
            self.newest_done()
            terminator.join(0.002)
        in_time = not terminator.is_alive() and clock() < watch_until
        terminator.join()
        return in_time
