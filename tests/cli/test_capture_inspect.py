"""Capture files made from simulator traffic, and ``kvevents inspect`` on them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from kvevents.capture import CaptureReader, CaptureWriter, read_capture
from kvevents.cli import main
from kvevents.codec import decode_batch


def test_capture_round_trip_keeps_every_frame_byte_exact(
    sim_capture: tuple[Path, list[bytes]],
) -> None:
    path, payloads = sim_capture
    got = read_capture(path)
    assert got.tail_error is None
    assert got.meta["made_by"] == "test" and got.meta["format_version"] == 2
    assert [r.payload for r in got.records] == payloads
    assert [r.seq for r in got.records] == list(range(len(payloads)))
    assert {(r.source, r.topic, r.replayed) for r in got.records} == {
        ("tcp://engine-a:5557", b"kv", False)
    }


def test_a_truncated_tail_is_reported_and_the_good_records_are_kept(
    sim_capture: tuple[Path, list[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, payloads = sim_capture
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 5)  # cut into the last record
    got = read_capture(path)
    assert [r.payload for r in got.records] == payloads[:-1]
    assert got.tail_error is not None and "truncated" in got.tail_error

    assert main(["inspect", str(path), "--summary", "--json"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["batches"] == len(payloads) - 1
    assert "truncated" in summary["tail_error"]
    assert "skipped bytes" in err and "the records around it were read" in err

    # Appending continues after the last good record.
    with CaptureWriter(path, append=True) as w:
        w.write("tcp://engine-a:5557", b"kv", len(payloads) - 1, payloads[-1])
    again = read_capture(path)
    assert again.tail_error is None
    assert [r.payload for r in again.records] == payloads


def test_inspect_prints_one_readable_line_per_event(
    sim_capture: tuple[Path, list[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, payloads = sim_capture
    assert main(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    n_events = sum(len(decode_batch(p).events) for p in payloads)
    assert len(lines) == n_events
    first = lines[0]
    assert first.startswith("seq=0") and "tcp://engine-a:5557#0" in first
    assert "BlockStored  GPU" in first and "group=0" in first and "block_size=16" in first
    assert any("BlockRemoved GPU" in line for line in lines)


def test_inspect_json_lines_carry_every_field(
    sim_capture: tuple[Path, list[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, payloads = sim_capture
    assert main(["inspect", str(path), "--json", "--type", "BlockStored", "--limit", "5"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 5
    expected = [
        e for p in payloads for e in decode_batch(p).events if type(e).__name__ == "BlockStored"
    ]
    for row, ev in zip(rows, expected):
        assert row["type"] == "BlockStored"
        assert row["block_hashes"] == ev.block_hashes  # type: ignore[attr-defined]
        assert row["token_ids"] == ev.token_ids  # type: ignore[attr-defined]
        assert row["parent_block_hash"] == ev.parent_block_hash  # type: ignore[attr-defined]
        assert row["medium"] == "GPU" and row["dp_rank"] == 0
        assert row["kv_cache_spec_kind"] == "full_attention"


def test_inspect_summary_counts_match_the_stream(
    sim_capture: tuple[Path, list[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, payloads = sim_capture
    by_type: Counter[str] = Counter(
        type(e).__name__ for p in payloads for e in decode_batch(p).events
    )
    assert main(["inspect", str(path), "--summary"]) == 0
    text = capsys.readouterr().out
    assert f"records {len(payloads)}  batches {len(payloads)}" in text
    assert "seq gaps 0" in text
    for name, n in by_type.items():
        assert any(line.split() == [name, str(n)] for line in text.splitlines())

    assert main(["inspect", str(path), "--summary", "--json", "--medium", "GPU"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["by_type"] == dict(by_type)
    assert js["by_worker"] == {"tcp://engine-a:5557#0": sum(by_type.values())}


def test_inspect_refuses_a_file_that_is_not_a_capture(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bogus = tmp_path / "x.kvcap"
    bogus.write_bytes(b"hello world, not a capture")
    assert main(["inspect", str(bogus)]) == 2
    assert "not a kvevents capture" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing.kvcap")]) == 2


def test_seq_gaps_in_a_capture_are_counted(
    sim_capture: tuple[Path, list[bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = sim_capture
    holed = tmp_path / "holed.kvcap"
    with CaptureReader(path) as reader, CaptureWriter(holed) as w:
        for rec in reader:
            if rec.seq not in (3, 4, 9):
                w.write_record(rec)
    assert main(["inspect", str(holed), "--summary", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert (js["seq_gaps"], js["seq_missing"]) == (2, 3)


def test_inspect_summary_shows_the_capture_metadata(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvevents.codec import encode_batch
    from kvevents.events import KVEventBatch

    path = tmp_path / "meta.kvcap"
    meta = {"endpoints": ["tcp://a:1"], "recorder": "kvevents record", "blob": b"\x01"}
    with CaptureWriter(path, meta=meta) as w:
        w.write("tcp://a:1", b"", 0, encode_batch(KVEventBatch(1.0, [], 0)), recv_ts=100.0)
        w.write(
            "tcp://a:1",
            b"",
            1,
            encode_batch(KVEventBatch(2.0, [], 0)),
            recv_ts=102.5,
            replayed=True,
        )
    assert main(["inspect", str(path), "--summary"]) == 0
    text = capsys.readouterr().out
    assert "received over 2.5 s (from 1970-01-01T00:01:40Z); 1 record(s) came by replay" in text
    assert "recorded by kvevents record from tcp://a:1" in text
    assert main(["inspect", str(path), "--summary", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["meta"]["blob"] == {"hex": "01"} and js["replayed"] == 1
