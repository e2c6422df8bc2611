"""The ZMQ frames of the live stream and of replay (vLLM's layouts).

One job: build and parse the live message ``[topic, seq, payload]``, the replay request
``[identity, b"", start]`` and the replay replies, including the end marker
(:data:`END_SEQ`).  Imports only the errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvevents.errors import FrameError

__all__ = [
    "END_SEQ",
    "LiveMessage",
    "ReplayReply",
    "pack_live",
    "pack_replay_end",
    "pack_replay_reply",
    "pack_replay_request",
    "pack_seq",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "unpack_seq",
]

END_SEQ: bytes = b"\xff" * 8
"""The seq frame of the replay end marker: ``(-1).to_bytes(8, "big", signed=True)``."""


def pack_seq(seq: int) -> bytes:
    """``seq`` as the 8-byte big-endian unsigned frame."""
    return seq.to_bytes(8, "big")


def unpack_seq(frame: bytes) -> int:
    """Read a live seq frame; it must be exactly 8 bytes (raises :class:`FrameError`)."""
    if len(frame) != 8:
        raise FrameError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


@dataclass(frozen=True)
class LiveMessage:
    """One live PUB message: ``[topic, seq, payload]``."""

    topic: bytes
    seq: int
    payload: bytes


def pack_live(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three frames of a live message."""
    return [topic, pack_seq(seq), payload]


def parse_live(frames: Sequence[bytes]) -> LiveMessage:
    """Parse a live message; exactly 3 frames with an 8-byte seq, else :class:`FrameError`."""
    if len(frames) != 3:
        raise FrameError(
            f"live message must have 3 frames [topic, seq, payload], got {len(frames)}"
        )
    topic, seq, payload = frames
    return LiveMessage(bytes(topic), unpack_seq(seq), bytes(payload))


def pack_replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to ask for every buffered batch with seq ≥ ``start_seq``."""
    return [b"", pack_seq(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int]:
    """Parse a request as a ROUTER receives it: ``[identity, b"", start]``.

    As in vLLM's ``ZmqEventPublisher._service_replay`` only the frame count is checked: the
    middle (delimiter) frame is not inspected, and ``start`` is big-endian unsigned of any
    length (a 4-byte value works; an empty frame reads as 0).  Returns ``(identity,
    start_seq)``; any other frame count raises :class:`FrameError`.
    """
    if len(frames) != 3:
        raise FrameError(
            f"replay request must have 3 frames [identity, b'', start], got {len(frames)}"
        )
    identity, _delimiter, start = frames
    return bytes(identity), int.from_bytes(start, "big")


def pack_replay_reply(identity: bytes, topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One replayed batch as the ROUTER sends it (0.26+ layout, with the topic frame)."""
    return [identity, b"", topic, pack_seq(seq), payload]


def pack_replay_end(identity: bytes) -> list[bytes]:
    """The end-of-replay marker as the ROUTER sends it."""
    return [identity, b"", b"", END_SEQ, b""]


@dataclass(frozen=True)
class ReplayReply:
    """One reply a replay client received.  ``seq`` is ``None`` for the end marker."""

    seq: int | None
    topic: bytes
    payload: bytes

    @property
    def is_end(self) -> bool:
        return self.seq is None


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayReply:
    """Parse a replay reply as a DEALER (or REQ) receives it.

    Accepted layouts: ``[b"", topic, seq, payload]`` (DEALER, 0.26+),
    ``[b"", seq, payload]`` (DEALER before 0.26, or REQ 0.26+ with an empty topic),
    ``[seq, payload]`` (REQ before 0.26).  The end marker has ``END_SEQ`` as its seq;
    an empty payload also ends the replay.  Anything else raises :class:`FrameError`.
    """
    n = len(frames)
    if n == 4:
        if frames[0]:
            raise FrameError("replay reply must start with an empty delimiter frame")
        topic, seq_frame, payload = frames[1], frames[2], frames[3]
    elif n == 3:
        topic, seq_frame, payload = frames[0], frames[1], frames[2]
    elif n == 2:
        topic, seq_frame, payload = b"", frames[0], frames[1]
    else:
        raise FrameError(f"replay reply must have 2 to 4 frames, got {n}")
    if bytes(seq_frame) == END_SEQ or not payload:
        return ReplayReply(None, bytes(topic), b"")
    return ReplayReply(unpack_seq(seq_frame), bytes(topic), bytes(payload))
