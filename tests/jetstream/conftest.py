"""A real ``nats-server`` with JetStream on a loopback port, started by the tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("nats")

from kvevents.errors import ConfigError
from kvevents.jetstream import LocalNatsServer

from .helpers import Engine


@pytest.fixture
def nats_server() -> Iterator[LocalNatsServer]:
    try:
        server = LocalNatsServer().start()
    except ConfigError as exc:  # no binary: the test extra ships it, so CI has one
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine()
    try:
        yield e
    finally:
        e.stop()
