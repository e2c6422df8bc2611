"""Captures survive damage anywhere: the reader resynchronises after a damaged record and
reports exactly the byte ranges it skipped; appending never cuts an intact record."""

from __future__ import annotations

import struct
import tempfile
import zlib
from pathlib import Path

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents.capture import (
    CAPTURE_MAGIC,
    FLAG_UNDECODABLE,
    CaptureReader,
    CaptureRecord,
    CaptureWriter,
    SkippedRange,
    read_capture,
)

_ENC = msgspec.msgpack.Encoder()


def _record_size(rec: CaptureRecord) -> int:
    return 8 + len(_ENC.encode(rec))


def _write(path: Path, payloads: list[bytes]) -> tuple[int, list[tuple[int, int]]]:
    """Write one record per payload; return the header size and each record's extent."""
    with CaptureWriter(path, meta={"t": 1}) as w:
        pass
    header = path.stat().st_size
    extents = []
    with CaptureWriter(path, append=True) as w:
        pos = header
        for i, p in enumerate(payloads):
            w.write("tcp://e:1", b"kv", i, p, recv_ts=1.0 + i)
            w.flush()
            end = path.stat().st_size
            extents.append((pos, end))
            pos = end
    return header, extents


def _check_tiling(path: Path, header: int) -> None:
    """Records read and ranges skipped cover the file after the header exactly once."""
    cap = read_capture(path)
    covered = sum(_record_size(r) for r in cap.records) + sum(s.end - s.start for s in cap.skipped)
    assert covered == path.stat().st_size - header
    for a, b in zip(cap.skipped, cap.skipped[1:]):
        assert a.end < b.start


def test_damage_in_the_middle_skips_exactly_the_damaged_record(tmp_path: Path) -> None:
    path = tmp_path / "c.kvcap"
    payloads = [bytes([i]) * (50 + i) for i in range(40)]
    header, extents = _write(path, payloads)
    data = bytearray(path.read_bytes())
    start, end = extents[17]
    data[start + 20] ^= 0xFF  # one flipped byte inside record 17's body
    path.write_bytes(bytes(data))
    cap = read_capture(path)
    assert [r.seq for r in cap.records] == [i for i in range(40) if i != 17]
    assert [r.payload for r in cap.records] == payloads[:17] + payloads[18:]
    assert len(cap.skipped) == 1
    assert (cap.skipped[0].start, cap.skipped[0].end) == (start, end)
    assert "checksum" in cap.skipped[0].reason and "record 18" in cap.skipped[0].reason
    assert cap.tail_error is None  # the damage is not at the end
    _check_tiling(path, header)


def test_a_damaged_length_field_and_a_garbage_run_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "c.kvcap"
    payloads = [bytes([i % 7]) * 300 for i in range(30)]
    header, extents = _write(path, payloads)
    data = bytearray(path.read_bytes())
    # record 5's length claims far more than it holds; records 10-12 are overwritten
    data[extents[5][0] : extents[5][0] + 4] = struct.pack(">I", 5000)
    g0 = extents[10][0] + 3
    g1 = extents[12][1] - 2
    data[g0:g1] = bytes((i * 37) & 0xFF for i in range(g1 - g0))
    path.write_bytes(bytes(data))
    cap = read_capture(path)
    assert [r.seq for r in cap.records] == [i for i in range(30) if i not in (5, 10, 11, 12)]
    assert [(s.start, s.end) for s in cap.skipped] == [
        (extents[5][0], extents[6][0]),
        (extents[10][0], extents[13][0]),
    ]
    _check_tiling(path, header)


def test_damaged_header_metadata_still_reads_every_record(tmp_path: Path) -> None:
    path = tmp_path / "c.kvcap"
    payloads = [b"x" * 20 for _ in range(5)]
    header, _ = _write(path, payloads)
    data = bytearray(path.read_bytes())
    data[16] ^= 0xFF  # inside the metadata blob
    data[10:14] = struct.pack(">I", 1 << 31)  # and an absurd metadata length
    path.write_bytes(bytes(data))
    cap = read_capture(path)
    assert cap.meta == {}
    assert [r.seq for r in cap.records] == list(range(5))
    assert len(cap.skipped) == 1 and cap.skipped[0].start == 14
    assert cap.skipped[0].end == header


def test_a_torn_tail_is_a_tail_error_and_append_cuts_only_it(tmp_path: Path) -> None:
    path = tmp_path / "c.kvcap"
    payloads = [bytes([i]) * 40 for i in range(6)]
    _write(path, payloads)
    full = path.read_bytes()
    path.write_bytes(full[:-7])  # the last write was cut short
    cap = read_capture(path)
    assert [r.seq for r in cap.records] == list(range(5))
    assert cap.tail_error is not None and "truncated" in cap.tail_error
    kept = cap.skipped[-1].start  # the torn record starts here
    with CaptureWriter(path, append=True) as w:
        w.write("s", b"", 99, b"new")
    again = read_capture(path)
    assert [r.seq for r in again.records] == [0, 1, 2, 3, 4, 99]
    assert again.skipped == [] and again.tail_error is None
    assert path.read_bytes()[:kept] == full[:kept]


def test_append_after_middle_damage_keeps_every_byte(tmp_path: Path) -> None:
    path = tmp_path / "c.kvcap"
    payloads = [bytes([i]) * 100 for i in range(20)]
    header, extents = _write(path, payloads)
    data = bytearray(path.read_bytes())
    data[extents[8][0] + 30] ^= 0x55
    data[-3] ^= 0x01  # and the last record's body: complete but corrupt, not torn
    path.write_bytes(bytes(data))
    before = path.read_bytes()
    with CaptureWriter(path, append=True) as w:
        w.write("s", b"", 100, b"a")
        w.write("s", b"", 101, b"b")
    after = path.read_bytes()
    assert after[: len(before)] == before  # nothing cut, nothing rewritten
    cap = read_capture(path)
    assert [r.seq for r in cap.records] == [i for i in range(19) if i != 8] + [100, 101]
    assert [(s.start, s.end) for s in cap.skipped] == [extents[8], extents[19]]
    _check_tiling(path, header)


def test_version_1_captures_are_read_and_appended(tmp_path: Path) -> None:
    path = tmp_path / "v1.kvcap"
    meta = _ENC.encode({"format_version": 1, "tool": "kvevents"})
    out = bytearray(struct.pack(">8sHI", CAPTURE_MAGIC, 1, len(meta)) + meta)
    for i in range(3):
        body = _ENC.encode([1.0 + i, "tcp://e:1", b"kv", i, b"p%d" % i, i == 1])
        out += struct.pack(">II", len(body), zlib.crc32(body)) + body
    path.write_bytes(bytes(out))
    cap = read_capture(path)
    assert [(r.seq, r.payload, r.replayed, r.flags) for r in cap.records] == [
        (0, b"p0", False, 0),
        (1, b"p1", True, 0),
        (2, b"p2", False, 0),
    ]
    with CaptureWriter(path, append=True) as w:
        w.write("tcp://e:1", b"kv", 3, b"\xc1junk", flags=FLAG_UNDECODABLE)
    assert path.read_bytes()[10 : len(out)] == bytes(out[10:])  # only the version changed
    with CaptureReader(path) as r:
        recs = list(r)
        assert r.version == 2 and r.skipped == []
    assert [x.seq for x in recs] == [0, 1, 2, 3]
    assert recs[3].undecodable and not recs[0].undecodable


def test_overwrite_false_refuses_an_existing_file(tmp_path: Path) -> None:
    import pytest

    from kvevents import CaptureError

    path = tmp_path / "c.kvcap"
    _write(path, [b"a"])
    before = path.read_bytes()
    with pytest.raises(CaptureError, match="already exists"):
        CaptureWriter(path, overwrite=False)
    assert path.read_bytes() == before


_damage = st.lists(
    st.tuples(
        st.sampled_from(["flip", "overwrite", "insert", "delete"]),
        st.floats(0, 1),
        st.binary(min_size=1, max_size=40),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=25), _damage)
def test_random_damage_never_loses_an_intact_record(
    payloads: list[bytes], damage: list[tuple[str, float, bytes]]
) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.kvcap"
        header, extents = _write(path, payloads)
        data = bytearray(path.read_bytes())
        # where each original record now lies (None once its bytes are touched)
        where: list[tuple[int, int] | None] = list(extents)
        for kind, at, blob in damage:
            if len(data) <= header:
                break
            p = header + int(at * (len(data) - header - 1))
            if kind == "flip":
                span, shift = (p, p + 1), 0
                data[p] ^= blob[0] | 1
            elif kind == "overwrite":
                span, shift = (p, p + len(blob)), 0
                data[p : p + len(blob)] = blob
            elif kind == "insert":
                span, shift = (p, p + 1), len(blob)
                data[p:p] = blob
            else:
                k = min(len(blob), len(data) - p)
                # Deleting k bytes at p leaves the same file as deleting them at p ± 1
                # wherever the byte that would go instead is equal: every record any
                # of those deletions touches is damaged (the reader cannot tell which).
                lo, hi = p, p
                while lo > header and data[lo - 1] == data[lo - 1 + k]:
                    lo -= 1
                while hi + k < len(data) and data[hi] == data[hi + k]:
                    hi += 1
                span, shift = (lo, hi + k), -k
                del data[p : p + k]
            for i, e in enumerate(where):
                if e is None:
                    continue
                if e[1] <= span[0] and not (kind == "insert" and e[1] == span[0]):
                    continue  # before the damage: untouched
                if e[0] >= span[1] or (kind == "insert" and e[0] >= p):
                    where[i] = (e[0] + shift, e[1] + shift)  # after it: shifted
                else:
                    where[i] = None
        path.write_bytes(bytes(data))
        cap = read_capture(path)
        got = [(r.seq, r.payload) for r in cap.records]
        intact = [(i, payloads[i]) for i, e in enumerate(where) if e is not None]
        # every intact record is read, in order; nothing is read that was not written
        it = iter(got)
        assert all(any(x == y for y in it) for x in intact), (intact, got)
        assert set(got) <= {(i, p) for i, p in enumerate(payloads)}
        for s in cap.skipped:
            assert isinstance(s, SkippedRange) and header <= s.start < s.end <= len(data)
        _check_tiling(path, header)
