"""The asyncio twin of :class:`~kvevents.consumers.subscriber.Subscriber`.

:class:`AsyncSubscriber` runs the very same engine (decoding, seq tracking, replay
scheduling) and waits for its sockets with :class:`zmq.asyncio.Poller`, so it never
blocks the event loop::

    async with AsyncSubscriber(["tcp://engine:5557"], replay_endpoints=["tcp://engine:5558"]) as sub:
        async for item in sub:
            ...

It yields the same :class:`ReceivedBatch` / :class:`Anomaly` values in the same order as
the sync subscriber would for the same traffic.  Use it from one task at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import zmq
import zmq.asyncio

from kvevents.consumers.subscriber import (
    EndpointSpec,
    Subscriber,
    SubscriberItem,
    SubscriberStats,
)

__all__ = ["AsyncSubscriber"]


class AsyncSubscriber:
    """``async for item in sub`` over batches and anomalies; arguments as
    :class:`~kvevents.consumers.subscriber.Subscriber`."""

    def __init__(
        self,
        endpoints: EndpointSpec | Sequence[EndpointSpec],
        topic: bytes = b"",
        replay_endpoints: Sequence[str | None] | Mapping[str, str] | None = None,
        **options: Any,
    ) -> None:
        self._core = Subscriber(endpoints, topic, replay_endpoints, **options)
        self._poller: zmq.asyncio.Poller | None = None
        self._poller_key: tuple[int, ...] = ()

    @property
    def stats(self) -> SubscriberStats:
        """The shared counters (see :class:`SubscriberStats`)."""
        return self._core.stats

    @property
    def subscriber(self) -> Subscriber:
        """The engine underneath (for its sources and settings)."""
        return self._core

    async def receive(self, timeout: float | None = None) -> SubscriberItem | None:
        """The next batch or anomaly, waiting up to ``timeout`` seconds (None: for ever);
        None on timeout, after :meth:`close`, or when every source is exhausted."""
        core = self._core
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            item = core._take()
            if item is not None:
                return item
            if core.closed or core._finished():
                return None
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                core._step(core._poll(0.0), now)
                return core._take()
            wait = core._wait_seconds(now, deadline)
            if wait == 0.0:
                # A file source is ready: read it, but let other tasks run in between.
                core._step(core._poll(0.0), now)
                await asyncio.sleep(0)
                continue
            await self._wait_readable(wait)
            if core.closed:
                return None
            core._step(core._poll(0.0), time.monotonic())

    async def _wait_readable(self, wait: float | None) -> None:
        socks = self._core._poll_sockets()
        if not socks:
            if wait is not None:
                await asyncio.sleep(wait)
            return
        key = tuple(id(s) for s in socks)
        if self._poller is None or key != self._poller_key:
            poller = zmq.asyncio.Poller()
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            self._poller, self._poller_key = poller, key
        timeout_ms = None if wait is None else max(1, int(wait * 1000 + 0.999))
        await self._poller.poll(timeout_ms)

    def __aiter__(self) -> AsyncIterator[SubscriberItem]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[SubscriberItem]:
        while True:
            item = await self.receive(None)
            if item is None:
                return
            yield item

    def close(self) -> None:
        """Close the sources.  Idempotent."""
        self._core.close()
        self._poller = None

    async def __aenter__(self) -> AsyncSubscriber:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
