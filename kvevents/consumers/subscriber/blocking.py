"""The blocking subscriber: :class:`Subscriber` waits for input with
:meth:`SubscriberCore.select` and runs the loop of :meth:`SubscriberCore.receiving`.

One job: the blocking wait.  May import the subscriber's core and options.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import TracebackType

from kvevents.consumers.subscriber.core import SubscriberCore
from kvevents.consumers.subscriber.items import SubscriberItem

__all__ = ["Subscriber"]


class Subscriber(SubscriberCore):
    """Follow the batches of many publishers, repairing gaps by replay.

    ``endpoints``: one endpoint string or :class:`~kvevents.consumers.source_protocol.Source`, or
    a sequence of them.  A string becomes a :class:`~kvevents.consumers.zmq_source.ZmqSource`
    subscribed to ``topic`` (a prefix: ``b"kv@"`` follows every ``kv@...`` engine behind
    a proxy); a path ending in ``.kvcap`` (or prefixed ``capture:``) becomes a
    :class:`~kvevents.consumers.capture_source.CaptureSource`.  ``replay_endpoints`` gives the
    replay (ROUTER) endpoints: a sequence aligned with ``endpoints`` (None entries
    allowed), or a mapping whose keys are an endpoint (its replay endpoint for every
    topic) or ``"<endpoint>#<topic>"`` (the replay endpoint of that topic's engine behind
    a shared endpoint).

    Options: ``catch_up`` (default True) replays every new stream from the oldest seq its
    publisher holds and asks each replay endpoint for its ring at start;
    ``replay_timeout_s`` bounds how
    long a worker's stream may wait on a replay that makes no progress (to start,
    including queueing, and between two replies); ``max_concurrent_replays`` bounds
    replays in flight over all sources; ``replay_cooldown_s`` is how long a replay
    endpoint that timed out is not asked again; ``stale_after_s`` (default
    :data:`~kvevents.consumers.subscriber.DEFAULT_STALE_AFTER_S`; None: never) is the
    liveness bound; ``decoder`` is a :class:`~kvevents.codec.BatchDecoder` to use (its
    stats count skipped events); ``history`` and ``max_pending`` (counts of batches) are
    passed to each :class:`~kvevents.seqtrack.StreamTracker`; ``rcvhwm`` is the
    SUB high-water mark (messages); ``max_message_size_bytes`` (default 64 MiB; None:
    unlimited) the ``ZMQ_MAXMSGSIZE`` of every socket; ``curve`` a
    :class:`~kvevents.security.CurveClientConfig` for publishers that require CURVE;
    ``max_replay_batches`` bounds one replay's replies (a reply stream that never ends
    is abandoned and its holes reported); ``receive_batch`` (default 128) the most
    messages read from one source per wake-up (a read of a ZMQ source also stops after
    64 KiB of payloads; once a wake-up's read has yielded an item, its later reads are
    held raw and decoded when the application has taken the items before them);
    ``inband_window`` how many live records of a capture may follow a gap before the
    recorded replay answering it is given up (the gap is then reported lost);
    ``context`` the ZMQ context to open sockets in (default: the process-wide one; a
    fleet that would take more than half of its 1,023 sockets gets a context of its
    own, closed with the subscriber).  The soft open-file limit is raised, up to
    the hard one, when about four descriptors per connection would not fit.  A wait
    costs the same whatever the number of sources: their sockets are registered once
    with the platform's selector.  Durations are seconds.
    """

    def receive(self, timeout: float | None = None) -> SubscriberItem | None:
        """Return the next batch or anomaly, waiting up to ``timeout`` seconds (None: for
        ever).  Returns None on timeout, after :meth:`close`, or when every source is
        exhausted (capture files read to the end) and nothing is left.

        This is :meth:`~SubscriberCore.receiving`'s loop with the wait in place of its
        yields: driving the generator (a ``send`` and a ``StopIteration`` a wake-up) cost
        about 3 % of a wake-up's instructions, measured)."""
        out = self._out
        if out:  # the common case: processed and waiting
            return out.popleft()
        if self._wake is not None:  # the next of a wake-up's reads
            self._advance()
            if out:
                return out.popleft()
        select = self._waits.select
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed or self.finished():
                return None
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                ready = select(0.0)
                if self._closed:
                    return None
                self.step(ready, now)
                return self.take()
            ready = select(self.wait_seconds(now, deadline))
            if self._closed:
                return None
            self.step(ready, time.monotonic())
            if out:
                return out.popleft()

    def __iter__(self) -> Iterator[SubscriberItem]:
        """Yield batches and anomalies until :meth:`close` (or the end of every source)."""
        while True:
            item = self.receive(None)
            if item is None:
                return
            yield item

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
