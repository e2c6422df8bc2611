"""The blocking subscriber: :class:`Subscriber` runs the receive loop of
:meth:`SubscriberCore.receiving`, waiting for input with :meth:`SubscriberCore.select`.

One job: the blocking wait.  May import the subscriber's core and options.
"""

from __future__ import annotations

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

    ``options``: the settings, a :class:`~kvevents.consumers.subscriber.SubscriberOptions`
    (default: every default; each field says what it does).  ``decoder`` is a
    :class:`~kvevents.codec.BatchDecoder` to use (its stats count skipped events);
    ``context`` the ZMQ context to open sockets in (default: the process-wide one; a
    fleet that would take more than half of its 1,023 sockets gets a context of its own,
    closed with the subscriber); ``curve`` a :class:`~kvevents.security.CurveClientConfig`
    for publishers that require CURVE.  The soft open-file limit is raised, up to the
    hard one, when about four descriptors per connection would not fit.  A wait costs the
    same whatever the number of sources: their sockets are registered once with the
    platform's selector.
    """

    def receive(self, timeout: float | None = None) -> SubscriberItem | None:
        """Return the next batch or anomaly, waiting up to ``timeout`` seconds (None: for
        ever).  Returns None on timeout, after :meth:`close`, or when every source is
        exhausted (capture files read to the end) and nothing is left.

        The next item already read is returned at once; otherwise this runs
        :meth:`~SubscriberCore.receiving`'s loop, waiting with :meth:`select`."""
        out = self._outbox.items
        if out:  # the common case: processed and waiting
            return out.popleft()
        select = self._waits.select
        loop = self.receiving(timeout)
        try:
            wait = next(loop)
            while True:
                wait = loop.send(select(wait))
        except StopIteration as done:
            result: SubscriberItem | None = done.value
            return result

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
