"""The live connection's monitor is read only when its descriptor signals: connection
events still arrive when nothing else does (a publisher that appears, goes away and
comes back without sending), through every way a subscriber waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvevents.consumers import AsyncSubscriber, Subscriber, SubscriberOptions, ZmqSource
from kvevents.consumers.subscriber import waiting

pytestmark = pytest.mark.timeout(60)


class _Publisher:
    """A PUB that binds, unbinds and binds again one ipc endpoint, sending nothing."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock: zmq.Socket[Any] | None = None

    def up(self) -> None:
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)

    def down(self) -> None:
        assert self.sock is not None
        self.sock.close(0)
        self.sock = None

    def close(self) -> None:
        if self.sock is not None:
            self.down()
        self.ctx.term()


def _connections(sub: Subscriber | AsyncSubscriber) -> tuple[int, int]:
    c = sub.stats.connections
    return c["connected"], c["disconnected"]


def _watched(sub: Subscriber | AsyncSubscriber) -> bool:
    core = sub.subscriber if isinstance(sub, AsyncSubscriber) else sub
    (src,) = core.sources
    assert isinstance(src, ZmqSource)
    return src._link.monitor_watched


def _follow(pump: Callable[[], None], sub: Subscriber | AsyncSubscriber, pub: _Publisher) -> None:
    """Bring the publisher up, down and up again; after each change, ``pump`` the
    subscriber until it has counted the connection event (10 s at most each)."""
    for change, want in ((pub.up, (1, 0)), (pub.down, (1, 1)), (pub.up, (2, 1))):
        change()
        deadline = time.monotonic() + 10.0
        while _connections(sub) != want:
            assert time.monotonic() < deadline, f"still {_connections(sub)}, want {want}"
            pump()


@pytest.fixture(params=["epoll", "selectors"])
def waiter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "selectors":
        monkeypatch.setattr(waiting, "_EPOLL", False)
    elif not waiting._EPOLL:
        pytest.skip("no epoll on this platform")
    return str(request.param)


def test_blocking_receive_reads_connection_events_without_traffic(tmp_path: Path, waiter: str):
    pub = _Publisher(f"ipc://{tmp_path}/engine")
    sub = Subscriber(pub.endpoint, options=SubscriberOptions(catch_up=False, stale_after_s=None))
    try:
        assert _watched(sub)

        def pump() -> None:
            assert sub.receive(0.05) is None  # nothing is ever published

        _follow(pump, sub, pub)
    finally:
        sub.close()
        pub.close()


def test_step_of_every_source_reads_connection_events(tmp_path: Path):
    # step(None) reads every source without a wait: the monitors are read too.
    pub = _Publisher(f"ipc://{tmp_path}/engine")
    sub = Subscriber(pub.endpoint, options=SubscriberOptions(catch_up=False, stale_after_s=None))
    (src,) = sub.sources
    assert isinstance(src, ZmqSource)
    mon = src._link.monitor
    assert mon is not None
    try:

        def pump() -> None:
            zmq.select([mon], [], [], 0.05)  # until the monitor may have an event
            sub.step(None, time.monotonic())

        _follow(pump, sub, pub)
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize("wait", ["loop readers", "zmq.asyncio poller"])
def test_async_receive_reads_connection_events_without_traffic(tmp_path: Path, wait: str):
    pub = _Publisher(f"ipc://{tmp_path}/engine")

    async def run() -> None:
        sub = AsyncSubscriber(
            pub.endpoint, options=SubscriberOptions(catch_up=False, stale_after_s=None)
        )
        if wait == "zmq.asyncio poller":
            sub.subscriber.wait_fd = lambda: None  # type: ignore[method-assign]
        try:
            assert _watched(sub)
            loop = asyncio.get_running_loop()
            for change, want in ((pub.up, (1, 0)), (pub.down, (1, 1)), (pub.up, (2, 1))):
                change()
                deadline = loop.time() + 10.0
                while _connections(sub) != want:
                    assert loop.time() < deadline, f"still {_connections(sub)}, want {want}"
                    assert await sub.receive(0.05) is None
            if wait == "zmq.asyncio poller":
                assert sub._pollers._poller is not None  # it went through the poller
        finally:
            sub.close()

    try:
        asyncio.run(run())
    finally:
        pub.close()


def test_a_source_read_on_its_own_reads_its_monitor_at_every_read(tmp_path: Path):
    # Without a waiter that reports the monitor's signals, each read asks the monitor.
    pub = _Publisher(f"ipc://{tmp_path}/engine")
    src = ZmqSource(pub.endpoint)
    try:
        assert not src._link.monitor_watched
        pub.up()
        deadline = time.monotonic() + 10.0
        kinds: list[str] = []
        while "connected" not in kinds:
            assert time.monotonic() < deadline, kinds
            zmq.select([src._link.monitor], [], [], 0.05)
            kinds += [m.kind for m in src.receive(16)]
    finally:
        src.close()
        pub.close()


def test_a_settle_that_finds_the_monitor_with_input_has_it_read(tmp_path: Path, waiter: str):
    # A settle reads the monitor's ZMQ_EVENTS, which clears its descriptor: an event it
    # finds will never make the descriptor signal, so the settle itself must have the
    # source read its monitor.
    pub = _Publisher(f"ipc://{tmp_path}/engine")
    src = ZmqSource(pub.endpoint)
    waits = waiting.SourceWaits([src])
    mon = src._link.monitor
    assert mon is not None
    try:
        assert src._link.monitor_watched
        src.receive(16)  # the first read asks the monitor; later ones only when told
        pub.up()
        deadline = time.monotonic() + 10.0
        kinds: list[str] = []
        while "connected" not in kinds:
            assert time.monotonic() < deadline, kinds
            zmq.select([mon], [], [], 0.05)  # (reads its events: the descriptor clears)
            waits.settle([src])
            for ready in waits.select(0.0):
                kinds += [m.kind for m in ready.receive(16)]
    finally:
        waits.close()
        src.close()
        pub.close()
