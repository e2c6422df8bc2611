"""Frame helpers (C§2.1, C§2.2, C§9.4-9.6), checked on real ZMQ sockets."""

from __future__ import annotations

import pytest
import zmq

from kvevents import AllBlocksCleared, FrameError, KVEventBatch, decode_batch, encode_batch
from kvevents.codec import (
    END_SEQ,
    pack_live,
    pack_replay_end,
    pack_replay_reply,
    pack_replay_request,
    pack_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    unpack_seq,
)


def test_end_seq_is_minus_one_signed() -> None:
    assert END_SEQ == (-1).to_bytes(8, "big", signed=True) == b"\xff" * 8


def test_seq_is_8_byte_big_endian_unsigned() -> None:
    assert pack_seq(0) == b"\x00" * 8
    assert pack_seq(4) == bytes.fromhex("0000000000000004")
    assert unpack_seq(pack_seq(2**64 - 2)) == 2**64 - 2
    with pytest.raises(FrameError):
        unpack_seq(b"\x00\x01")
    with pytest.raises(OverflowError):
        pack_seq(-1)


def test_parse_live_requires_three_frames_and_8_byte_seq() -> None:
    msg = parse_live(pack_live(b"kv@pod", 3, b"p"))
    assert (msg.topic, msg.seq, msg.payload) == (b"kv@pod", 3, b"p")
    with pytest.raises(FrameError, match="3 frames"):
        parse_live([b"", pack_seq(1)])
    with pytest.raises(FrameError, match="8 bytes"):
        parse_live([b"", b"\x01", b"p"])


def test_replay_request_any_length_start() -> None:
    assert parse_replay_request([b"id", b"", bytes.fromhex("00000004")]) == (b"id", 4)
    with pytest.raises(FrameError):
        parse_replay_request([b"id", pack_seq(0)])  # no delimiter: vLLM ignores it
    # vLLM checks only the frame count: any middle frame, and an empty start (= 0).
    assert parse_replay_request([b"id", b"x", pack_seq(7)]) == (b"id", 7)
    assert parse_replay_request([b"id", b"", b""]) == (b"id", 0)


@pytest.mark.parametrize(
    ("frames", "seq", "topic"),
    [
        ([b"", b"kv", pack_seq(7), b"p"], 7, b"kv"),  # DEALER, 0.26+
        ([b"", pack_seq(7), b"p"], 7, b""),  # DEALER, pre-0.26
        ([b"kv", pack_seq(7), b"p"], 7, b"kv"),  # REQ, 0.26+
        ([pack_seq(7), b"p"], 7, b""),  # REQ, pre-0.26
    ],
)
def test_replay_reply_layouts(frames: list[bytes], seq: int, topic: bytes) -> None:
    r = parse_replay_reply(frames)
    assert (r.seq, r.topic, r.payload, r.is_end) == (seq, topic, b"p", False)


@pytest.mark.parametrize(
    "frames",
    [[b"", b"", END_SEQ, b""], [b"", END_SEQ, b""], [END_SEQ, b""]],
)
def test_replay_end_marker_with_and_without_topic(frames: list[bytes]) -> None:
    assert parse_replay_reply(frames).is_end


def test_replay_reply_bad_layouts() -> None:
    with pytest.raises(FrameError):
        parse_replay_reply([b"x"])
    with pytest.raises(FrameError):
        parse_replay_reply([b"not-empty", b"kv", pack_seq(1), b"p"])


def test_frames_over_real_sockets() -> None:
    """A DEALER/ROUTER exchange and a PUB/SUB message built only from the helpers."""
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart(pack_replay_request(5))
        assert router.poll(5000)
        identity, start = parse_replay_request(router.recv_multipart())
        assert start == 5
        payload = encode_batch(KVEventBatch(1.0, [AllBlocksCleared()], 0))
        router.send_multipart(pack_replay_reply(identity, b"t", 5, payload))
        router.send_multipart(pack_replay_end(identity))
        assert dealer.poll(5000)
        first = parse_replay_reply(dealer.recv_multipart())
        assert first.seq == 5 and decode_batch(first.payload).events == [AllBlocksCleared()]
        assert dealer.poll(5000)
        assert parse_replay_reply(dealer.recv_multipart()).is_end

        pub = ctx.socket(zmq.PUB)
        pport = pub.bind_to_random_port("tcp://127.0.0.1")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{pport}")
        # PUB drops until the subscription arrives: resend until the SUB sees one.
        for _ in range(500):
            pub.send_multipart(pack_live(b"", 0, payload))
            if sub.poll(10):
                break
        msg = parse_live(sub.recv_multipart())
        assert msg.seq == 0 and msg.payload == payload
    finally:
        ctx.destroy(linger=0)
