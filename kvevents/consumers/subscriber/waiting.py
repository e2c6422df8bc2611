"""What a subscriber waits on: the sockets of its sources, which sources a readable
socket belongs to, and when a source wants attention without input.

One job: :class:`SourceWaits`.  May import the source protocol only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvevents.consumers.source_protocol import Source

__all__ = ["SourceWaits"]


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
