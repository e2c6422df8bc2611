"""Endpoint forms: vLLM's bind rule and the one-line errors for the wrong form."""

from __future__ import annotations

import pytest
import zmq

from kvevents.endpoints import (
    enable_ipv6_if_needed,
    is_bind_endpoint,
    is_wildcard_endpoint,
    require_bind,
    require_connect,
)
from kvevents.errors import ConfigError


@pytest.mark.parametrize(
    ("endpoint", "binds", "wildcard"),
    [
        ("tcp://*:5557", True, True),
        ("tcp://0.0.0.0:5557", False, True),
        ("tcp://[::]:5557", True, True),
        ("tcp://127.0.0.1:5557", False, False),
        ("tcp://engine-a:5557", False, False),
        ("ipc:///tmp/kv", True, False),
        ("inproc://kv", True, False),
    ],
)
def test_forms(endpoint: str, binds: bool, wildcard: bool) -> None:
    assert is_bind_endpoint(endpoint) is binds
    assert is_wildcard_endpoint(endpoint) is wildcard


def test_require_bind_names_the_listening_form() -> None:
    assert require_bind("tcp://*:6700", "kvevents replay --publish") == "tcp://*:6700"
    with pytest.raises(ConfigError) as info:
        require_bind("tcp://127.0.0.1:6700", "kvevents replay --publish")
    msg = str(info.value)
    assert "\n" not in msg
    assert "kvevents replay --publish" in msg and "tcp://*:6700" in msg
    assert "would connect" in msg


def test_require_connect_names_the_connecting_form() -> None:
    assert require_connect("tcp://10.0.0.5:5557", "kvevents record") == "tcp://10.0.0.5:5557"
    assert require_connect("ipc:///tmp/kv", "kvevents record") == "ipc:///tmp/kv"
    with pytest.raises(ConfigError) as info:
        require_connect("tcp://*:5557", "kvevents record", alternative="or pass --listen")
    msg = str(info.value)
    assert "\n" not in msg
    assert "tcp://HOST:5557" in msg and msg.endswith("or pass --listen")


def test_ipv6_switch_lets_a_socket_bind_an_ipv6_address() -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUB)
    try:
        enable_ipv6_if_needed(sock, "tcp://[::1]:0")
        assert sock.getsockopt(zmq.IPV6) == 1
        other = ctx.socket(zmq.PUB)
        enable_ipv6_if_needed(other, "tcp://127.0.0.1:0")
        assert other.getsockopt(zmq.IPV6) == 0
        other.close(0)
    finally:
        sock.close(0)
