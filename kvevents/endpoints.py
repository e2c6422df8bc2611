"""ZMQ endpoints: which ones bind, which ones connect, and clear errors when it is wrong.

vLLM's rule for its publisher (``ZmqEventPublisher._is_bind_endpoint``): an endpoint
**binds** when it contains ``*`` or ``::`` or starts with ``ipc://`` or ``inproc://``,
and **connects** otherwise.  So vLLM's default ``tcp://*:5557`` listens on every
interface, and ``tcp://10.0.0.5:5557`` connects out (for example to a central XSUB
proxy).  A consumer is the other end: it connects to ``tcp://ENGINE_HOST:5557``.

Mixing the two up used to fail silently: two sockets that both connect (or both listen)
never meet, and the command runs to the end having sent or received nothing.  Commands
therefore check the form first with :func:`require_bind` / :func:`require_connect`,
which raise a :class:`~kvevents.errors.ConfigError` whose one-line message says which
form to use.

This module is also the one home of the endpoint rules shared by the engine and router
sides: :func:`validate_endpoint` (the form of a ZMQ endpoint string) and
:func:`offset_endpoint` (vLLM's per-data-parallel-rank endpoint).  It imports only
pyzmq and :mod:`kvevents.errors`.
"""

from __future__ import annotations

import re
from typing import Any

import zmq

from kvevents.errors import ConfigError

__all__ = [
    "ZMQ_TRANSPORTS",
    "enable_ipv6_if_needed",
    "is_bind_endpoint",
    "is_wildcard_endpoint",
    "offset_endpoint",
    "require_bind",
    "require_connect",
    "validate_endpoint",
]

_TCP = re.compile(r"^tcp://(?P<host>.*):(?P<port>[0-9]+)$")
_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "[::]", "::", "[*]"})

ZMQ_TRANSPORTS: frozenset[str] = frozenset(
    {"tcp", "ipc", "inproc", "pgm", "epgm", "ws", "wss", "tipc", "vmci"}
)
"""Transports an endpoint may name (those libzmq knows for PUB and ROUTER sockets)."""

_TCP_ADDRESS = re.compile(r"^(?P<host>.+):(?P<port>[0-9]+)$")


def validate_endpoint(endpoint: object, name: str = "endpoint") -> str:
    """Check that ``endpoint`` is a ZMQ endpoint string and return it.

    Rules: ``<transport>://<address>`` with a transport of :data:`ZMQ_TRANSPORTS` and a
    non-empty address; a ``tcp`` address must end in ``:<port>`` with a decimal port in
    0–65535 (0 asks the OS for a free port when binding).  ``name`` is the setting's
    name in the message.  Raises :class:`ConfigError`.
    """
    if not isinstance(endpoint, str):
        raise ConfigError(f"{name} must be a string, got {type(endpoint).__name__}")
    transport, sep, address = endpoint.partition("://")
    if not sep or not transport:
        raise ConfigError(
            f"{name} {endpoint!r} is not a ZMQ endpoint: expected '<transport>://<address>', "
            "e.g. 'tcp://*:5557' or 'ipc:///tmp/kv-events'"
        )
    if transport not in ZMQ_TRANSPORTS:
        raise ConfigError(
            f"{name} {endpoint!r} names unknown transport {transport!r}; "
            f"expected one of {', '.join(sorted(ZMQ_TRANSPORTS))}"
        )
    if not address:
        raise ConfigError(f"{name} {endpoint!r} has an empty address after '{transport}://'")
    if transport == "tcp":
        match = _TCP_ADDRESS.match(address)
        if match is None:
            raise ConfigError(
                f"{name} {endpoint!r} must end in ':<port>' with a decimal port, "
                "e.g. 'tcp://*:5557' (bind) or 'tcp://host:5557' (connect)"
            )
        port = int(match.group("port"))
        if port > 65535:
            raise ConfigError(f"{name} {endpoint!r} has port {port}, outside 0-65535")
    return endpoint


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint data-parallel rank ``data_parallel_rank`` uses (vLLM's rule).

    * ``None`` → ``None``; rank 0 → ``endpoint`` unchanged;
    * ``inproc://name`` → ``inproc://name_dp{rank}``;
    * ``tcp://host:port`` → ``tcp://host:{port + rank}``; port 0 (OS-assigned) stays 0;
    * any other transport (``ipc://`` …) with rank ≥ 1 → :class:`ConfigError`, which
      is a ``ValueError`` as in vLLM.
    """
    if endpoint is None:
        return None
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, sep, port_text = endpoint.rpartition(":")
        if not sep or not port_text.isdigit() or base == "tcp":
            raise ConfigError(
                f"cannot offset {endpoint!r} for data-parallel rank {data_parallel_rank}: "
                "it does not end in ':<port>'"
            )
        port = int(port_text)
        if port == 0:
            return endpoint
        new_port = port + data_parallel_rank
        if new_port > 65535:
            raise ConfigError(
                f"cannot offset {endpoint!r} for data-parallel rank {data_parallel_rank}: "
                f"port {new_port} is above 65535"
            )
        return f"{base}:{new_port}"
    raise ConfigError(
        f"cannot derive an endpoint for data-parallel rank {data_parallel_rank} from "
        f"{endpoint!r}: only tcp:// (port + rank) and inproc:// (_dp<rank> suffix) "
        "endpoints can be offset; give each rank its own config"
    )


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's bind-or-connect rule for a publisher's PUB socket.

    True (bind) when ``endpoint`` contains ``*`` or ``::`` or starts with ``ipc://`` or
    ``inproc://``; False (connect) otherwise: ``tcp://host:5557`` connects.
    """
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def is_wildcard_endpoint(endpoint: str) -> bool:
    """Whether ``endpoint`` is a TCP address on every interface (``*``, ``0.0.0.0``, ``[::]``).

    Such an address can only be listened on; connecting to it reaches nobody.
    """
    match = _TCP.match(endpoint)
    return match is not None and match.group("host") in _WILDCARD_HOSTS


def _port(endpoint: str) -> str:
    match = _TCP.match(endpoint)
    return match.group("port") if match is not None else "5557"


def require_bind(endpoint: str, what: str, *, alternative: str | None = None) -> str:
    """Return ``endpoint`` if vLLM's rule binds it; else raise :class:`ConfigError`.

    ``what`` names the command or socket that needs to listen (``"kvevents replay
    --publish"``); ``alternative`` is appended to the message as a further way out.
    """
    if is_bind_endpoint(endpoint):
        return endpoint
    message = (
        f"{what} listens for subscribers, but {endpoint!r} would connect out "
        f"(only an address with '*' or '::', or ipc:// / inproc://, binds): "
        f"use tcp://*:{_port(endpoint)} to listen on every interface"
    )
    if alternative:
        message += f", {alternative}"
    raise ConfigError(message)


def require_connect(endpoint: str, what: str, *, alternative: str | None = None) -> str:
    """Return ``endpoint`` unless it is a wildcard (listen-only) address; else raise.

    ``what`` names the command or socket that connects to a publisher that binds
    (``"kvevents record"``); ``alternative`` is appended to the message as a further
    way out (for example a flag that listens instead).
    """
    if not is_wildcard_endpoint(endpoint):
        return endpoint
    message = (
        f"{what} connects to an engine that binds, but {endpoint!r} is an address to "
        f"listen on (vLLM's default tcp://*:5557 is the engine's side): "
        f"use tcp://HOST:{_port(endpoint)} with the engine's host"
    )
    if alternative:
        message += f", {alternative}"
    raise ConfigError(message)


def enable_ipv6_if_needed(socket: zmq.Socket[Any], endpoint: str) -> None:
    """Turn on ``ZMQ_IPV6`` when ``endpoint`` is an IPv6 TCP address (off by default).

    Needed before binding or connecting ``tcp://[::1]:5557`` or ``tcp://[::]:5557``.
    """
    if endpoint.startswith("tcp://") and ("[" in endpoint or "::" in endpoint):
        socket.setsockopt(zmq.IPV6, 1)
