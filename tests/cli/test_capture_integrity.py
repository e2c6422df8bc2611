"""Captures lose nothing: damaged bytes in the middle of a capture, then ``kvevents
inspect``, ``replay`` and ``record --append`` on it as real CLI processes; an undecodable
frame is recorded (flagged), ``-o EXISTING`` is refused, SIGKILL mid-record keeps every
complete record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

import kvevents.publishers as publishers
from kvevents.capture import CaptureReader, read_capture
from kvevents.codec import decode_batch, encode_batch, pack_live
from tests.cli.conftest import make_sim_capture
from tests.consumers._zmq_helpers import make_batch, wait_until

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def kvevents(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvevents.cli", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def extents(path: Path) -> list[tuple[int, int]]:
    """Byte extent of each record of an intact capture."""
    with CaptureReader(path) as r:
        pos = r.good_bytes
    data = path.read_bytes()
    out = []
    while pos < len(data):
        n = int.from_bytes(data[pos : pos + 4], "big")
        out.append((pos, pos + 8 + n))
        pos += 8 + n
    return out


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Path, list[bytes], tuple[int, int], list[int]]:
    """A simulator capture with 60 bytes of garbage written over its middle: returns the
    path, the payloads, the exact byte range a reader must skip, and the lost seqs."""
    path = tmp_path / "damaged.kvcap"
    payloads = make_sim_capture(path, requests=40)
    ext = extents(path)
    assert len(ext) == len(payloads) > 20
    data = bytearray(path.read_bytes())
    g0 = len(data) // 2
    data[g0 : g0 + 60] = b"\xa5" * 60
    path.write_bytes(bytes(data))
    hit = [i for i, (a, b) in enumerate(ext) if a < g0 + 60 and b > g0]
    skipped = (ext[hit[0]][0], ext[hit[-1]][1])
    return path, payloads, skipped, hit


def test_inspect_goes_on_past_damage_and_reports_the_skipped_bytes(
    damaged: tuple[Path, list[bytes], tuple[int, int], list[int]],
) -> None:
    path, payloads, (s0, s1), lost = damaged
    kept = [p for i, p in enumerate(payloads) if i not in lost]
    res = kvevents("inspect", str(path), "--summary", "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["batches"] == len(kept)
    assert summary["events"] == sum(len(decode_batch(p).events) for p in kept)
    assert summary["skipped_ranges"] == [
        {"start": s0, "end": s1, "reason": summary["skipped_ranges"][0]["reason"]}
    ]
    assert f"skipped bytes {s0}..{s1}" in res.stderr
    res = kvevents("inspect", str(path), "--json")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == summary["events"]  # the events after it too
    assert f"skipped bytes {s0}..{s1}" in res.stderr


def test_replay_goes_on_past_damage_and_reports_the_skipped_bytes(
    damaged: tuple[Path, list[bytes], tuple[int, int], list[int]], tmp_path: Path
) -> None:
    path, payloads, (s0, s1), lost = damaged
    res = kvevents("replay", str(path), "--into-index", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [(r["start"], r["end"]) for r in out["skipped_ranges"]] == [(s0, s1)]
    assert out["stats"]["batches"] == len(payloads) - len(lost)
    assert any(a["first_seq"] == lost[0] for a in out["anomalies"])
    assert f"skipped bytes {s0}..{s1}" in res.stderr
    ep = f"ipc://{tmp_path}/re.ipc"
    res = kvevents("replay", str(path), "--publish", ep, "--max-rate", "--wait-subscribers", "0")
    assert res.returncode == 0, res.stderr
    assert f"republished {len(payloads) - len(lost)} batches" in res.stderr
    assert f"skipped bytes {s0}..{s1}" in res.stderr


@pytest.fixture
def feeder(tmp_path: Path) -> Iterator[str]:
    """A publisher on an ipc endpoint that keeps publishing until the test ends."""
    ep = f"ipc://{tmp_path}/feed.ipc"
    pub = publishers.ZmqEventPublisher(endpoint=ep)
    stop = threading.Event()

    def feed() -> None:
        i = 0
        while not stop.is_set():
            pub.publish(make_batch(i))
            i += 1
            stop.wait(0.005)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        yield ep
    finally:
        stop.set()
        t.join()
        pub.shutdown()


def test_record_append_on_a_damaged_capture_keeps_every_byte(
    damaged: tuple[Path, list[bytes], tuple[int, int], list[int]], feeder: str
) -> None:
    path, payloads, (s0, s1), lost = damaged
    before = path.read_bytes()
    res = kvevents("record", feeder, "-o", str(path), "--append", "--count", "3", "-q")
    assert res.returncode == 0, res.stderr
    assert "recorded 3 records" in res.stderr
    after = path.read_bytes()
    assert after[: len(before)] == before  # no intact record (no byte at all) cut
    cap = read_capture(path)
    old = [r.payload for r in cap.records[: len(payloads) - len(lost)]]
    assert old == [p for i, p in enumerate(payloads) if i not in lost]
    assert len(cap.records) == len(old) + 3
    assert [(s.start, s.end) for s in cap.skipped] == [(s0, s1)]


def test_record_refuses_an_existing_output_without_force(tmp_path: Path, feeder: str) -> None:
    path = tmp_path / "keep.kvcap"
    make_sim_capture(path, requests=5)
    before = path.read_bytes()
    res = kvevents("record", feeder, "-o", str(path), "--count", "1", "-q")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("kvevents: error: ")
    assert "already exists" in res.stderr and "--force" in res.stderr
    assert path.read_bytes() == before
    res = kvevents("record", feeder, "-o", str(path), "--count", "2", "--force", "-q")
    assert res.returncode == 0, res.stderr
    assert len(read_capture(path).records) == 2


def test_record_keeps_an_undecodable_frame_flagged(tmp_path: Path) -> None:
    ep = f"ipc://{tmp_path}/raw.ipc"
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)  # an XPUB tells us when the recorder has subscribed
    pub.setsockopt(zmq.LINGER, 1000)
    pub.bind(ep)
    out = tmp_path / "raw.kvcap"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvevents.cli", "record", ep, "-o", str(out), "--count", "2"],
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    garbage = b"\xc1 not a batch"
    good = [encode_batch(make_batch(0)), encode_batch(make_batch(2))]
    try:
        assert pub.poll(30_000), "the recorder never subscribed"
        pub.recv()
        for seq, payload in ((0, good[0]), (1, garbage), (2, good[1])):
            pub.send_multipart(pack_live(b"kv", seq, payload))
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close()
    assert proc.returncode == 0, err
    cap = read_capture(out)
    assert [r.seq for r in cap.records] == [0, 1, 2]
    assert [r.payload for r in cap.records] == [good[0], garbage, good[1]]
    assert [r.undecodable for r in cap.records] == [False, True, False]
    assert "1 undecodable frame(s) kept" in err
    # reading it back reports the frame as the live stream did
    res = kvevents("inspect", str(out))
    assert res.returncode == 0 and "undecodable frame seq=1" in res.stderr


def test_sigkill_during_record_leaves_every_complete_record_readable(
    tmp_path: Path, feeder: str
) -> None:
    out = tmp_path / "killed.kvcap"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvevents.cli", "record", feeder, "-o", str(out), "-q"],
        env=ENV,
        stderr=subprocess.DEVNULL,
    )
    try:

        def enough() -> bool:
            try:
                return len(read_capture(out).records) >= 50
            except Exception:  # the header is not written yet
                return False

        wait_until(enough, timeout=30)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    cap = read_capture(out)
    seqs = [r.seq for r in cap.records]
    assert len(seqs) >= 50 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    with CaptureReader(out) as r:
        list(r)
        # at most a torn last record, nothing else skipped
        assert r.skipped == [] or (len(r.skipped) == 1 and r.torn_tail() is not None)
        assert r.good_bytes == (r.skipped[0].start if r.skipped else out.stat().st_size)
