"""``kvevents inspect``: every filter and limit is checked; a value the capture does not
hold is one error line naming the values it does hold, with a non-zero exit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvevents import BlockRemoved, BlockStored, CaptureWriter, KVEventBatch, encode_batch
from kvevents.cli import main

from ._run import kvevents

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sample.kvcap"


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--type", "Foo"], ["--type", "BlockStored, BlockRemoved, AllBlocksCleared"]),
        (["--type", "AllBlocksCleared"], ["types in it: BlockRemoved, BlockStored"]),
        (["--group", "5"], ["--group 5", "groups in it: 0"]),
        (["--medium", "DISK"], ["--medium DISK", "media in it: CPU, GPU"]),
        (["--worker", "tcp://nowhere:1"], ["--worker", "tcp://127.0.0.1:5557#0"]),
        (["--worker", "tcp://127.0.0.1:5557#3"], ["workers in it", "tcp://127.0.0.1:5557#0"]),
    ],
)
@pytest.mark.parametrize("summary", [False, True])
def test_a_filter_value_the_capture_lacks_names_the_values_it_has(
    args: list[str], says: list[str], summary: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["inspect", str(SAMPLE), *args, *(["--summary"] if summary else [])])
    out = capsys.readouterr()
    assert rc == 2
    line = one_error_line(out.err)
    assert line.startswith("kvevents: error: ")
    for text in says:
        assert text in line
    assert out.out == ""


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--limit", "0"], "--limit: want a whole number >= 1, got 0"),
        (["--limit", "-1"], "--limit: want a whole number >= 1, got -1"),
        (["--limit", "x"], "--limit: want a whole number >= 1, got 'x'"),
        (["--group", "-1"], "--group: want a group index (0, 1, ...), got -1"),
        (["--group", "one"], "--group: want a group index (0, 1, ...), got 'one'"),
    ],
)
def test_a_malformed_limit_or_group_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    got = kvevents("inspect", str(SAMPLE), *args)
    assert got.returncode == 2
    line = one_error_line(got.stderr)
    assert line.startswith("kvevents inspect: error: argument ") and says in line
    assert got.stdout == ""


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_limit_n_prints_exactly_n_events(limit: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(SAMPLE), "--limit", str(limit)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == limit


def test_filters_match_case_insensitively_and_the_worker_by_source_or_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for worker in ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557#0"):
        assert (
            main(["inspect", str(SAMPLE), "--json", "--type", "blockremoved", "--worker", worker])
            == 0
        )
        rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert [r["type"] for r in rows] == ["BlockRemoved"] * 3


def test_values_that_exist_but_never_together_print_nothing_and_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "two.kvcap"
    with CaptureWriter(path) as w:
        stored = BlockStored([1], None, [1, 2], 2, None, "GPU", None, group_idx=0)
        removed = BlockRemoved([2], "CPU", group_idx=0)
        w.write("tcp://e:1", b"", 0, encode_batch(KVEventBatch(1.0, [stored, removed], 0)))
    assert main(["inspect", str(path), "--type", "BlockStored", "--medium", "CPU"]) == 0
    out = capsys.readouterr()
    assert out.out == ""
    assert one_error_line(out.err) == "no event matched all the filters together"


def test_the_summary_join_count_is_the_same_under_a_medium_filter(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["inspect", str(SAMPLE), "--summary", "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(SAMPLE), "--summary", "--json", "--medium", "CPU"]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert whole["placeholders"] == cpu["placeholders"] == 1
    assert whole["placeholders_joined"] == cpu["placeholders_joined"] == 1
    assert cpu["by_medium"] == {"CPU": 2} and cpu["events"] == 2
    assert main(["inspect", str(SAMPLE), "--summary", "--medium", "cpu"]) == 0
    assert "CPU/STORAGE placeholders 1, joined to a GPU store 1" in capsys.readouterr().out
