"""Capture files: lossless, append-only, truncated/corrupt tails reported (DESIGN §5)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents import (
    CAPTURE_FORMAT_VERSION,
    CaptureError,
    CaptureReader,
    CaptureWriter,
    read_capture,
)


def _write(path: Path, n: int) -> list[bytes]:
    payloads = [bytes([i % 256]) * (i + 1) for i in range(n)]
    with CaptureWriter(path, meta={"note": "t"}) as w:
        for i, p in enumerate(payloads):
            w.write("tcp://127.0.0.1:1", b"topic", i, p, recv_ts=100.0 + i, replayed=i == 2)
    return payloads


def test_round_trip_is_byte_exact(tmp_path: Path) -> None:
    path = tmp_path / "c.kvcap"
    payloads = _write(path, 5)
    cap = read_capture(path)
    assert cap.tail_error is None
    assert cap.meta["note"] == "t" and cap.meta["format_version"] == CAPTURE_FORMAT_VERSION == 2
    assert [r.payload for r in cap.records] == payloads
    assert [r.seq for r in cap.records] == [0, 1, 2, 3, 4]
    assert [r.replayed for r in cap.records] == [False, False, True, False, False]
    assert cap.records[0].topic == b"topic" and cap.records[0].recv_ts == 100.0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=20), st.integers(1, 10_000))
def test_truncation_anywhere_keeps_every_complete_record(payloads: list[bytes], cut: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.kvcap"
        with CaptureWriter(path) as w:
            for i, p in enumerate(payloads):
                w.write("s", b"", i, p)
        full = path.read_bytes()
        header_end = CaptureReader(path)
        header_size = header_end.good_bytes
        header_end.close()
        keep = max(header_size, len(full) - cut)
        path.write_bytes(full[:keep])
        with CaptureReader(path) as r:
            got = [rec.payload for rec in r]
            assert got == payloads[: len(got)]
            if keep < len(full):
                assert len(got) < len(payloads) or not payloads
                if keep > r.good_bytes:
                    assert r.tail_error and "truncated" in r.tail_error


def test_corrupt_record_is_reported_and_earlier_records_kept(tmp_path: Path) -> None:
    path = tmp_path / "c.kvcap"
    _write(path, 4)
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF  # inside the last record's body
    path.write_bytes(bytes(data))
    cap = read_capture(path)
    assert len(cap.records) == 3
    assert cap.tail_error is not None and "checksum" in cap.tail_error


def test_append_continues_after_a_truncated_tail(tmp_path: Path) -> None:
    path = tmp_path / "c.kvcap"
    _write(path, 3)
    path.write_bytes(path.read_bytes()[:-1])
    with CaptureWriter(path, append=True) as w:
        w.write("s", b"", 9, b"new")
    cap = read_capture(path)
    assert cap.tail_error is None
    assert [r.seq for r in cap.records] == [0, 1, 9]


def test_not_a_capture(tmp_path: Path) -> None:
    bad = tmp_path / "x"
    bad.write_bytes(b"hello world, not a capture")
    with pytest.raises(CaptureError, match="not a kvevents capture"):
        CaptureReader(bad)
    with pytest.raises(CaptureError, match="cannot open"):
        CaptureReader(tmp_path / "missing")


def test_newer_format_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.kvcap"
    _write(path, 1)
    data = bytearray(path.read_bytes())
    data[8:10] = (99).to_bytes(2, "big")
    path.write_bytes(bytes(data))
    with pytest.raises(CaptureError, match="version 99"):
        CaptureReader(path)
