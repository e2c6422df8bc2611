"""Connecting to a NATS server for the relay and the readers: one clear error, quiet
reconnects.

:func:`connect_jetstream` opens a connection and checks that the server runs JetStream.
A server that cannot be reached within ``connect_window_s`` is one :class:`ConfigError`
(``cannot reach nats://HOST:PORT: REASON``), a server without JetStream another
(``JetStream is not enabled on nats://HOST:PORT: start nats-server with -js``).  Once
connected, a server that goes away is reconnected to for ever, the wait between tries
doubling from 0.2 s to 2 s; the loss, every 30 s still away, and the return are each one
warning line on this module's logger, and nats-py's own error reports (tracebacks on
its default callback) are logged at debug level only.

Imports nats-py when a connection is made; nothing from kvevents but the errors.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from kvevents.errors import ConfigError

__all__ = [
    "MAX_RECONNECT_WAIT_S",
    "MIN_RECONNECT_WAIT_S",
    "NatsLink",
    "cannot_reach",
    "connect_jetstream",
    "jetstream_disabled",
]

logger = logging.getLogger(__name__)

MIN_RECONNECT_WAIT_S = 0.2
MAX_RECONNECT_WAIT_S = 2.0
STILL_AWAY_EVERY_S = 30.0


def cannot_reach(url: str, reason: str) -> ConfigError:
    """The one-line error for a NATS server that does not answer."""
    return ConfigError(f"cannot reach {url}: {reason}")


def jetstream_disabled(url: str) -> ConfigError:
    """The one-line error for a NATS server that runs without JetStream."""
    return ConfigError(f"JetStream is not enabled on {url}: start nats-server with -js")


def _reason(exc: BaseException | None) -> str:
    """A short reason for a failed connection attempt (no exception class soup)."""
    if exc is None:
        return "no answer"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return "unknown host"
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    text = str(exc).strip()
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    return text or type(exc).__name__


class NatsLink:
    """One NATS connection with quiet callbacks: ``up`` is set while connected, ``away_s``
    says how long the server has been away (0 while connected), ``reconnects`` counts
    the returns."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.nc: Any = None
        self.up = asyncio.Event()
        self.reconnects = 0
        self.last_error: BaseException | None = None
        self._away_since: float | None = None
        self._last_said = 0.0
        self._connected_once = False
        self._closing = False

    @property
    def away_s(self) -> float:
        return 0.0 if self._away_since is None else time.monotonic() - self._away_since

    @property
    def is_up(self) -> bool:
        return self.nc is not None and bool(self.nc.is_connected)

    async def _error_cb(self, exc: Exception) -> None:
        self.last_error = exc
        logger.debug("nats: %r", exc)
        if self.nc is None or not self._connected_once:
            return
        opts = self.nc.options
        if self._away_since is not None:
            # back off: each failed try doubles the wait before the next
            opts["reconnect_time_wait"] = min(
                max(float(opts.get("reconnect_time_wait", 0)) * 2, MIN_RECONNECT_WAIT_S),
                MAX_RECONNECT_WAIT_S,
            )
            now = time.monotonic()
            if now - self._last_said >= STILL_AWAY_EVERY_S:
                self._last_said = now
                logger.warning(
                    "%s still unreachable after %.0f s (%s); retrying every %.1f s",
                    self.url,
                    self.away_s,
                    _reason(exc),
                    opts["reconnect_time_wait"],
                )

    async def _disconnected_cb(self) -> None:
        self.up.clear()
        if not self._connected_once or self._away_since is not None:
            return
        if self._closing or self.nc is None or self.nc.is_closed:
            return  # our own close
        self._away_since = self._last_said = time.monotonic()
        logger.warning("lost the connection to %s; reconnecting", self.url)

    async def _reconnected_cb(self) -> None:
        self.reconnects += 1
        away = self.away_s
        self._away_since = None
        if self.nc is not None:
            self.nc.options["reconnect_time_wait"] = MIN_RECONNECT_WAIT_S
        self.up.set()
        logger.warning("reconnected to %s after %.1f s", self.url, away)

    async def connect(self, connect_window_s: float = 3.0) -> Any:
        """Connect, trying for up to ``connect_window_s`` seconds (a server starting at
        the same moment is waited for), and check JetStream; returns the nats-py client."""
        from nats.aio.client import Client
        from nats.js.errors import ServiceUnavailableError

        nc = Client()
        self.nc = nc
        try:
            await asyncio.wait_for(
                nc.connect(
                    self.url,
                    error_cb=self._error_cb,
                    disconnected_cb=self._disconnected_cb,
                    reconnected_cb=self._reconnected_cb,
                    connect_timeout=max(1, round(connect_window_s)),
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=MIN_RECONNECT_WAIT_S,  # type: ignore[arg-type]
                ),
                connect_window_s,
            )
        except asyncio.TimeoutError:
            await self._abandon()
            raise cannot_reach(self.url, _reason(self.last_error)) from None
        except Exception as exc:  # a malformed URL, an authorization refused, ...
            await self._abandon()
            raise cannot_reach(self.url, _reason(self.last_error or exc)) from None
        self._connected_once = True
        self.up.set()
        try:
            await nc.jetstream().account_info()
        except ServiceUnavailableError:
            await self.close()
            raise jetstream_disabled(self.url) from None
        except Exception as exc:
            await self.close()
            raise ConfigError(f"JetStream on {self.url} did not answer: {_reason(exc)}") from None
        return nc

    async def _abandon(self) -> None:
        self._closing = True
        nc, self.nc = self.nc, None
        if nc is not None:
            try:
                await nc.close()
            except Exception:  # never connected: nothing to close
                logger.debug("closing an unconnected client", exc_info=True)

    async def wait_up(
        self, stopping: Callable[[], bool] | None = None, poll_s: float = 0.1
    ) -> bool:
        """Wait until connected; False if ``stopping()`` turns true first (or the link
        was closed)."""
        while not self.is_up:
            if stopping is not None and stopping():
                return False
            if self.nc is None or self.nc.is_closed:
                return False
            try:
                await asyncio.wait_for(self.up.wait(), poll_s)
            except asyncio.TimeoutError:
                continue
        return True

    async def close(self, drain: bool = False) -> None:
        """Close (draining first when ``drain`` and connected); idempotent."""
        self._closing = True
        nc, self.nc = self.nc, None
        if nc is None or nc.is_closed:
            return
        try:
            if drain and nc.is_connected:
                await nc.drain()
            else:
                await nc.close()
        except Exception:
            logger.debug("closing the NATS connection failed", exc_info=True)


async def connect_jetstream(url: str, connect_window_s: float = 3.0) -> NatsLink:
    """A connected :class:`NatsLink` to ``url`` with JetStream checked (see the module)."""
    link = NatsLink(url)
    await link.connect(connect_window_s)
    return link
