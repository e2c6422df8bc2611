"""A vLLM-compatible ZeroMQ publisher as a subscriber input.

One job: :class:`ZmqSource` (a SUB on the live endpoint, a DEALER per replay endpoint,
socket monitors for connection events); its frames are read by the rules of the codec's
frame helpers (:mod:`kvevents.codec.frames`).  Its live side -
the SUB, its monitor and the redial after a drop - is a :class:`LiveLink`, which other
sources that read a publisher's live stream themselves (the recorder's) share.  May import
:mod:`kvevents.codec`, :mod:`kvevents.endpoints`, :mod:`kvevents.security`,
:mod:`kvevents.errors` and the source protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvevents.codec import pack_replay_request, parse_live, parse_replay_reply
from kvevents.consumers.source_protocol import (
    BAD_FRAME,
    CONNECTED,
    DISCONNECTED,
    LIVE,
    REPLAY,
    REPLAY_DISCONNECTED,
    REPLAY_END,
    SourceMessage,
)
from kvevents.endpoints import enable_ipv6_if_needed, is_wildcard_endpoint
from kvevents.errors import ConfigError, FrameError
from kvevents.security import CurveClientConfig, apply_curve_client

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE_BYTES",
    "MONITORED_EVENTS",
    "LiveLink",
    "ZmqSource",
    "drain_monitor_events",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_SIZE_BYTES = 64 * 1024 * 1024
"""Default ``ZMQ_MAXMSGSIZE`` of a :class:`ZmqSource`'s sockets (64 MiB): a frame above
it is refused by ZMQ, which drops the connection (counted; it reconnects)."""

MONITORED_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
)
"""The socket-monitor events a live SUB is watched for (connected, dropped, retrying)."""
_REDIAL_AFTER_S = 0.5
"""After a drop with no reconnect attempt by libzmq within this long, dial again."""
# A read of the live socket also stops once this many payload bytes were read: the
# messages of one read are decoded and held until the application takes them, and
# holding hundreds of large decoded batches at once costs more (cache misses, garbage
# collector passes over their lists) than the extra polls (measured:
# 64-event batches were delivered ~2x faster with reads of ~4 of them than of 256).
_DRAIN_BYTES = 64 << 10
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def _waiting(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits on ``sock``: asking ``ZMQ_EVENTS`` (about 1.4 us) is
    cheaper than a receive that raises ``zmq.Again`` (3-4 us; pyzmq builds the exception
    each time), so a read that usually finds nothing asks first."""
    return bool(int(sock.getsockopt(_EVENTS)) & _POLLIN)


class LiveLink:
    """The live side of a source: a SUB socket on a publisher's endpoint, its socket
    monitor and the redial after a drop that libzmq does not repair.

    The SUB (``ZMQ_LINGER`` 0, ``rcvhwm`` messages of receive high-water mark,
    ``ZMQ_MAXMSGSIZE`` ``max_message_size_bytes`` - 0 or None: no limit -, a CURVE
    client when ``curve`` is given) subscribes to ``topic`` (a prefix) and connects to
    ``endpoint``; it binds only to a wildcard address (``*``, ``0.0.0.0``, ``[::]``),
    for publishers that connect out, and :attr:`bound_endpoint` then holds the bound
    address.  ``monitor`` watches it for :data:`MONITORED_EVENTS`, which
    :meth:`connection_events` turns into :data:`CONNECTED` / :data:`DISCONNECTED`
    messages.  Read :attr:`sock` directly for the messages themselves.

    Raises :class:`~kvevents.errors.ConfigError` (``cannot open ...``, or the CURVE
    configuration's own) after closing what it opened.
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        endpoint: str,
        topic: bytes = b"",
        *,
        name: str | None = None,
        rcvhwm: int = 100_000,
        max_message_size_bytes: int | None = DEFAULT_MAX_MESSAGE_SIZE_BYTES,
        monitor: bool = True,
        curve: CurveClientConfig | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.name = name or endpoint
        """How the link's warnings name it (default: ``endpoint``)."""
        self.redial_at: float | None = None
        """When :meth:`maintain` dials again (monotonic seconds), or None."""
        self.bound_endpoint: str | None = None
        """The address the SUB bound (the real port for ``:0``); None when it connects."""
        self._closed = False
        try:
            sock: zmq.Socket[bytes] = context.socket(zmq.SUB)
        except zmq.ZMQError as exc:
            raise ConfigError(
                f"cannot open a socket for {endpoint!r}: {exc} (the ZMQ context's "
                "MAX_SOCKETS, or the process's open-file limit: `ulimit -n`)"
            ) from exc
        self.sock = sock
        """The SUB socket: read it (non-blocking) for the live messages."""
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_size_bytes or -1)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        try:
            apply_curve_client(sock, curve)
        except ConfigError:
            sock.close(0)
            raise
        enable_ipv6_if_needed(sock, endpoint)
        self.monitor: zmq.Socket[bytes] | None = (
            sock.get_monitor_socket(MONITORED_EVENTS) if monitor else None
        )
        """The SUB's monitor socket (None: not monitored)."""
        self.monitor_watched = False
        """Whether a waiter reports when the monitor's descriptor signals (by
        :meth:`monitor_signalled`): :meth:`connection_events` then reads the monitor only
        after such a report, not at every call."""
        self.monitor_due = self.monitor is not None
        """Whether :meth:`connection_events` would read the monitor: always, unless
        :attr:`monitor_watched` and not signalled since the last read (False without a
        monitor)."""
        try:
            if is_wildcard_endpoint(endpoint):
                sock.bind(endpoint)
                last = sock.getsockopt(zmq.LAST_ENDPOINT)
                self.bound_endpoint = last.decode() if isinstance(last, bytes) else str(last)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(f"cannot open {endpoint!r}: {exc}") from exc

    def sockets(self) -> list[Any]:
        """The sockets to poll: the SUB, then its monitor (none once closed)."""
        if self._closed:
            return []
        return [self.sock] if self.monitor is None else [self.sock, self.monitor]

    def connection_events(self, now: float) -> list[SourceMessage]:
        """Drain the monitor without blocking: a :data:`CONNECTED` message per handshake,
        a :data:`DISCONNECTED` one per drop, each stamped ``now`` (``time.time()``).  A
        drop of a connecting SUB sets :attr:`redial_at`; a handshake or libzmq's own
        reconnect attempt clears it."""
        out: list[SourceMessage] = []
        if self.monitor is None:
            return out
        if self.monitor_watched:
            if not self.monitor_due:
                return out
            self.monitor_due = False  # (drained below until empty)
        for event in drain_monitor_events(self.monitor):
            if event == zmq.EVENT_CONNECT_RETRIED:
                self.redial_at = None  # libzmq reconnects by itself
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.redial_at = None
                out.append(SourceMessage(CONNECTED, recv_ts=now))
            else:
                out.append(SourceMessage(DISCONNECTED, recv_ts=now))
                if self.bound_endpoint is None:
                    self.redial_at = time.monotonic() + _REDIAL_AFTER_S
        return out

    def monitor_signalled(self) -> None:
        """The monitor's descriptor signalled (or it was found with input): the next
        :meth:`connection_events` reads it, when :attr:`monitor_watched`."""
        if self.monitor is not None:
            self.monitor_due = True

    def maintain(self, now: float) -> None:
        """Dial again once :attr:`redial_at` is due (``now`` is ``time.monotonic()``):
        libzmq reconnects by itself after a network error but not after a protocol
        error (a frame over ``ZMQ_MAXMSGSIZE``), whose session is gone.  A failed dial
        is logged as a warning, not raised."""
        if self.redial_at is None or now < self.redial_at or self._closed:
            return
        self.redial_at = None
        try:
            self.sock.disconnect(self.endpoint)  # the ended session still holds the address
        except zmq.ZMQError:
            pass
        try:
            self.sock.connect(self.endpoint)
        except zmq.ZMQError as exc:  # pragma: no cover - the endpoint was valid before
            logger.warning("%s: cannot reconnect: %s", self.name, exc)

    def close(self) -> None:
        """Close the monitor and the SUB (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.monitor = None
            self.monitor_due = False
        self.sock.close(0)


class ZmqSource:
    """A vLLM-compatible publisher: SUB on ``endpoint``, DEALERs on its replay endpoints.

    The SUB connects (it binds only to a wildcard address - ``*``, ``0.0.0.0``, ``[::]``
    - for publishers that connect out; :attr:`bound_endpoint` then holds the bound
    address) and subscribes to ``topic`` (a prefix).  ``rcvhwm`` is the SUB's receive
    high-water mark in messages.

    Replay: ``replay_endpoint`` serves every topic; ``replay_by_topic`` maps a topic
    (str or bytes) to its own replay endpoint, for several engines behind one XSUB/XPUB
    proxy (each engine keeps its own ROUTER).  Each replay endpoint is a *channel*
    (:meth:`replay_channel`) with one DEALER, created on its first replay and closed
    (dropping replies in flight) by :meth:`cancel_replay`.  A reply without a topic
    frame (vLLM before 0.26) is tagged with the channel's topic.

    ``max_message_size_bytes`` (default :data:`DEFAULT_MAX_MESSAGE_SIZE_BYTES`; 0 or
    None: no limit) is set as ``ZMQ_MAXMSGSIZE`` on the SUB and every DEALER.  Connection events
    (a socket monitor) come out as :data:`CONNECTED` / :data:`DISCONNECTED` messages
    for the SUB and :data:`REPLAY_DISCONNECTED` for a DEALER, so the subscriber can
    check a stream's identity after a reconnect and resend a lost replay request.

    ``replay_rcvhwm`` bounds the replies queued on a DEALER (messages; ZMQ then stops
    reading that connection until they are consumed: flow control, not loss).
    ``curve`` (a :class:`~kvevents.security.CurveClientConfig`) makes the SUB and every
    DEALER CURVE clients of a publisher that requires authentication (off by default).
    """

    replay_inband = False
    """Replays come through replay endpoints, not as recorded live messages."""

    def __init__(
        self,
        endpoint: str,
        topic: bytes = b"",
        replay_endpoint: str | None = None,
        *,
        replay_by_topic: Mapping[str, str] | Mapping[bytes, str] | None = None,
        name: str | None = None,
        context: zmq.Context[Any] | None = None,
        rcvhwm: int = 100_000,
        max_message_size_bytes: int | None = DEFAULT_MAX_MESSAGE_SIZE_BYTES,
        monitor: bool = True,
        curve: CurveClientConfig | None = None,
        replay_rcvhwm: int = 1_000,
    ) -> None:
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ConfigError(f"not a ZMQ endpoint: {endpoint!r}")
        self._by_topic: dict[bytes, str] = {}
        for t, ep in (replay_by_topic or {}).items():
            self._by_topic[t.encode() if isinstance(t, str) else bytes(t)] = ep
        for rep in [replay_endpoint, *self._by_topic.values()]:
            if rep is not None and (not isinstance(rep, str) or "://" not in rep):
                raise ConfigError(f"not a ZMQ replay endpoint: {rep!r}")
        if max_message_size_bytes is not None and max_message_size_bytes < 0:
            raise ConfigError(f"max_message_size_bytes must be >= 0, got {max_message_size_bytes}")
        self.name = name or endpoint
        """The source's name: ``name``, else ``endpoint`` (read only)."""
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.max_message_size_bytes: int = max_message_size_bytes or -1
        """``ZMQ_MAXMSGSIZE`` of every socket (bytes; -1: no limit)."""
        self.replay_rcvhwm = replay_rcvhwm
        self._ctx = context if context is not None else zmq.Context.instance()
        self._curve = curve
        self._link = LiveLink(
            self._ctx,
            endpoint,
            topic,
            name=self.name,
            rcvhwm=rcvhwm,
            max_message_size_bytes=self.max_message_size_bytes,
            monitor=monitor,
            curve=curve,
        )
        self._sub = self._link.sock
        self._want_monitor = monitor
        self.bound_endpoint: str | None = self._link.bound_endpoint
        """The address the SUB bound (the real port for ``:0``); None when it connects."""
        # channel (replay endpoint) -> (DEALER, its monitor or None, topic for legacy replies)
        self._dealers: dict[str, tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None, bytes]] = {}
        self.exhausted = False
        """True once :meth:`close` ran (read only): a live source has no end."""
        self.read_settled = False
        """Whether the last :meth:`receive` left every socket of this source with its
        events read and nothing to read: each was read until empty (a receive that raised
        ``zmq.Again`` or a ``ZMQ_EVENTS`` without ``POLLIN``), none stopped at the read's
        budget (a read opens and closes no socket).  A waiter may then skip asking them
        again (see
        :class:`~kvevents.consumers.subscriber.waiting.SourceWaits`)."""

    @property
    def redial_at(self) -> float | None:
        """When :meth:`maintain` dials again (monotonic seconds), or None."""
        return self._link.redial_at

    @property
    def can_replay(self) -> bool:
        return self.replay_endpoint is not None or bool(self._by_topic)

    @property
    def monitored(self) -> bool:
        """Whether connection events (:data:`CONNECTED`, ...) are reported."""
        return self._want_monitor

    def replay_channel(self, topic: bytes = b"") -> str | None:
        """The replay endpoint that serves ``topic`` (None: no replay for it)."""
        return self._by_topic.get(topic, self.replay_endpoint)

    def replay_channels(self) -> dict[str, bytes]:
        """Every configured replay endpoint, with the topic it serves (``b""``: any)."""
        out = {ep: t for t, ep in self._by_topic.items()}
        if self.replay_endpoint is not None:
            out.setdefault(self.replay_endpoint, b"")
        return out

    def sockets(self) -> Sequence[Any]:
        if self.exhausted:
            return []
        out = self._link.sockets()
        for dealer, mon, _ in self._dealers.values():
            out.append(dealer)
            if mon is not None:
                out.append(mon)
        return out

    def watch_signals(self) -> list[Any]:
        """The sockets this source reads only when told that they signalled: the live
        connection's monitor, read at every :meth:`receive` until a waiter calls this
        and then after each :meth:`signalled` for it (one ``ZMQ_EVENTS`` less per read).
        A caller of this promises to call :meth:`signalled` whenever the monitor's
        descriptor signals or the monitor is found with input, before the next read."""
        mon = self._link.monitor
        if mon is None or self.exhausted:
            return []
        self._link.monitor_watched = True
        return [mon]

    def signalled(self, sock: Any) -> None:
        """``sock`` (one of :meth:`watch_signals`) signalled: read it at the next
        :meth:`receive`."""
        if sock is self._link.monitor:
            self._link.monitor_signalled()

    def receive(self, limit: int) -> list[SourceMessage]:
        self.read_settled = False
        if self.exhausted:
            return []
        now = time.time()
        # Connection events first: a reconnect must be known before what it delivered.
        link = self._link
        out = link.connection_events(now) if link.monitor_due else []
        # recv_multipart's own loop, without its per-frame getsockopt(RCVMORE) (which
        # builds a SocketOption enum each time): a Frame carries ``more`` already, and
        # ``.bytes`` is the one copy that recv_multipart makes too (about 3.5 against
        # 6 us per 3-frame message, measured on this traffic).
        sub = self._sub
        recv = sub.recv
        append = out.append
        from_bytes = int.from_bytes
        noblock = zmq.NOBLOCK
        again = zmq.Again
        budget = _DRAIN_BYTES
        settled = False  # (until the read finds the SUB empty)
        for i in range(limit):
            try:
                frame = recv(noblock, copy=False)
            except again:
                settled = True
                break
            frames = [frame.bytes]
            while frame.more:
                frame = recv(noblock, copy=False)
                frames.append(frame.bytes)
            if len(frames) == 3 and len(frames[1]) == 8:
                # (the codec's parse_live rule, inlined on the hot path: 3 frames, an
                # 8-byte big-endian seq; anything else is described by parse_live below)
                topic, seq, payload = frames
                append(SourceMessage(LIVE, topic, from_bytes(seq, "big"), payload, now))
                budget -= len(payload)
                if budget <= 0:
                    break
            else:
                append(
                    SourceMessage(
                        BAD_FRAME, recv_ts=now, detail=_live_error(frames), parts=tuple(frames)
                    )
                )
            # A live engine's batches mostly arrive one per read: after the first, ask
            # whether another waits rather than end the read with a raised zmq.Again.
            if i == 0 and not _waiting(sub):
                settled = True
                break
        if not self._dealers:
            self.read_settled = settled
            return out
        for channel, (dealer, mon, topic) in list(self._dealers.items()):
            # (a replay channel is idle between replays: ask before reading)
            left = limit if _waiting(dealer) else 0
            for _ in range(left):
                try:
                    frames = dealer.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    left = 0
                    break
                msg = _parse_replay(frames, now)
                msg.channel = channel
                if not msg.topic:
                    msg.topic = topic
                out.append(msg)
            if left:
                settled = False  # (stopped at the limit: more may wait)
            # After the replies: those already read arrived before the drop.
            if mon is not None:
                for event in drain_monitor_events(mon):
                    if event == zmq.EVENT_DISCONNECTED:
                        out.append(
                            SourceMessage(REPLAY_DISCONNECTED, topic, recv_ts=now, channel=channel)
                        )
        self.read_settled = settled
        return out

    def maintain(self, now: float) -> None:
        """Dial again when the live connection dropped and libzmq is not reconnecting:
        it reconnects by itself after a network error but not after a protocol error
        (a frame over ``max_message_size_bytes``), whose session is gone.  ``now`` is
        ``time.monotonic()``; :attr:`redial_at` says when this is due (None: never)."""
        self._link.maintain(now)

    def request_replay(self, start: int, topic: bytes = b"") -> None:
        channel = self.replay_channel(topic)
        if channel is None:
            raise ConfigError(f"{self.name}: no replay endpoint for topic {topic!r}")
        entry = self._dealers.get(channel)
        if entry is None:
            dealer, mon = self._open_dealer(channel)
            entry = self._dealers[channel] = (
                dealer,
                mon,
                self.replay_channels().get(channel, topic),
            )
        try:
            entry[0].send_multipart(pack_replay_request(start), zmq.NOBLOCK)
        except zmq.Again:
            # Not connected yet and nothing queued: the request is lost; the caller's
            # timeout reports it.
            logger.debug("%s: replay request not queued (endpoint unreachable)", self.name)

    def _open_dealer(self, channel: str) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        """A DEALER connected to ``channel`` and its monitor (None when unmonitored).
        Raises :class:`~kvevents.errors.ConfigError` (the CURVE keys cannot be read any
        more, the endpoint cannot be dialled) with both sockets closed."""
        dealer: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        mon: zmq.Socket[bytes] | None = None
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            # Bounded: beyond it ZMQ stops reading the connection (flow control, no
            # loss), so a peer that floods replies cannot grow this process's memory.
            dealer.setsockopt(zmq.RCVHWM, self.replay_rcvhwm)
            dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_size_bytes)
            apply_curve_client(dealer, self._curve)
            enable_ipv6_if_needed(dealer, channel)
            if self._want_monitor:
                mon = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            dealer.connect(channel)
        except BaseException as exc:
            if mon is not None:
                dealer.disable_monitor()
                mon.close(0)
            dealer.close(0)
            if isinstance(exc, zmq.ZMQError):
                raise ConfigError(f"{self.name}: cannot open {channel!r}: {exc}") from exc
            raise
        return dealer, mon

    def cancel_replay(self, topic: bytes | None = None) -> None:
        """Close the DEALER of ``topic``'s channel (None: every channel)."""
        channels = list(self._dealers) if topic is None else [self.replay_channel(topic)]
        for channel in channels:
            entry = self._dealers.pop(channel, None) if channel is not None else None
            if entry is not None:
                dealer, mon, _ = entry
                if mon is not None:
                    dealer.disable_monitor()
                    mon.close(0)
                dealer.close(0)

    def close(self) -> None:
        if not self.exhausted:
            self.exhausted = True
            self.cancel_replay()
            self._link.close()

    def __repr__(self) -> str:
        return f"ZmqSource({self.endpoint!r}, replay_endpoint={self.replay_endpoint!r})"


def drain_monitor_events(mon: zmq.Socket[bytes]) -> list[int]:
    """Drain a monitor socket without blocking: the event numbers."""
    out: list[int] = []
    if not _waiting(mon):  # (usually nothing: asked once per read of the source)
        return out
    while True:
        try:
            msg = recv_monitor_message(mon, zmq.NOBLOCK)
        except zmq.Again:
            return out
        out.append(int(msg["event"]))


def _live_error(frames: Sequence[bytes]) -> str:
    """What is wrong with a live message that is not ``[topic, seq(8 bytes), payload]``
    (the codec's :func:`~kvevents.codec.parse_live` says)."""
    try:
        parse_live(frames)
    except FrameError as exc:
        return str(exc)
    return "malformed live message"  # pragma: no cover - only called on a bad shape


def _parse_replay(frames: Sequence[bytes], now: float) -> SourceMessage:
    """A DEALER reply as a message (:func:`~kvevents.codec.parse_replay_reply`):
    ``[b"", topic, seq, payload]`` (0.26+) or ``[b"", seq, payload]`` (before 0.26); the
    end marker becomes :data:`REPLAY_END`, anything else a :data:`BAD_FRAME`."""
    try:
        reply = parse_replay_reply(frames)
    except FrameError as exc:
        return SourceMessage(
            BAD_FRAME, recv_ts=now, detail=f"replay reply: {exc}", parts=tuple(frames)
        )
    if reply.seq is None:
        return SourceMessage(REPLAY_END, reply.topic, -1, b"", now)
    return SourceMessage(REPLAY, reply.topic, reply.seq, reply.payload, now)
