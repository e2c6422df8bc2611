"""``kvevents record`` keeps every frame it receives, in the order received, before
decoding: messages with the wrong number of parts, a seq part of the wrong size and
payloads that do not decode are written flagged between the good batches; ``inspect``
reports them, ``replay --into-index`` and ``replay --publish`` skip them and lose no good
batch.  Real processes on real ZMQ sockets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest
import zmq

import kvevents.consumers as consumers
from kvevents.capture import CaptureWriter, read_capture, unpack_parts
from kvevents.cli import main
from kvevents.codec import encode_batch, pack_live
from tests.consumers._zmq_helpers import make_batch

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

GOOD = [encode_batch(make_batch(i)) for i in range(4)]
GARBAGE = b"\xc1 not a batch"
# What the publisher sends, in order: (the parts, what the capture must mark it as).
SENT: list[tuple[list[bytes], str]] = [
    (pack_live(b"kv", 0, GOOD[0]), "good"),
    ([b"kv", (7).to_bytes(8, "big")], "malformed"),  # 2 parts
    (pack_live(b"kv", 1, GOOD[1]), "good"),
    ([b"kv", (2).to_bytes(8, "big"), GOOD[2], b"trailer"], "malformed"),  # 4 parts
    (pack_live(b"kv", 2, GARBAGE), "undecodable"),
    ([b"kv-only-one-part"], "malformed"),  # 1 part
    ([b"kv", b"\x00\x03", GOOD[3]], "malformed"),  # a 2-byte seq
    (pack_live(b"kv", 3, GOOD[3]), "good"),
]


def record_sent(tmp_path: Path) -> tuple[Path, str]:
    """Run ``kvevents record --count 3`` against an XPUB sending :data:`SENT`."""
    ep = f"ipc://{tmp_path}/raw.ipc"
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)  # an XPUB tells us when the recorder has subscribed
    pub.setsockopt(zmq.LINGER, 1000)
    pub.bind(ep)
    out = tmp_path / "raw.kvcap"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvevents", "record", ep, "-o", str(out), "--count", "3"],
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert pub.poll(30_000), "the recorder never subscribed"
        pub.recv()
        for parts, _ in SENT:
            pub.send_multipart(parts)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close()
    assert proc.returncode == 0, err
    return out, err


def test_record_keeps_every_frame_in_arrival_order_flagged(tmp_path: Path) -> None:
    out, err = record_sent(tmp_path)
    cap = read_capture(out)
    assert cap.tail_error is None
    recs = cap.records
    assert len(recs) == len(SENT)
    kinds = [
        "malformed" if r.malformed else "undecodable" if r.undecodable else "good" for r in recs
    ]
    assert kinds == [k for _, k in SENT]
    for rec, (parts, kind) in zip(recs, SENT):
        if kind == "malformed":
            assert rec.seq == -1 and unpack_parts(rec.payload) == parts  # byte for byte
        else:
            assert (rec.topic, rec.seq, rec.payload) == (
                parts[0],
                int.from_bytes(parts[1], "big"),
                parts[2],
            )
        assert rec.source == f"ipc://{tmp_path}/raw.ipc#kv" or rec.malformed
    assert [r.recv_ts for r in recs] == sorted(r.recv_ts for r in recs)
    assert "3 batches" in err and "1 undecodable frame(s) kept" in err
    assert "4 malformed message(s) kept" in err
    assert err.count("anomaly bad_frame") == 4 and "anomaly undecodable" in err


def test_inspect_and_replay_of_a_raw_capture(tmp_path: Path) -> None:
    out, _ = record_sent(tmp_path)
    good_events = sum(len(make_batch(i).events) for i in (0, 1, 3))

    res = subprocess.run(
        [sys.executable, "-m", "kvevents", "inspect", str(out)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == good_events
    err = res.stderr.splitlines()
    assert sum("malformed message" in line for line in err) == 4, res.stderr
    assert any("2 part(s)" in line for line in err) and any("4 part(s)" in line for line in err)
    assert any("seq part has 2 bytes" in line for line in err)
    assert any(line.startswith("undecodable frame seq=2 ") for line in err)

    res = subprocess.run(
        [sys.executable, "-m", "kvevents", "inspect", str(out), "--summary", "--json"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    summary = json.loads(res.stdout)
    assert (summary["records"], summary["batches"], summary["events"]) == (8, 3, good_events)
    assert (summary["malformed"], summary["undecodable"]) == (4, 1)

    # replay into an index: the malformed records are reported and change nothing else;
    # the index is what the same capture without them gives
    without = tmp_path / "without-malformed.kvcap"
    with CaptureWriter(without) as w:
        for rec in read_capture(out).records:
            if not rec.malformed:
                w.write_record(rec)

    def into_index(path: Path) -> dict[str, Any]:
        res = subprocess.run(
            [sys.executable, "-m", "kvevents", "replay", str(path), "--into-index", "--json"],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        return cast("dict[str, Any]", json.loads(res.stdout))

    got, ref = into_index(out), into_index(without)
    kinds = [a["kind"] for a in got["anomalies"]]
    assert kinds.count("bad_frame") == 4 and kinds.count("undecodable") == 1
    assert [a for a in got["anomalies"] if a["kind"] != "bad_frame"] == ref["anomalies"]
    assert got["stats"]["batches"] == ref["stats"]["batches"] == 3  # every good batch applied
    assert got["workers"] == ref["workers"] and got["workers"][0]["tiers"]["GPU"]["entries"] > 0


def republish(capture: Path, endpoint: str, n: int) -> tuple[list[int], list[bytes]]:
    """Run ``kvevents replay CAPTURE --publish ENDPOINT --max-rate`` with a subscriber on
    it: the command's exit status and the payloads of the first ``n`` batches received."""
    sub = consumers.Subscriber([endpoint])
    rc: list[int] = []
    args = ["replay", str(capture), "--publish", endpoint, "--max-rate", "--wait-subscribers", "1"]
    runner = threading.Thread(target=lambda: rc.append(main([*args, "-q"])))
    runner.start()
    got: list[bytes] = []
    try:
        deadline = time.monotonic() + 20
        while len(got) < n and time.monotonic() < deadline:
            item = sub.receive(timeout=0.1)
            if isinstance(item, consumers.ReceivedBatch):
                got.append(item.payload)
    finally:
        sub.close()
        runner.join(timeout=30)
    return rc, got


def test_replay_publish_of_a_raw_capture_sends_the_good_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = record_sent(tmp_path)
    rc, got = republish(out, f"ipc://{tmp_path}/again.ipc", 3)
    assert rc == [0]
    assert got == [GOOD[0], GOOD[1], GOOD[3]]
    err = capsys.readouterr().err
    assert "republished 3 batches" in err and "skipped 5 (malformed x4, undecodable x1)" in err


def test_an_arrival_order_capture_reads_back_in_stream_order(tmp_path: Path) -> None:
    """Replies to a replay arrive after live batches that overtook them, some
    interleaved: the reader merges them back, nothing lost, nothing applied twice."""
    path = tmp_path / "arrival.kvcap"
    arrival = [(0, False), (3, False), (4, False), (0, True), (1, True), (5, False)]
    arrival += [(2, True), (6, False)]
    with CaptureWriter(path) as w:
        for seq, replayed in arrival:
            w.write("tcp://e:1", b"", seq, encode_batch(make_batch(seq)), replayed=replayed)
    sub = consumers.Subscriber([consumers.CaptureSource(str(path))])
    got: list[int] = []
    kinds: list[str] = []
    try:
        while (item := sub.receive(timeout=5)) is not None:
            if isinstance(item, consumers.ReceivedBatch):
                got.append(item.seq)
            else:
                kinds.append(item.kind)
    finally:
        sub.close()
    assert got == list(range(7))
    assert kinds == ["gap"]


def test_a_malformed_replay_reply_is_recorded_with_every_part(tmp_path: Path) -> None:
    """A replay reply without the ``[b"", (topic,) seq, payload]`` shape reaches the
    recorder with its parts (from a real ROUTER through the ZMQ source's DEALER), and the
    capture keeps them byte for byte, flagged malformed and replayed."""
    from kvevents.cli.rawtap import FrameRecorder
    from kvevents.consumers.source_protocol import BAD_FRAME
    from kvevents.inspection import describe_malformed

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    src = consumers.ZmqSource("tcp://127.0.0.1:1", replay_endpoint=f"tcp://127.0.0.1:{port}")
    bad = [b"", b"kv", (5).to_bytes(8, "big"), GOOD[0], b"extra part"]
    short_seq = [b"", b"kv", b"\x00\x05", GOOD[1]]
    path = tmp_path / "replies.kvcap"
    try:
        src.request_replay(0)
        assert router.poll(5000), "no replay request"
        ident = router.recv_multipart()[0]
        router.send_multipart([ident, *bad])
        router.send_multipart([ident, *short_seq])
        got: list[consumers.SourceMessage] = []
        end = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < end:
            zmq.select(list(src.sockets()), [], [], 0.5)
            got += [m for m in src.receive(16) if m.kind == BAD_FRAME]
        assert [list(m.parts) for m in got] == [bad, short_seq]
        with CaptureWriter(path) as writer:
            recorder = FrameRecorder(writer)
            for m in got:
                recorder.replayed("tcp://127.0.0.1:1", m)
        assert recorder.malformed == 2
    finally:
        src.close()
        router.close(0)
    recs = list(read_capture(path).records)
    assert [(r.malformed, r.replayed) for r in recs] == [(True, True), (True, True)]
    assert [unpack_parts(r.payload) for r in recs] == [bad, short_seq]
    assert describe_malformed(recs[0]).startswith("malformed replay reply: 5 part(s)")


def test_replay_publish_sends_a_seq_filled_late_and_skips_only_true_copies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An arrival-order capture: live 0, 1, 3 (a gap), the replay's 2 (filling it) and
    its copy of 3, then live 4, and a publisher restart (seq 0 again, other content).
    ``replay --publish`` sends every distinct batch once, in the recorded order."""
    src = "tcp://127.0.0.1:5557#kv"
    restarted = encode_batch(make_batch(40))
    recorded = [  # (seq, payload, replayed)
        (0, GOOD[0], False),
        (1, GOOD[1], False),
        (3, GOOD[3], False),
        (2, GOOD[2], True),
        (3, GOOD[3], True),
        (0, restarted, False),
    ]
    path = tmp_path / "late.kvcap"
    with CaptureWriter(path) as w:
        for seq, payload, replayed in recorded:
            w.write(src, b"kv", seq, payload, recv_ts=1.0, replayed=replayed)
    rc, got = republish(path, f"ipc://{tmp_path}/late.ipc", 5)
    assert rc == [0]
    assert got == [GOOD[0], GOOD[1], GOOD[3], GOOD[2], restarted]
    err = capsys.readouterr().err
    assert "republished 5 batches" in err and "duplicate x1" in err


def test_a_recorded_replay_end_marker_reads_back_as_the_live_session(tmp_path: Path) -> None:
    """Recording a gap that replay only partly repairs: the capture holds the replay's
    end marker, and reading it back reports the same gap and the same loss as the live
    subscriber did (ended by the marker, not by the end of the file)."""
    from kvevents.cli.rawtap import FrameRecorder, RecordingSource
    from tests.consumers._zmq_helpers import FaultyPublisher, drain, summarize

    path = tmp_path / "ended.kvcap"
    writer = CaptureWriter(path)
    recorder = FrameRecorder(writer)
    with FaultyPublisher(buffer_steps=2) as pub:
        src = RecordingSource(pub.endpoint, recorder, b"", pub.replay_endpoint)
        # no catch-up replay from seq 0 when the publisher is first seen: the gap's replay
        # is the only one, whatever the timing
        with consumers.Subscriber(
            [src], options=consumers.SubscriberOptions(catch_up=False)
        ) as sub:
            pub.wait_for_subscribers(pump=lambda: sub.receive(0.01))
            pub.publish_many((make_batch(i) for i in range(5)), skip={1, 2})
            live = drain(
                sub, lambda xs: any(getattr(x, "kind", "") == "unrecoverable_loss" for x in xs)
            )
            live += drain(sub, lambda xs: any(getattr(x, "seq", -1) == 4 for x in xs))
            deadline = time.monotonic() + 10  # the replay's end marker may come last
            while recorder.replay_ends < 1 and time.monotonic() < deadline:
                item = sub.receive(0.05)
                if item is not None:
                    live.append(item)
    writer.close()
    markers = [r for r in read_capture(path).records if r.seq < 0 and not r.payload]
    assert len(markers) == 1 and markers[0].replayed, (summarize(live), read_capture(path).records)
    with consumers.Subscriber([consumers.CaptureSource(str(path))]) as again_sub:
        again = list(again_sub)

    def anomalies(items: list[Any]) -> list[tuple[str, int | None, int | None]]:
        return [
            (x.kind, x.first_seq, x.last_seq) for x in items if isinstance(x, consumers.Anomaly)
        ]

    assert anomalies(live) == [("gap", 1, 2), ("unrecoverable_loss", 1, 2)], summarize(live)
    assert anomalies(again) == anomalies(live)
    lost = [x for x in again if isinstance(x, consumers.Anomaly) and x.kind == "unrecoverable_loss"]
    assert "capture ended" not in (lost[0].detail or "")
    seqs = [x.seq for x in again if isinstance(x, consumers.ReceivedBatch)]
    assert seqs == [x.seq for x in live if isinstance(x, consumers.ReceivedBatch)] == [0, 3, 4]
