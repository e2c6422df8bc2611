"""The contract between a subscriber and its inputs: :class:`Source`, the raw
:class:`SourceMessage` it hands over, and the message kinds.

One job: the protocol every source implements (:mod:`kvevents.consumers.zmq_source`,
:mod:`kvevents.consumers.capture_source`, a relay reader).  Imports nothing of kvevents.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

__all__ = [
    "BAD_FRAME",
    "CONNECTED",
    "DISCONNECTED",
    "LIVE",
    "REPLAY",
    "REPLAY_DISCONNECTED",
    "REPLAY_END",
    "Source",
    "SourceMessage",
]

LIVE = "live"
REPLAY = "replay"
REPLAY_END = "replay_end"
BAD_FRAME = "bad_frame"
CONNECTED = "connected"
DISCONNECTED = "disconnected"
REPLAY_DISCONNECTED = "replay_disconnected"


class SourceMessage(msgspec.Struct, gc=False):
    """One raw message from a source.

    ``kind`` is :data:`LIVE`, :data:`REPLAY`, :data:`REPLAY_END`, :data:`BAD_FRAME`, or a
    connection event: :data:`CONNECTED` / :data:`DISCONNECTED` (the live socket) and
    :data:`REPLAY_DISCONNECTED` (a replay DEALER, named by ``channel``).
    ``origin`` is the publisher it came from when that differs from the source's name (a
    capture holds many publishers), else ``""``.  ``recv_ts`` is the wall-clock receive
    time in seconds since the epoch.  ``replayed`` marks a live-path message that was
    obtained through replay when it was recorded.  ``detail`` explains a bad frame.
    ``channel`` is the replay endpoint a replay message came through.  ``parts`` holds
    a bad frame's message parts as read, byte for byte, when the source keeps them (the
    ZMQ source does; a recorder writes them to its capture).
    """

    kind: str
    topic: bytes = b""
    seq: int = -1
    payload: bytes = b""
    recv_ts: float = 0.0
    origin: str = ""
    replayed: bool = False
    detail: str = ""
    channel: str = ""
    parts: tuple[bytes, ...] = ()


@runtime_checkable
class Source(Protocol):
    """What the subscriber needs from an input.

    ``sockets()`` returns the ZMQ sockets (or file descriptors) to wait on; an empty list
    means the source is always ready (a file) until ``exhausted``.  ``receive(limit)``
    never blocks and returns at most about ``limit`` messages.  A source that
    ``can_replay`` accepts ``request_replay(start)`` (one at a time; its replies then
    arrive as :data:`REPLAY` / :data:`REPLAY_END` messages) and ``cancel_replay()``
    (forget the request in flight; no reply to it may arrive afterwards).  A source with
    ``replay_inband`` answers replays with recorded :data:`LIVE` messages flagged
    ``replayed``.

    Optional, for sources with a replay endpoint per topic (:class:`ZmqSource`):
    ``replay_channel(topic) -> str | None`` names the replay endpoint serving a topic
    (one request at a time per channel), ``request_replay(start, topic)`` and
    ``cancel_replay(topic)`` take the topic.  A source without them has one channel.
    ``read_settled: bool``, true after a ``receive`` that opened or closed no socket and
    read each one until it was empty (a receive raised ``zmq.Again``, or ``ZMQ_EVENTS``
    showed no ``POLLIN``), spares the subscriber asking every socket again before it
    waits; a source without it is asked.
    ``watch_signals() -> Sequence[Any]`` names sockets (among ``sockets()``) that the
    source then reads only when told, by ``signalled(sock)``: a waiter that calls it
    promises to call ``signalled`` whenever such a socket's descriptor signals or the
    socket is found with input, before the source's next ``receive`` (the ZMQ source's
    connection monitor, so a read does not ask it each time).
    """

    @property
    def name(self) -> str: ...

    @property
    def can_replay(self) -> bool: ...

    @property
    def replay_inband(self) -> bool: ...

    @property
    def exhausted(self) -> bool: ...

    def sockets(self) -> Sequence[Any]: ...

    def receive(self, limit: int) -> list[SourceMessage]: ...

    def request_replay(self, start: int) -> None: ...

    def cancel_replay(self) -> None: ...

    def close(self) -> None: ...
