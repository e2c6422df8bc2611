"""Misuse of the core modules raises a :class:`KVEventsError` that callers who caught the
builtin before (``ValueError``, ``TypeError``) still catch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvevents.capture import CaptureReader, CaptureWriter
from kvevents.errors import CaptureError, ConfigError, KVEventsError, MetricsError
from kvevents.hashing import hash_function, hash_request_blocks
from kvevents.jetstream.loop import LoopThread
from kvevents.metrics import StatsCollector, stats_snapshot


@pytest.mark.parametrize("block_size", [0, -16])
def test_a_block_size_below_one_is_a_config_error(block_size: int) -> None:
    with pytest.raises(ConfigError, match="block_size must be positive") as info:
        hash_request_blocks(list(range(32)), block_size)
    assert isinstance(info.value, ValueError)


def test_an_unknown_hash_algorithm_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="sha256_cbor"):
        hash_function("md5")


def test_metrics_refuse_an_object_without_stats_with_a_type_error() -> None:
    with pytest.raises(MetricsError, match=r"no dataclass \.stats") as info:
        StatsCollector().register("x", object())
    assert isinstance(info.value, TypeError) and isinstance(info.value, KVEventsError)


def test_stats_snapshot_refuses_what_is_not_a_stats_instance() -> None:
    @dataclasses.dataclass
    class Stats:
        n: int = 3

    assert stats_snapshot(Stats()) == {"n": 3}
    for bad in (object(), Stats, {"n": 3}):
        with pytest.raises(MetricsError):
            stats_snapshot(bad)


def test_a_closed_capture_writer_refuses_records_and_keeps_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.kvcap"
    writer = CaptureWriter(path)
    writer.write("src", b"", 0, b"payload")
    writer.close()
    with pytest.raises(CaptureError, match="closed"):
        writer.write("src", b"", 1, b"more")
    writer.flush()  # nothing to flush: not an error
    with CaptureReader(path) as reader:
        assert [r.seq for r in reader] == [0]


def test_a_closed_capture_reader_cannot_be_iterated(tmp_path: Path) -> None:
    path = tmp_path / "c.kvcap"
    with CaptureWriter(path) as writer:
        writer.write("src", b"", 0, b"payload")
    reader = CaptureReader(path)
    reader.close()
    with pytest.raises(CaptureError, match="closed"):
        iter(reader)


def test_loop_thread_runs_a_coroutine_within_timeout_s() -> None:
    async def answer() -> int:
        return 42

    loop = LoopThread("test-loop")
    try:
        assert loop.run(answer(), timeout_s=5.0) == 42
    finally:
        loop.close()
