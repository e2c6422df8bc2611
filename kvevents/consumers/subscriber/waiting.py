"""What a subscriber waits on: the sockets of its sources, which sources a readable
socket belongs to, when a source wants attention without input, and the poller that
waits (:class:`PollerCache`, shared by the blocking and the asyncio subscriber).

One job: :class:`SourceWaits` and :class:`PollerCache`.  May import the source protocol
and :mod:`zmq`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from kvevents.consumers.source_protocol import Source

__all__ = ["PollerCache", "SourceWaits", "poll_timeout_ms"]

P = TypeVar("P", zmq.Poller, zmq.asyncio.Poller)


class PollerCache(Generic[P]):
    """One poller (made by ``make``: :class:`zmq.Poller` or
    :class:`zmq.asyncio.Poller`) registered for ``POLLIN`` on a list of sockets, made
    again only when the list changes."""

    def __init__(self, make: Callable[[], P]) -> None:
        self._make: Callable[[], P] = make
        self._poller: P | None = None
        self._key: tuple[int, ...] = ()

    def poller(self, sockets: Sequence[Any]) -> P:
        """The poller for ``sockets`` (the same one while they stay the same)."""
        key = tuple(id(s) for s in sockets)
        if self._poller is None or key != self._key:
            poller = self._make()
            for sock in sockets:
                poller.register(sock, zmq.POLLIN)
            self._poller, self._key = poller, key
        return self._poller

    def reset(self) -> None:
        """Forget the poller (its sockets were closed)."""
        self._poller = None


def poll_timeout_ms(wait_s: float | None, minimum_ms: int = 0) -> int | None:
    """A wait in seconds (None: for ever) as a poll timeout in whole milliseconds,
    rounded up and at least ``minimum_ms``."""
    return None if wait_s is None else max(minimum_ms, int(wait_s * 1000 + 0.999))


class SourceWaits:
    """The waiting side of ``sources``: their sockets (:meth:`sockets`) and the sources
    owning readable ones (:meth:`ready`).  A source without sockets that is not
    exhausted (a file) is always ready."""

    def __init__(self, sources: Sequence[Source]) -> None:
        self.sources = sources
        self._owner: dict[Any, Source] = {}

    def sockets(self) -> list[Any]:
        """Every source's sockets, remembering which source owns each."""
        socks: list[Any] = []
        owner: dict[Any, Source] = {}
        for src in self.sources:
            for sock in src.sockets():
                socks.append(sock)
                owner[sock] = src
        self._owner = owner
        return socks

    def ready(self, sockets: Iterable[Any]) -> list[Source]:
        """The sources owning ``sockets`` (from the last :meth:`sockets`), plus every
        always-ready source."""
        ready: list[Source] = []
        seen: set[int] = set()
        for sock in sockets:
            src = self._owner.get(sock)
            if src is not None and id(src) not in seen:
                seen.add(id(src))
                ready.append(src)
        for src in self.sources:
            if not src.exhausted and not src.sockets() and id(src) not in seen:
                ready.append(src)
        return ready

    def any_always_ready(self) -> bool:
        """Whether an always-ready source (a file) has more to read."""
        return any(not src.exhausted and not src.sockets() for src in self.sources)

    def next_redial_s(self, now: float) -> float | None:
        """Seconds until a source next wants to dial again (its ``redial_at``, monotonic
        seconds; may be negative), None if none does."""
        due = [
            t for t in (getattr(src, "redial_at", None) for src in self.sources) if t is not None
        ]
        return min(due) - now if due else None
