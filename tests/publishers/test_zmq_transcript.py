"""The C§8.2 publisher transcript, on real sockets, plus replay edge cases (C§9.4-9.5)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from pubtest_helpers import dealer, read_replay, recv, removed_batch, subscribe, wait_until, warm_up

from kvevents.codec import END_SEQ, pack_seq, parse_replay_reply, unpack_seq
from kvevents.publishers import ZmqEventPublisher

TOPIC = b"kv@pod"


@pytest.fixture
def ctx() -> zmq.Context[Any]:
    return zmq.Context.instance()


@pytest.fixture
def transcript(ctx: zmq.Context[Any]) -> Iterator[tuple[ZmqEventPublisher, list[list[bytes]]]]:
    """vLLM's transcript setup: buffer_steps=3, topic kv@pod, 5 publishes of
    ``[BlockRemoved([i], "GPU")]`` at ``ts=i``.  PUB on inproc (a SUB connected and
    subscribed before the first send is guaranteed to see it, so seq 0 is observable
    without probes); replay ROUTER on TCP loopback."""
    pub = ZmqEventPublisher(
        endpoint=f"inproc://kv-transcript-{uuid.uuid4().hex}",
        replay_endpoint="tcp://*:0",
        buffer_steps=3,
        topic="kv@pod",
    )
    sub = subscribe(ctx, pub.endpoint)
    for i in range(5):
        pub.publish(removed_batch(i))
    live = [recv(sub) for _ in range(5)]
    yield pub, live
    sub.close()
    pub.shutdown()


def test_live_frames_are_topic_seq_payload_from_seq_zero(transcript: Any) -> None:
    _, live = transcript
    for i, frames in enumerate(live):
        assert len(frames) == 3
        assert frames[0] == TOPIC
        assert frames[1] == i.to_bytes(8, "big")
        assert msgspec.msgpack.decode(frames[2]) == [
            float(i),
            [{"type": "BlockRemoved", "block_hashes": [i], "medium": "GPU"}],
            0,
        ]


def test_dealer_replay_from_1_gets_the_buffered_tail_then_end_marker(
    ctx: zmq.Context[Any], transcript: Any
) -> None:
    pub, live = transcript
    client = dealer(ctx, pub.replay_endpoint)
    client.send_multipart([b"", pack_seq(1)])
    replies = read_replay(client)
    # Only 3 batches are buffered: seq 1 is gone, with no notice.
    assert replies[:-1] == [[b"", TOPIC, live[i][1], live[i][2]] for i in (2, 3, 4)]
    assert replies[-1] == [b"", b"", b"\xff" * 8, b""]
    assert replies[-1][2] == END_SEQ
    wait_until(lambda: pub.stats.replays_completed == 1)
    assert pub.stats.replay_requests == 1
    assert pub.stats.replay_batches_sent == 3
    client.close()


def test_req_client_reads_only_the_first_reply(ctx: zmq.Context[Any], transcript: Any) -> None:
    pub, live = transcript
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(pub.replay_endpoint.replace("0.0.0.0", "127.0.0.1"))
    req.send(pack_seq(0))
    assert recv(req) == [TOPIC, live[2][1], live[2][2]]
    # The REQ state machine now expects a send: the rest of the replay is unreadable.
    with pytest.raises(zmq.ZMQError):
        req.recv(zmq.NOBLOCK)
    req.close()


def test_start_beyond_newest_gets_only_the_end_marker(
    ctx: zmq.Context[Any], transcript: Any
) -> None:
    pub, _ = transcript
    client = dealer(ctx, pub.replay_endpoint)
    client.send_multipart([b"", pack_seq(99)])
    assert read_replay(client) == [[b"", b"", END_SEQ, b""]]
    client.close()


@pytest.mark.parametrize(
    ("bad_request", "reason"),
    [
        ([pack_seq(0)], "bad_frame_count"),  # vLLM's transcript case: no empty delimiter
        ([b"", pack_seq(0), b"extra"], "bad_frame_count"),  # too many frames
        # vLLM reads a start of any length; kvevents takes only its own 8-byte form, so
        # a huge frame is never parsed as an integer.
        ([b"", bytes.fromhex("00000004")], "bad_start_frame"),
        ([b"", b""], "bad_start_frame"),
        ([b"", b"\x01" * 9], "bad_start_frame"),
    ],
    ids=["no-delimiter", "four-frames", "four-byte-start", "empty-start", "nine-byte-start"],
)
def test_malformed_request_gets_no_reply_and_is_counted(
    ctx: zmq.Context[Any], transcript: Any, bad_request: list[bytes], reason: str
) -> None:
    pub, _ = transcript
    client = dealer(ctx, pub.replay_endpoint)
    client.send_multipart(bad_request)
    wait_until(lambda: pub.stats.malformed_requests == 1, what="malformed request counted")
    assert pub.stats.replay_refusals == {reason: 1}
    # A good request from the same client: the first thing it receives is the answer
    # to the good request, so the bad one got nothing.
    client.send_multipart([b"", pack_seq(4)])
    replies = read_replay(client)
    assert [unpack_seq(r[2]) for r in replies[:-1]] == [4]
    assert pub.stats.replay_requests == 1
    client.close()


@pytest.mark.parametrize(
    ("request_frames", "first_seq"),
    [
        ([b"x", pack_seq(3)], 3),  # C§2.2: the delimiter's content is not checked
        ([b"", pack_seq(0)], 2),  # older than the buffer: whatever is buffered
    ],
    ids=["non-empty-delimiter", "start-before-buffer"],
)
def test_any_three_frame_request_is_answered_as_vllm_does(
    ctx: zmq.Context[Any], transcript: Any, request_frames: list[bytes], first_seq: int
) -> None:
    pub, _ = transcript
    client = dealer(ctx, pub.replay_endpoint)
    client.send_multipart(request_frames)
    replies = read_replay(client)
    assert [unpack_seq(r[2]) for r in replies[:-1]] == list(range(first_seq, 5))
    assert replies[-1] == [b"", b"", b"\xff" * 8, b""]
    assert pub.stats.malformed_requests == 0
    client.close()


def test_replay_payloads_are_byte_identical_to_live(ctx: zmq.Context[Any], transcript: Any) -> None:
    pub, live = transcript
    client = dealer(ctx, pub.replay_endpoint)
    client.send_multipart([b"", pack_seq(0)])
    replayed = {unpack_seq(r[2]): r[3] for r in read_replay(client)[:-1]}
    assert replayed == {i: live[i][2] for i in (2, 3, 4)}
    client.close()


def test_buffer_evicts_oldest_beyond_buffer_steps(ctx: zmq.Context[Any]) -> None:
    with ZmqEventPublisher(
        endpoint="tcp://*:0", replay_endpoint="tcp://*:0", buffer_steps=100
    ) as pub:
        for i in range(110):
            pub.publish(removed_batch(i))
        wait_until(lambda: pub.stats.batches_published == 110)
        client = dealer(ctx, pub.replay_endpoint)
        client.send_multipart([b"", pack_seq(0)])
        replies = read_replay(client)
        assert [unpack_seq(r[2]) for r in replies[:-1]] == list(range(10, 110))
        first = parse_replay_reply(replies[0])
        assert msgspec.msgpack.decode(first.payload)[1][0]["block_hashes"] == [10]
        client.close()


def test_two_replays_from_one_client_are_answered_in_turn(ctx: zmq.Context[Any]) -> None:
    with ZmqEventPublisher(
        endpoint="tcp://*:0", replay_endpoint="tcp://*:0", buffer_steps=500, replay_slice=7
    ) as pub:
        for i in range(300):
            pub.publish(removed_batch(i))
        wait_until(lambda: pub.stats.batches_published == 300)
        client = dealer(ctx, pub.replay_endpoint)
        client.send_multipart([b"", pack_seq(0)])
        client.send_multipart([b"", pack_seq(250)])
        first = [unpack_seq(r[2]) for r in read_replay(client)[:-1]]
        second = [unpack_seq(r[2]) for r in read_replay(client)[:-1]]
        assert first == list(range(300))
        assert second == list(range(250, 300))
        client.close()


def test_no_replay_socket_without_replay_endpoint() -> None:
    with ZmqEventPublisher(endpoint="tcp://*:0") as pub:
        assert pub.replay_endpoint is None
        pub.publish(removed_batch(0))
        wait_until(lambda: pub.stats.batches_published == 1)


def test_live_frames_over_tcp_match_the_transcript(ctx: zmq.Context[Any]) -> None:
    """The same frames over TCP (after probes: a TCP subscriber joins asynchronously)."""
    with ZmqEventPublisher(
        endpoint="tcp://*:0", replay_endpoint="tcp://*:0", buffer_steps=1000, topic="kv@pod"
    ) as pub:
        sub = subscribe(ctx, pub.endpoint)
        n = warm_up(pub, sub)
        for i in range(5):
            pub.publish(removed_batch(i))
        for i in range(5):
            topic, seq, payload = recv(sub)
            assert (topic, unpack_seq(seq)) == (TOPIC, n + i)
            assert msgspec.msgpack.decode(payload) == [
                float(i),
                [{"type": "BlockRemoved", "block_hashes": [i], "medium": "GPU"}],
                0,
            ]
        # The probes too were numbered from 0: replay shows the very first batch.
        client = dealer(ctx, pub.replay_endpoint)
        client.send_multipart([b"", pack_seq(0)])
        assert [unpack_seq(r[2]) for r in read_replay(client)[:-1]] == list(range(n + 5))
        client.close()
        sub.close()
