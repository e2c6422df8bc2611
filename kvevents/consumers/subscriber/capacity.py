"""Room for a fleet: the ZMQ context and the open-file limit a subscriber needs for the
connections it opens.

One job: :func:`fleet_context` and :func:`ensure_open_files`.  A subscriber following
engines endpoint by endpoint opens, per endpoint and per replay endpoint, a socket and
its connection monitor: three ZMQ sockets (the socket and the monitor's two ends) and
about four file descriptors (their three mailboxes and the TCP connection).  ZMQ's
process-wide context allows 1,023 sockets by default, and many systems start processes
with 1,024 open files, so past a few hundred engines the subscriber could not open.
May import :mod:`zmq` only.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

__all__ = ["FDS_PER_LINK", "SOCKETS_PER_LINK", "ensure_open_files", "fleet_context"]

logger = logging.getLogger("kvevents.consumers.subscriber")

SOCKETS_PER_LINK = 3
"""ZMQ sockets per monitored connection: the socket and both ends of its monitor."""
FDS_PER_LINK = 4
"""File descriptors per monitored connection: three mailboxes and the TCP socket."""
_HEADROOM_FDS = 512
"""Open files left for the rest of the process when the limit is raised."""


def fleet_context(links: int) -> zmq.Context[Any] | None:
    """A ZMQ context of its own, sized for ``links`` monitored connections, when they
    would take more than half of the process-wide context's socket limit
    (``zmq.Context.instance().MAX_SOCKETS``); None when the shared context will do.
    The caller owns the context (``destroy()`` it once its sockets are closed)."""
    need = SOCKETS_PER_LINK * links
    shared_limit = int(zmq.Context.instance().get(zmq.MAX_SOCKETS))
    if need <= shared_limit // 2:
        return None
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, need + shared_limit)
    logger.info(
        "%d connections: a ZMQ context of their own (up to %d sockets)",
        links,
        need + shared_limit,
    )
    return ctx


def ensure_open_files(links: int) -> None:
    """Raise this process's soft open-file limit (``RLIMIT_NOFILE``) when it is too low
    for ``links`` monitored connections plus 512 other files, up to the hard limit.
    Logs what it changed; warns when the hard limit is too low (raise ``ulimit -n``).
    Does nothing where the platform has no such limit."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return
    want = FDS_PER_LINK * links + _HEADROOM_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if new > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError) as exc:  # pragma: no cover - refused by the system
            logger.warning("cannot raise the open-file limit from %d: %s", soft, exc)
            return
        logger.info("%d connections: open-file limit raised from %d to %d", links, soft, new)
    if new < want:
        logger.warning(
            "%d connections need about %d open files; the hard limit is %d "
            "(raise it with `ulimit -n`)",
            links,
            want,
            hard,
        )
