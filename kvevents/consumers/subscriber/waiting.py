"""What a subscriber waits on: which of its sources have input, found at a cost that does
not grow with their number, and which want attention without input (a redial).

One job: :class:`SourceWaits`, shared by the blocking and the asyncio subscriber, and the
poller cache of the asyncio subscriber's fallback.  May import the source protocol and
:mod:`zmq`.
"""

from __future__ import annotations

import select
import selectors
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from kvevents.consumers.source_protocol import Source

__all__ = ["PollerCache", "SourceWaits", "poll_timeout_ms"]

P = TypeVar("P", zmq.Poller, zmq.asyncio.Poller)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_FD = int(zmq.FD)
_EPOLL = hasattr(select, "epoll")
"""Wait with ``select.epoll`` itself where the platform has it (Linux): the same
system call as :mod:`selectors`' epoll selector without its Python layer; elsewhere with
:class:`selectors.DefaultSelector` (kqueue on macOS), through :class:`_SelectorPoll`."""


class _SelectorPoll:
    """The part of ``select.epoll``'s interface :class:`SourceWaits` uses, over
    :class:`selectors.DefaultSelector`, for platforms without epoll (read events only)."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()

    def register(self, fd: int, _events: int) -> None:
        self._selector.register(fd, selectors.EVENT_READ)

    def unregister(self, fd: int) -> None:
        self._selector.unregister(fd)

    def poll(self, timeout: float | None, _maxevents: int) -> list[tuple[int, int]]:
        return [(key.fd, events) for key, events in self._selector.select(timeout)]

    def fileno(self) -> int | None:
        fileno = getattr(self._selector, "fileno", None)
        return None if fileno is None else int(fileno())

    def close(self) -> None:
        self._selector.close()


_READ = select.EPOLLIN if _EPOLL else selectors.EVENT_READ


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


# (socket, its file descriptor, whether it is a ZMQ socket, whether its source is told
# when it signals: one of the source's ``watch_signals()``)
_Reg = tuple[Any, int, bool, bool]


def _same(a: Any, b: Any) -> bool:
    """The same socket: the same object, or the same plain descriptor number."""
    return a is b or (type(a) is int and a == b)


class SourceWaits:
    """Which of ``sources`` have input, without a pass over all of them per wait.

    Every socket of every source is registered once with a selector (epoll on Linux,
    kqueue on macOS) by its file descriptor: ``ZMQ_FD`` for a ZMQ socket, the descriptor
    itself (or ``fileno()``) otherwise.  A wait then costs the same for a thousand
    sources as for one, where ``zmq_poll`` asks every socket in turn (about 0.7 us a
    socket).

    A ZMQ socket's descriptor only signals that the socket's state may have changed, and
    stops signalling once anything on that socket (a receive, a send, a connect, a read
    of ``ZMQ_EVENTS``) has processed the change, whether or not the input was read.  So
    the caller passes to :meth:`settle` every source it read, asked for a replay,
    redialled or closed a socket of: settling registers the sockets the source opened,
    forgets those it closed, and reads ``ZMQ_EVENTS`` of the rest.  A source whose
    socket still holds input (a read stopped at its budget) is *pending*, and so is a
    source without sockets that is not exhausted (a file): :meth:`select` returns the
    pending sources without waiting.  A source's sockets may change only while it is
    called (``receive``, ``request_replay``, ``cancel_replay``, ``maintain``, ``close``).
    Sockets are told apart by identity, plain descriptors by number: a source that
    closes a plain descriptor and opens another with the same number within one call is
    not told apart (return an object with ``fileno()`` to be safe).

    A source may name sockets it reads only when told (``watch_signals()``, the ZMQ
    source's connection monitor): their source's ``signalled(sock)`` is called whenever
    such a socket's descriptor signals, a settle finds it with input, or every source is
    read (:meth:`everything`), before the source is next read.

    Also tracks the sources that want attention without input: those whose
    ``redial_at`` (monotonic seconds) is set, and those with a ``maintain`` method but
    no ``redial_at``, which are maintained at every step.
    """

    def __init__(self, sources: Sequence[Source]) -> None:
        self.sources = sources
        self._poll: select.epoll | _SelectorPoll = select.epoll() if _EPOLL else _SelectorPoll()
        self._regs: dict[int, list[_Reg]] = {}  # id(source) -> its registered sockets
        # descriptor -> (socket, source, whether the source is told when it signals)
        self._fd_owner: dict[int, tuple[Any, Source, bool]] = {}
        # id(socket) -> (its source, whether the source is told when it signals)
        self._owner: dict[int, tuple[Source, bool]] = {}
        self.pending: dict[int, Source] = {}
        """The sources with input without waiting, by id (then a wait must not block; read
        only: :meth:`settle` keeps it)."""
        self.redialing: dict[int, Source] = {}
        """The sources waiting to dial again, by id (read only: :meth:`settle` keeps it)."""
        self._always_maintained = [
            src
            for src in sources
            if callable(getattr(src, "maintain", None)) and not hasattr(src, "redial_at")
        ]
        self._socket_list: list[Any] | None = None
        self.settle(sources)

    # --- after a step ---------------------------------------------------------------
    def settle(self, sources: Iterable[Source], *, read: bool = False) -> None:
        """Bring the registration of ``sources`` up to date after they were called, and
        note which still hold input (pending) or want to dial again.  ``read``: the
        sources were just read (``receive``), so a source whose ``read_settled`` is true
        (its read opened or closed no socket and found every one empty) is not asked
        again; one called since its read (a replay request, a redial) must be settled
        again without ``read``."""
        pending = self.pending
        for src in sources:
            key = id(src)
            if read and getattr(src, "read_settled", False):
                if pending:
                    pending.pop(key, None)
                self._note_redial(key, src)
                continue
            old = self._regs.get(key, [])
            socks = src.sockets()
            if len(old) == len(socks) and all(_same(r[0], s) for r, s in zip(old, socks)):
                regs = old
            else:
                regs = self._register(src, old, socks)
            waiting = not regs and not src.exhausted
            for sock, _, is_zmq, watched in regs:
                # Read every socket's events, not only until one has input: the read
                # is what clears a descriptor that signalled.
                if is_zmq and int(sock.getsockopt(_EVENTS)) & _POLLIN:
                    waiting = True
                    if watched:
                        src.signalled(sock)  # type: ignore[attr-defined]
            if waiting:
                pending[key] = src
            else:
                pending.pop(key, None)
            self._note_redial(key, src)

    def _note_redial(self, key: int, src: Source) -> None:
        if getattr(src, "redial_at", None) is not None:
            self.redialing[key] = src
        else:
            self.redialing.pop(key, None)

    def _register(self, src: Source, old: list[_Reg], socks: Sequence[Any]) -> list[_Reg]:
        self._socket_list = None
        watch = getattr(src, "watch_signals", None)
        watched = list(watch()) if callable(watch) else []
        regs: list[_Reg] = []
        for sock, fd, _, _ in old:
            if not any(_same(sock, s) for s in socks):
                self._owner.pop(id(sock), None)
                # (the descriptor may already serve a socket another source opened since)
                owner = self._fd_owner.get(fd)
                if owner is not None and owner[1] is src and _same(owner[0], sock):
                    del self._fd_owner[fd]
                    self._unregister(fd)
        for sock in socks:
            reg = next((r for r in old if _same(r[0], sock)), None)
            if reg is None:
                reg = self._add(sock, src, any(_same(sock, w) for w in watched))
            regs.append(reg)
            self._owner[id(sock)] = (src, reg[3])
        self._regs[id(src)] = regs
        return regs

    def _add(self, sock: Any, src: Source, watched: bool) -> _Reg:
        is_zmq = isinstance(sock, zmq.Socket)
        if is_zmq:
            fd = int(sock.getsockopt(_FD))
        else:
            fd = sock if isinstance(sock, int) else int(sock.fileno())
        if fd in self._fd_owner:
            # A closed socket's descriptor, reused before its source was settled.
            self._unregister(fd)
        self._poll.register(fd, _READ)
        self._fd_owner[fd] = (sock, src, watched)
        return (sock, fd, is_zmq, watched)

    def _unregister(self, fd: int) -> None:
        try:
            self._poll.unregister(fd)
        except (KeyError, ValueError, OSError):
            pass  # not registered, or closed (which epoll forgets by itself)

    # --- waiting --------------------------------------------------------------------
    def select(self, timeout_s: float | None) -> list[Source]:
        """Wait up to ``timeout_s`` seconds (None: until input; no wait at all while a
        source is pending) and return the sources with input: the pending ones, then
        those whose descriptors signalled.  Read them, then :meth:`settle` them."""
        pending = self.pending
        if pending:
            timeout: float | None = 0.0
        else:
            timeout = None if timeout_s is None else max(0.0, timeout_s)
        owner = self._fd_owner
        # (a wait is rounded up to whole milliseconds; None: no limit)
        events = self._poll.poll(timeout, len(owner) or 1)
        if not events:
            return list(pending.values())
        if len(events) == 1 and not pending:  # the usual wake-up: one descriptor
            entry = owner.get(events[0][0])
            if entry is None:
                return []
            if entry[2]:
                entry[1].signalled(entry[0])  # type: ignore[attr-defined]
            return [entry[1]]
        ready = dict(pending)
        for fd, _ in events:
            entry = owner.get(fd)
            if entry is not None:
                src = entry[1]
                if entry[2]:
                    src.signalled(entry[0])  # type: ignore[attr-defined]
                ready.setdefault(id(src), src)
        return list(ready.values())

    def everything(self) -> list[Source]:
        """Every source, for a read of all of them: each is told that its watched
        sockets signalled."""
        for src in self.sources:
            for sock, _, _, watched in self._regs.get(id(src), ()):
                if watched:
                    src.signalled(sock)  # type: ignore[attr-defined]
        return list(self.sources)

    def fileno(self) -> int | None:
        """A descriptor readable when a registered one is (the selector's own: epoll and
        kqueue have one, ``select`` has none), for an event loop to wait on."""
        fileno: int | None = self._poll.fileno()
        return fileno

    def sockets(self) -> list[Any]:
        """Every source's sockets (for a caller that polls them itself)."""
        if self._socket_list is None:
            self._socket_list = [r[0] for regs in self._regs.values() for r in regs]
        return self._socket_list

    def ready(self, sockets: Iterable[Any]) -> list[Source]:
        """The sources owning ``sockets`` (readable ones among :meth:`sockets`), plus the
        pending ones."""
        ready = dict(self.pending)
        for sock in sockets:
            entry = self._owner.get(id(sock))
            if entry is not None:
                src, watched = entry
                if watched:
                    src.signalled(sock)  # type: ignore[attr-defined]
                ready.setdefault(id(src), src)
        return list(ready.values())

    # --- attention without input ----------------------------------------------------
    def next_redial_s(self, now: float) -> float | None:
        """Seconds until a source next wants to dial again (its ``redial_at``, monotonic
        seconds; may be negative), None if none does."""
        if not self.redialing:
            return None
        due = [
            t
            for t in (getattr(src, "redial_at", None) for src in self.redialing.values())
            if t is not None
        ]
        return min(due) - now if due else None

    def to_maintain(self) -> list[Source]:
        """The sources whose ``maintain(now)`` is due a call: those waiting to dial
        again and those maintained at every step.  Settle them afterwards."""
        if not self.redialing:
            return self._always_maintained
        return [*self._always_maintained, *self.redialing.values()]

    def close(self) -> None:
        """Release the selector (the sockets are the sources' to close)."""
        self._poll.close()
