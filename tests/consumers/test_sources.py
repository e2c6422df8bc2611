"""Sources: capture files read through the same Subscriber API as live endpoints."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _zmq_helpers import FaultyPublisher, drain, make_batch, summarize

from kvevents.capture import CaptureWriter
from kvevents.codec import encode_batch
from kvevents.consumers import (
    Anomaly,
    CaptureSource,
    ReceivedBatch,
    Source,
    Subscriber,
    ZmqSource,
)
from kvevents.errors import CaptureError, ConfigError

pytestmark = pytest.mark.timeout(30)


def view(items: list[object]) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for i in items:
        if isinstance(i, ReceivedBatch):
            out.append(("B", i.source, i.dp_rank, i.seq, i.replayed, i.topic, i.payload))
        elif isinstance(i, Anomaly):
            out.append((i.kind, i.source, i.first_seq, i.last_seq))
    return out


def test_sources_satisfy_the_protocol(tmp_path):
    path = tmp_path / "empty.kvcap"
    CaptureWriter(path).close()
    cap = CaptureSource(str(path))
    zs = ZmqSource("tcp://127.0.0.1:1")
    try:
        assert isinstance(cap, Source) and isinstance(zs, Source)
        assert cap.replay_inband and not cap.can_replay
        assert not zs.can_replay and zs.name == "tcp://127.0.0.1:1"
        with pytest.raises(ConfigError):
            zs.request_replay(0)
    finally:
        cap.close()
        zs.close()


def test_recorded_session_reads_back_as_the_same_stream(tmp_path):
    """Record what a live subscriber yields (gap repaired by replay, a loss), then read
    the capture through a Subscriber: same batches, same flags, the loss reported again."""
    path = tmp_path / "session.kvcap"
    with (
        FaultyPublisher(buffer_steps=4) as pub,
        Subscriber(pub.endpoint, replay_endpoints=[pub.replay_endpoint]) as sub,
    ):
        pub.wait_for_subscribers()
        pub.publish_many((make_batch(i) for i in range(6)), skip={2})
        live = drain(sub, lambda it: any(getattr(x, "seq", -1) == 5 for x in it))
        pub.publish_many((make_batch(i) for i in range(6, 14)), skip=range(6, 11))
        live += drain(sub, lambda it: any(getattr(x, "seq", -1) == 13 for x in it))
    assert "unrecoverable_loss(6..9)" in summarize(live)
    with CaptureWriter(tmp_path / "session.kvcap") as w:
        for it in live:
            if isinstance(it, ReceivedBatch):
                w.write(
                    it.source,
                    it.topic,
                    it.seq,
                    it.payload,
                    recv_ts=it.recv_ts,
                    replayed=it.replayed,
                )
    with Subscriber(f"capture:{path}") as replayed_sub:
        again = list(replayed_sub)
    assert [x for x in view(again) if x[0] == "B"] == [x for x in view(live) if x[0] == "B"]
    losses = [x for x in view(again) if x[0] == "unrecoverable_loss"]
    assert losses == [("unrecoverable_loss", pub.endpoint, 6, 9)]
    assert [b.recv_ts for b in again if isinstance(b, ReceivedBatch)] == [
        b.recv_ts for b in live if isinstance(b, ReceivedBatch)
    ]


def test_raw_frame_capture_with_interleaved_replay_is_merged(tmp_path):
    """A capture of raw frames: live 0, 1, 4, 5, then the replayed 2..5 that answered."""
    path = tmp_path / "raw.kvcap"
    payloads = {i: encode_batch(make_batch(i)) for i in range(7)}
    with CaptureWriter(path) as w:
        for i in (0, 1, 4, 5):
            w.write("engine", b"t", i, payloads[i])
        for i in (2, 3, 4, 5):
            w.write("engine", b"t", i, payloads[i], replayed=True)
        w.write("engine", b"", -1, b"", replayed=True)  # the recorded end marker
        w.write("engine", b"t", 6, payloads[6])
    with Subscriber(CaptureSource(str(path))) as sub:
        items = list(sub)
    assert summarize(items) == ["B0", "B1", "gap(2..3)", "B2r", "B3r", "B4", "B5", "B6"]
    assert [i.payload for i in items if isinstance(i, ReceivedBatch)] == [
        payloads[i] for i in range(7)
    ]
    assert sub.stats.dropped["replay_overlap"] == 2


def test_capture_with_many_sources_and_bad_records(tmp_path):
    path = tmp_path / "multi.kvcap"
    with CaptureWriter(path) as w:
        for i in range(3):
            w.write("a", b"", i, encode_batch(make_batch(i)))
            w.write("b", b"", i, encode_batch(make_batch(i, rank=1)))
        w.write("a", b"", 3, b"\xc1garbage")
        w.write("a", b"", -1, b"not an end marker")
        w.write("a", b"", 4, encode_batch(make_batch(4)))
    with open(path, "ab") as fh:
        fh.write(b"\x00\x00\x01")  # a truncated tail
    src = CaptureSource(str(path))
    with Subscriber(src) as sub:
        items = list(sub)
    assert src.tail_error is not None and "truncated" in src.tail_error
    assert [(b.source, b.dp_rank, b.seq) for b in items if isinstance(b, ReceivedBatch)] == [
        ("a", 0, 0),
        ("b", 1, 0),
        ("a", 0, 1),
        ("b", 1, 1),
        ("a", 0, 2),
        ("b", 1, 2),
        ("a", 0, 4),
    ]
    kinds = [(a.kind, a.source) for a in items if isinstance(a, Anomaly)]
    assert kinds == [
        ("undecodable", "a"),
        ("bad_frame", "a"),
        ("gap", "a"),
        ("unrecoverable_loss", "a"),
    ]


def test_not_a_capture_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.kvcap"
    bad.write_bytes(b"hello")
    with pytest.raises(CaptureError, match="not a kvevents capture"):
        Subscriber(str(bad))
