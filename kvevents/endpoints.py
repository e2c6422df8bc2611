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
"""

from __future__ import annotations

import re
from typing import Any

import zmq

from kvevents.errors import ConfigError

__all__ = [
    "enable_ipv6_if_needed",
    "is_bind_endpoint",
    "is_wildcard_endpoint",
    "require_bind",
    "require_connect",
]

_TCP = re.compile(r"^tcp://(?P<host>.*):(?P<port>[0-9]+)$")
_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "[::]", "::", "[*]"})


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
