"""The asyncio twin of :class:`~kvevents.consumers.subscriber.Subscriber`.

:class:`AsyncSubscriber` runs the very same engine (decoding, seq tracking, replay
scheduling) and waits for input through the event loop (a reader on the descriptor of
the core's selector), so it never blocks the event loop::

    async with AsyncSubscriber(["tcp://engine:5557"], replay_endpoints=["tcp://engine:5558"]) as sub:
        async for item in sub:
            ...

It yields the same :class:`ReceivedBatch` / :class:`Anomaly` values in the same order as
the sync subscriber would for the same traffic: both run one
:class:`~kvevents.consumers.subscriber.SubscriberCore`'s public receive loop
(:meth:`~kvevents.consumers.subscriber.SubscriberCore.receiving`: catch-up, restart
detection, liveness and every counter included) and differ only in how they wait.  Use
it from one task at a time.  Imports only the public API of
:mod:`kvevents.consumers.subscriber`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any

import zmq
import zmq.asyncio

from kvevents.codec import BatchDecoder
from kvevents.consumers.source_protocol import Source
from kvevents.consumers.subscriber import (
    EndpointSpec,
    ReplaySpec,
    SubscriberCore,
    SubscriberItem,
    SubscriberOptions,
    SubscriberStats,
)
from kvevents.consumers.subscriber.waiting import PollerCache, poll_timeout_ms
from kvevents.security import CurveClientConfig

__all__ = ["AsyncSubscriber"]


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


class AsyncSubscriber:
    """``async for item in sub`` over batches and anomalies; arguments as
    :class:`~kvevents.consumers.subscriber.Subscriber`."""

    def __init__(
        self,
        endpoints: EndpointSpec | Sequence[EndpointSpec],
        topic: bytes | str = b"",
        replay_endpoints: ReplaySpec = None,
        *,
        options: SubscriberOptions | None = None,
        decoder: BatchDecoder | None = None,
        context: zmq.Context[Any] | None = None,
        curve: CurveClientConfig | None = None,
    ) -> None:
        self._core = SubscriberCore(
            endpoints,
            topic,
            replay_endpoints,
            options=options,
            decoder=decoder,
            context=context,
            curve=curve,
        )
        self._pollers = PollerCache(zmq.asyncio.Poller)
        self._readers = True

    @property
    def stats(self) -> SubscriberStats:
        """The shared counters (see :class:`SubscriberStats`)."""
        return self._core.stats

    @property
    def subscriber(self) -> SubscriberCore:
        """The engine underneath (for its sources, settings and stale workers)."""
        return self._core

    async def receive(self, timeout: float | None = None) -> SubscriberItem | None:
        """The next batch or anomaly, waiting up to ``timeout`` seconds (None: for ever);
        None on timeout, after :meth:`close`, or when every source is exhausted."""
        core = self._core
        item = core.take()  # the common case: processed and waiting
        if item is not None:
            return item
        loop = core.receiving(timeout)
        try:
            wait = next(loop)
            while True:
                wait = loop.send(await self._wait_readable(wait))
        except StopIteration as done:
            result: SubscriberItem | None = done.value
            return result

    async def _wait_readable(self, wait_s: float | None) -> list[Source]:
        core = self._core
        if wait_s == 0.0:
            # Input is waiting, or a deadline is due: let other tasks run first.
            await asyncio.sleep(0)
            return core.select(0.0)
        fd = core.wait_fd()
        if fd is not None and self._readers:
            loop = asyncio.get_running_loop()
            woken: asyncio.Future[None] = loop.create_future()
            try:
                loop.add_reader(fd, _wake, woken)
            except NotImplementedError:  # an event loop without readers (Windows' proactor)
                self._readers = False
            else:
                timer = None if wait_s is None else loop.call_later(wait_s, _wake, woken)
                try:
                    await woken
                finally:
                    loop.remove_reader(fd)
                    if timer is not None:
                        timer.cancel()
                return core.select(0.0)
        # No selector descriptor to wait on: poll the sockets themselves.
        socks = core.wait_sockets()
        if not socks:
            if wait_s is not None:
                await asyncio.sleep(wait_s)
            return core.ready_sources(())
        poller = self._pollers.poller(socks)
        readable = await poller.poll(poll_timeout_ms(wait_s, 1))
        return core.ready_sources(sock for sock, _ in readable)

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
        self._pollers.reset()

    async def __aenter__(self) -> AsyncSubscriber:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
