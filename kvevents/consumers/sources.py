"""Pluggable inputs of the :class:`~kvevents.consumers.subscriber.Subscriber`.

A :class:`Source` hands the subscriber raw messages - never decoded - tagged with what
they are (:class:`SourceMessage`): a live batch, a replayed batch, the end of a replay or a
malformed frame.  Two sources ship:

* :class:`ZmqSource` - one vLLM-compatible publisher: a SUB socket on its live endpoint
  and, when it has a replay endpoint, a DEALER for replay (C§2.1-2.2, C§9.6).  ZMQ
  reconnects on its own, so a publisher that goes away and comes back on the same
  endpoint is followed without user action (its restart shows as seq going backwards).
* :class:`CaptureSource` - a capture file (:mod:`kvevents.capture`).  A file cannot be
  asked for a replay; instead the replayed frames that were recorded answer the gaps
  *in band* (``replay_inband``), so a capture of a session that replayed reads back as
  the same applied stream.

A later relay source (DESIGN §6) implements the same protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import zmq

from kvevents.capture import CaptureReader, SkippedRange
from kvevents.codec import END_SEQ, pack_replay_request
from kvevents.errors import ConfigError

__all__ = [
    "BAD_FRAME",
    "LIVE",
    "REPLAY",
    "REPLAY_END",
    "CaptureSource",
    "Source",
    "SourceMessage",
    "ZmqSource",
]

logger = logging.getLogger(__name__)

LIVE = "live"
REPLAY = "replay"
REPLAY_END = "replay_end"
BAD_FRAME = "bad_frame"


@dataclass(slots=True)
class SourceMessage:
    """One raw message from a source.

    ``kind`` is :data:`LIVE`, :data:`REPLAY`, :data:`REPLAY_END` or :data:`BAD_FRAME`.
    ``origin`` is the publisher it came from when that differs from the source's name (a
    capture holds many publishers), else ``""``.  ``recv_ts`` is the wall-clock receive
    time in seconds since the epoch.  ``replayed`` marks a live-path message that was
    obtained through replay when it was recorded.  ``detail`` explains a bad frame.
    """

    kind: str
    topic: bytes = b""
    seq: int = -1
    payload: bytes = b""
    recv_ts: float = 0.0
    origin: str = ""
    replayed: bool = False
    detail: str = ""


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


def _binds(endpoint: str) -> bool:
    """A wildcard address can only be bound: ``*``, ``0.0.0.0`` or ``[::]``."""
    return "*" in endpoint or "//0.0.0.0:" in endpoint or "[::]" in endpoint


def _enable_ipv6_if_needed(sock: zmq.Socket[bytes], endpoint: str) -> None:
    """Let ``sock`` reach an IPv6 address (``tcp://[::1]:5557``); off by default in ZMQ."""
    if endpoint.startswith("tcp://") and ("[" in endpoint or "::" in endpoint):
        sock.setsockopt(zmq.IPV6, 1)


class ZmqSource:
    """A vLLM-compatible publisher: SUB on ``endpoint``, DEALER on ``replay_endpoint``.

    The SUB connects (it binds only to a wildcard address - ``*``, ``0.0.0.0``, ``[::]``
    - for publishers that connect out, C§2.1; :attr:`bound_endpoint` then holds the bound
    address) and subscribes to ``topic`` (a prefix).  ``rcvhwm`` is the SUB's
    receive high-water mark in messages.  The DEALER is created on the first replay and
    closed (dropping replies in flight) by :meth:`cancel_replay`.
    """

    def __init__(
        self,
        endpoint: str,
        topic: bytes = b"",
        replay_endpoint: str | None = None,
        *,
        name: str | None = None,
        context: zmq.Context[Any] | None = None,
        rcvhwm: int = 100_000,
    ) -> None:
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ConfigError(f"not a ZMQ endpoint: {endpoint!r}")
        if replay_endpoint is not None and "://" not in replay_endpoint:
            raise ConfigError(f"not a ZMQ replay endpoint: {replay_endpoint!r}")
        self._name = name or endpoint
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._ctx = context if context is not None else zmq.Context.instance()
        self._sub: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        _enable_ipv6_if_needed(self._sub, endpoint)
        self.bound_endpoint: str | None = None
        """The address the SUB bound (the real port for ``:0``); None when it connects."""
        try:
            if _binds(endpoint):
                self._sub.bind(endpoint)
                last = self._sub.getsockopt(zmq.LAST_ENDPOINT)
                self.bound_endpoint = last.decode() if isinstance(last, bytes) else str(last)
            else:
                self._sub.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sub.close(0)
            raise ConfigError(f"cannot open {endpoint!r}: {exc}") from exc
        self._dealer: zmq.Socket[bytes] | None = None
        self._closed = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def can_replay(self) -> bool:
        return self.replay_endpoint is not None

    @property
    def replay_inband(self) -> bool:
        return False

    @property
    def exhausted(self) -> bool:
        return self._closed

    def sockets(self) -> Sequence[Any]:
        if self._closed:
            return []
        return [self._sub] if self._dealer is None else [self._sub, self._dealer]

    def receive(self, limit: int) -> list[SourceMessage]:
        out: list[SourceMessage] = []
        if self._closed:
            return out
        now = time.time()
        sub = self._sub
        for _ in range(limit):
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) == 3 and len(frames[1]) == 8:
                out.append(
                    SourceMessage(LIVE, frames[0], int.from_bytes(frames[1], "big"), frames[2], now)
                )
            else:
                out.append(SourceMessage(BAD_FRAME, recv_ts=now, detail=_describe_live(frames)))
        dealer = self._dealer
        if dealer is not None:
            for _ in range(limit):
                try:
                    frames = dealer.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                out.append(_parse_replay(frames, now))
        return out

    def request_replay(self, start: int) -> None:
        if self.replay_endpoint is None:
            raise ConfigError(f"{self._name}: no replay endpoint")
        if self._dealer is None:
            dealer: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)
            _enable_ipv6_if_needed(dealer, self.replay_endpoint)
            dealer.connect(self.replay_endpoint)
            self._dealer = dealer
        try:
            self._dealer.send_multipart(pack_replay_request(start), zmq.NOBLOCK)
        except zmq.Again:
            # Not connected yet and nothing queued: the request is lost; the caller's
            # timeout reports it.
            logger.debug("%s: replay request not queued (endpoint unreachable)", self._name)

    def cancel_replay(self) -> None:
        if self._dealer is not None:
            self._dealer.close(0)
            self._dealer = None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.cancel_replay()
            self._sub.close(0)

    def __repr__(self) -> str:
        return f"ZmqSource({self.endpoint!r}, replay_endpoint={self.replay_endpoint!r})"


def _describe_live(frames: Sequence[bytes]) -> str:
    if len(frames) != 3:
        return f"live message has {len(frames)} frame(s), expected 3 [topic, seq, payload]"
    return f"live seq frame has {len(frames[1])} bytes, expected 8"


def _parse_replay(frames: Sequence[bytes], now: float) -> SourceMessage:
    """Read a DEALER reply: ``[b"", topic, seq, payload]`` (0.26+) or ``[b"", seq, payload]``
    (before 0.26); the end marker has ``END_SEQ`` as seq (or an empty payload)."""
    n = len(frames)
    if n == 4 and not frames[0]:
        topic, seq_frame, payload = frames[1], frames[2], frames[3]
    elif n == 3 and not frames[0]:
        topic, seq_frame, payload = b"", frames[1], frames[2]
    else:
        return SourceMessage(
            BAD_FRAME,
            recv_ts=now,
            detail=f"replay reply has {n} frame(s), expected [b'', (topic,) seq, payload]",
        )
    if seq_frame == END_SEQ or not payload:
        return SourceMessage(REPLAY_END, topic, -1, b"", now)
    if len(seq_frame) != 8:
        return SourceMessage(
            BAD_FRAME, recv_ts=now, detail=f"replay seq frame has {len(seq_frame)} bytes"
        )
    return SourceMessage(REPLAY, topic, int.from_bytes(seq_frame, "big"), payload, now)


class CaptureSource:
    """The records of a capture file, as a source that is always ready until the end.

    Each record keeps its recorded ``source`` (as ``origin``), ``topic``, ``seq``, raw
    ``payload``, ``recv_ts`` and ``replayed`` flag.  A record with seq -1 and an empty
    payload that was flagged replayed is read as a recorded end-of-replay marker.  A
    damaged record is skipped (see :attr:`skipped`); a damaged or torn end is also in
    :attr:`tail_error`.
    """

    def __init__(self, path: str, *, name: str | None = None) -> None:
        self._reader = CaptureReader(path)
        self._iter = iter(self._reader)
        self._name = name or f"capture:{path}"
        self._done = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def can_replay(self) -> bool:
        return False

    @property
    def replay_inband(self) -> bool:
        return True

    @property
    def exhausted(self) -> bool:
        return self._done

    @property
    def tail_error(self) -> str | None:
        """Why reading stopped early (truncated/corrupt tail), or None."""
        return self._reader.tail_error

    @property
    def bytes_read(self) -> int:
        """Bytes of the file read so far (header and good records): progress over the
        file's size."""
        return self._reader.good_bytes

    @property
    def skipped(self) -> list[SkippedRange]:
        """Damaged byte ranges of the file skipped so far (reading goes on after each)."""
        return self._reader.skipped

    def sockets(self) -> Sequence[Any]:
        return []

    def receive(self, limit: int) -> list[SourceMessage]:
        out: list[SourceMessage] = []
        if self._done:
            return out
        for _ in range(limit):
            rec = next(self._iter, None)
            if rec is None:
                self._done = True
                self._reader.close()
                break
            if rec.seq < 0:
                if rec.replayed and not rec.payload:
                    out.append(
                        SourceMessage(REPLAY_END, rec.topic, -1, b"", rec.recv_ts, rec.source)
                    )
                else:
                    out.append(
                        SourceMessage(
                            BAD_FRAME,
                            recv_ts=rec.recv_ts,
                            origin=rec.source,
                            detail="capture record has no seq",
                        )
                    )
                continue
            out.append(
                SourceMessage(
                    LIVE, rec.topic, rec.seq, rec.payload, rec.recv_ts, rec.source, rec.replayed
                )
            )
        return out

    def request_replay(self, start: int) -> None:
        raise ConfigError(f"{self._name}: a capture answers replays in band")

    def cancel_replay(self) -> None:
        return None

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._reader.close()

    def __repr__(self) -> str:
        return f"CaptureSource({self._reader.path!s})"
