"""What ``kvevents record`` writes: every frame a publisher sends, byte for byte, in the
order it arrives, before anything decodes it.

:class:`FrameRecorder` writes frames to a capture and marks the ones that are not good
batches (:data:`~kvevents.capture.FLAG_MALFORMED`: not ``[topic, seq, payload]``;
:data:`~kvevents.capture.FLAG_UNDECODABLE`: a payload that does not decode).

:class:`RecordingSource` is the subscriber's source while recording: it reads the
publisher's live stream on its own SUB socket, hands every message to the recorder as it
is read (malformed ones included: a normal source keeps no bytes of those), then relays
it unchanged over an in-process link to a :class:`~kvevents.consumers.ZmqSource`, which
parses it exactly as it would off the network and owns the replay (DEALER) side.  So the
subscriber on top sees the same stream and repairs gaps the same way, while the capture
holds the frames in arrival order rather than in the order the subscriber delivers them
after a replay.  Replay replies are written as the source reads them (flagged
``replayed``); a malformed reply is written flagged, with every part byte for byte, and
the end of a replay as an end marker (seq -1, empty payload, flagged ``replayed``).
Connection events of the relay link are dropped and those of the live socket reported in
their place.

May import pyzmq, :mod:`kvevents.capture`, :mod:`kvevents.codec`,
:mod:`kvevents.endpoints` and the public names of :mod:`kvevents.consumers`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import zmq

from kvevents.capture import FLAG_MALFORMED, FLAG_UNDECODABLE, CaptureWriter, pack_parts
from kvevents.capture_account import COPY, SeqLedger
from kvevents.codec import BatchDecoder
from kvevents.consumers.source_protocol import (
    BAD_FRAME,
    CONNECTED,
    DISCONNECTED,
    REPLAY,
    REPLAY_END,
    SourceMessage,
)
from kvevents.consumers.subscriber import worker_source
from kvevents.consumers.zmq_source import DEFAULT_MAX_MESSAGE_SIZE_BYTES, LiveLink, ZmqSource
from kvevents.errors import CaptureError, ConfigError, DecodeError

__all__ = ["FrameRecorder", "RecordingSource"]

_RELAY_IDS = itertools.count()


class FrameRecorder:
    """Writes raw frames to :attr:`writer` as they arrive and counts them.  The writer
    may be attached after the sources are opened, but before anything is received.

    ``max_batches`` (None: no bound) stops the recording after that many distinct good
    batches (frames that decode, live or replayed; a copy of a batch already written,
    the same seq of the same worker with the same payload, is written but not counted
    again): later frames are not written and :attr:`full` turns true.  Counters:
    :attr:`batches` and :attr:`events` (distinct good batches and their events),
    :attr:`copies` (copies written), :attr:`undecodable` and :attr:`malformed` (frames
    kept and flagged), :attr:`replay_ends` (replay end markers written)."""

    def __init__(self, writer: CaptureWriter | None = None, max_batches: int | None = None) -> None:
        self.writer = writer
        self.max_batches = max_batches
        self.batches = 0
        self.events = 0
        self.copies = 0
        self.undecodable = 0
        self.malformed = 0
        self.replay_ends = 0
        self._decoder = BatchDecoder()
        self._ledger = SeqLedger()

    @property
    def full(self) -> bool:
        """True once ``max_batches`` good batches are written."""
        return self.max_batches is not None and self.batches >= self.max_batches

    def live(self, name: str, parts: Sequence[bytes], recv_ts: float) -> None:
        """A multipart message read from the live socket of source ``name``."""
        if len(parts) == 3 and len(parts[1]) == 8:
            topic, seq, payload = parts[0], int.from_bytes(parts[1], "big"), parts[2]
            self._batch(worker_source(name, topic), topic, seq, payload, recv_ts, False)
        else:
            self._malformed(name, parts[0] if parts else b"", list(parts), recv_ts, False)

    def replayed(self, name: str, msg: SourceMessage) -> None:
        """A message a replay (DEALER) socket of source ``name`` returned: a
        :data:`~kvevents.consumers.source_protocol.REPLAY` batch, a malformed reply or the replay's
        end marker."""
        if msg.kind == REPLAY:
            topic = msg.topic
            self._batch(worker_source(name, topic), topic, msg.seq, msg.payload, msg.recv_ts, True)
        elif msg.kind == BAD_FRAME:
            self._malformed(name, msg.topic, list(msg.parts), msg.recv_ts, True)
        elif msg.kind == REPLAY_END and not self.full:
            # the replay's end marker: seq -1, an empty payload, flagged replayed (a
            # reader ends the recorded replay there, as the live subscriber did)
            topic = msg.topic
            self._out().write(
                worker_source(name, topic), topic, -1, b"", recv_ts=msg.recv_ts, replayed=True
            )
            self.replay_ends += 1

    def _out(self) -> CaptureWriter:
        if self.writer is None:  # a caller's mistake: frames must never be dropped
            raise CaptureError("FrameRecorder: no capture writer attached")
        return self.writer

    def _batch(
        self, source: str, topic: bytes, seq: int, payload: bytes, recv_ts: float, replayed: bool
    ) -> None:
        if self.full:
            return
        try:
            batch = self._decoder.decode(payload)
            flags = 0
        except DecodeError:
            batch = None
            flags = FLAG_UNDECODABLE
        self._out().write(
            source, topic, seq, payload, recv_ts=recv_ts, replayed=replayed, flags=flags
        )
        if batch is None:
            self.undecodable += 1
            return
        worker = f"{source}#{batch.data_parallel_rank or 0}"
        if self._ledger.observe(worker, seq, hash(payload), replayed) == COPY:
            self.copies += 1
        else:
            self.batches += 1
            self.events += len(batch.events)

    def _malformed(
        self, source: str, topic: bytes, parts: list[bytes], recv_ts: float, replayed: bool
    ) -> None:
        if self.full:
            return
        self._out().write(
            source,
            topic,
            -1,
            pack_parts(parts),
            recv_ts=recv_ts,
            replayed=replayed,
            flags=FLAG_MALFORMED,
        )
        self.malformed += 1


class RecordingSource:
    """A subscriber source that records every frame of one publisher as it arrives (see
    the module docstring).

    ``endpoint`` is connected to, or bound when it is a wildcard address
    (``tcp://*:PORT``; :attr:`bound_endpoint` then holds the address); ``topic`` is the
    subscribed prefix; ``replay_endpoint`` / ``replay_by_topic`` are the publisher's
    replay endpoints, as for :class:`~kvevents.consumers.ZmqSource`.  Frames go to
    ``recorder`` before the subscriber sees them.  Implements the subscriber's source
    protocol, its optional replay-channel and reconnect parts included."""

    def __init__(
        self,
        endpoint: str,
        recorder: FrameRecorder,
        topic: bytes = b"",
        replay_endpoint: str | None = None,
        *,
        replay_by_topic: Mapping[str, str] | None = None,
        context: zmq.Context[Any] | None = None,
        rcvhwm: int = 100_000,
        max_message_size_bytes: int = DEFAULT_MAX_MESSAGE_SIZE_BYTES,
        relay_timeout_s: float = 10.0,
    ) -> None:
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ConfigError(f"not a ZMQ endpoint: {endpoint!r}")
        self.endpoint = endpoint
        self.recorder = recorder
        self._closed = False
        self.connected = False
        """Whether the live socket completed a handshake with a publisher (or, listening,
        an engine connected)."""
        self.frames = 0
        """Messages read from this publisher (live and replayed)."""
        ctx = context if context is not None else zmq.Context.instance()
        # The live socket (connection events and redial included); it closes what it
        # opened and raises ConfigError when it cannot open.
        self._link = LiveLink(
            ctx, endpoint, topic, rcvhwm=rcvhwm, max_message_size_bytes=max_message_size_bytes
        )
        self._live = self._link.sock
        self.bound_endpoint: str | None = self._link.bound_endpoint
        """The address the live socket bound (the real port for ``:0``); None when it
        connects."""
        # The relay: every message read is passed on unchanged, nothing dropped (no
        # high-water mark: it is drained by the same thread right after).
        self._relay: zmq.Socket[bytes] = ctx.socket(zmq.XPUB)
        self._relay.setsockopt(zmq.LINGER, 0)
        self._relay.setsockopt(zmq.SNDHWM, 0)
        relay_ep = f"inproc://kvevents-record-{next(_RELAY_IDS)}-{id(self):x}"
        self._inner: ZmqSource | None = None
        try:
            self._relay.bind(relay_ep)
            self._inner = ZmqSource(
                relay_ep,
                b"",
                replay_endpoint,
                replay_by_topic=replay_by_topic,
                name=endpoint,
                context=ctx,
                rcvhwm=0,
                max_message_size_bytes=max_message_size_bytes,
            )
            # The relay's subscriber has joined once its subscription reaches the relay;
            # from then on nothing passed on is dropped.
            if not self._relay.poll(int(relay_timeout_s * 1000)):
                raise ConfigError(f"{endpoint}: the recorder's in-process relay did not start")
            self._relay.recv()
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(f"cannot open {endpoint!r}: {exc}") from exc
        except ConfigError:
            self.close()
            raise

    def _source(self) -> ZmqSource:
        if self._inner is None:  # pragma: no cover - only while constructing
            raise ConfigError(f"{self.endpoint}: the recorder is closed")
        return self._inner

    @property
    def redial_at(self) -> float | None:
        """When :meth:`maintain` dials the live socket again (monotonic seconds), or None."""
        return self._link.redial_at

    # --- the source protocol ----------------------------------------------------------
    @property
    def name(self) -> str:
        return self.endpoint

    @property
    def can_replay(self) -> bool:
        return self._source().can_replay

    @property
    def replay_inband(self) -> bool:
        return False

    @property
    def exhausted(self) -> bool:
        return self._closed

    @property
    def monitored(self) -> bool:
        """Connection events of the live socket are reported (always)."""
        return True

    def sockets(self) -> Sequence[Any]:
        if self._closed:
            return []
        return [*self._link.sockets(), *self._source().sockets()]

    def receive(self, limit: int) -> list[SourceMessage]:
        """Up to about ``limit`` messages: each live message is recorded as it is read
        from the network, then parsed by the ZMQ source; replay replies are recorded as
        the ZMQ source returns them."""
        if self._closed:
            return []
        now = time.time()
        out = self._link.connection_events(now)  # a reconnect is known before what it brought
        if any(m.kind == CONNECTED for m in out):
            self.connected = True
        for _ in range(limit):
            try:
                parts = self._live.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.recorder.live(self.endpoint, parts, now)
            self.frames += 1
            self._relay.send_multipart(parts)
        for msg in self._source().receive(limit):
            if msg.kind in (CONNECTED, DISCONNECTED):
                continue  # the in-process relay link, not the publisher's
            if msg.channel:  # from a replay endpoint
                self.recorder.replayed(self.endpoint, msg)
                self.frames += 1
            out.append(msg)
        return out

    def maintain(self, now: float) -> None:
        """Dial the live socket again when its connection dropped and libzmq is not
        reconnecting (after a protocol error, such as a frame over the size limit).
        ``now`` is ``time.monotonic()``."""
        self._link.maintain(now)

    def replay_channel(self, topic: bytes = b"") -> str | None:
        """The replay endpoint that serves ``topic`` (None: no replay for it)."""
        return self._source().replay_channel(topic)

    def replay_channels(self) -> dict[str, bytes]:
        """Every configured replay endpoint, with the topic it serves."""
        return self._source().replay_channels()

    def request_replay(self, start: int, topic: bytes = b"") -> None:
        self._source().request_replay(start, topic)

    def cancel_replay(self, topic: bytes | None = None) -> None:
        self._source().cancel_replay(topic)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._inner is not None:
            self._inner.close()
        self._relay.close(0)
        self._link.close()

    def __repr__(self) -> str:
        return f"RecordingSource({self.endpoint!r})"
