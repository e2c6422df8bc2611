"""``kvevents inspect`` on the shipped sample capture and on damaged files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvevents.cli import main

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sample.kvcap"


def test_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(SAMPLE)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5
    assert (
        "BlockStored  GPU" in lines[0] and "block_size=16" in lines[0] and "tokens=32" in lines[0]
    )
    assert "(placeholder)" in lines[1] and "CPU" in lines[1]


def test_json_lines_carry_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(SAMPLE), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["type"] for r in rows] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "BlockRemoved",
        "BlockRemoved",
    ]
    assert rows[0]["block_size"] == 16 and len(rows[0]["token_ids"]) == 32
    assert rows[1]["block_size"] == 0 and rows[1]["token_ids"] == [] and rows[1]["medium"] == "CPU"
    assert rows[1]["block_hashes"] == [rows[0]["block_hashes"][-1]]
    assert [r["seq"] for r in rows] == [0, 1, 2, 4, 4]


def test_filters(capsys: pytest.CaptureFixture[str]) -> None:
    main(["inspect", str(SAMPLE), "--json", "--medium", "cpu"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["medium"] for r in rows} == {"CPU"} and len(rows) == 2
    rc = main(["inspect", str(SAMPLE), "--json", "--type", "BlockStored", "--worker", "nowhere"])
    assert rc == 2 and capsys.readouterr().out == ""  # an unknown worker is an error


def test_summary_counts_gaps_and_joins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(SAMPLE), "--summary", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["batches"] == 4 and s["events"] == 5
    assert s["seq_gaps"] == 1 and s["seq_missing"] == 1
    assert s["placeholders"] == 1 and s["placeholders_joined"] == 1
    assert s["by_type"] == {"BlockStored": 2, "BlockRemoved": 3}


def test_truncated_capture_prints_good_records_and_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = tmp_path / "d.kvcap"
    shutil.copy(SAMPLE, damaged)
    damaged.write_bytes(damaged.read_bytes()[:-3])
    assert main(["inspect", str(damaged)]) == 0
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 3  # the last record (two events) is lost
    assert "truncated" in out.err


def test_not_a_capture_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad"
    bad.write_text("hello")
    assert main(["inspect", str(bad)]) == 2
    assert "not a kvevents capture" in capsys.readouterr().err
