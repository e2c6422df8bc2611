"""The publisher interface every engine-side event sink implements (vLLM's
``EventPublisher``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvevents.errors import PublisherClosedError
from kvevents.events import EventBatch

__all__ = [
    "EventPublisher",
    "NullEventPublisher",
    "NullPublisherStats",
]


@runtime_checkable
class EventPublisher(Protocol):
    """Where an engine hands its per-step event batches.

    Contract for implementations:

    * ``publish(batch)`` is called on the engine's scheduler thread once per step that
      has events.  It must return in bounded time whatever consumers do (never block on
      a network peer), and the caller must not mutate ``batch`` afterwards.  After
      ``shutdown()`` it raises :class:`~kvevents.errors.PublisherClosedError`.
    * ``shutdown()`` releases the publisher's resources.  It never raises, returns in
      bounded time, and a second call does nothing.
    """

    def publish(self, batch: EventBatch) -> None:
        """Hand one batch to the publisher."""
        ...

    def shutdown(self) -> None:
        """Stop publishing and release resources; idempotent, never raises."""
        ...


@dataclass
class NullPublisherStats:
    """Counters of a :class:`NullEventPublisher`: batches it was given and ignored."""

    batches_ignored: int = 0


class NullEventPublisher:
    """A publisher that discards every batch (events disabled, or ``publisher="null"``).

    ``publish()`` after ``shutdown()`` raises :class:`PublisherClosedError`, like every
    kvevents publisher, so an engine's lifecycle bugs show up even with events off.
    """

    def __init__(self, data_parallel_rank: int = 0, **_ignored: object) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.stats = NullPublisherStats()
        self._closed = False

    def publish(self, batch: EventBatch) -> None:
        """Discard ``batch`` (counted in ``stats.batches_ignored``)."""
        if self._closed:
            raise PublisherClosedError("publish() called on a NullEventPublisher after shutdown()")
        self.stats.batches_ignored += 1

    def shutdown(self) -> None:
        """Mark the publisher closed; idempotent."""
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` has been called."""
        return self._closed

    def __enter__(self) -> NullEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
