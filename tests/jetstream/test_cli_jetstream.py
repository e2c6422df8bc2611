"""Captures move between transports: ``replay --publish nats://`` and ``record nats://``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvevents.capture import CaptureWriter
from kvevents.cli import main
from kvevents.codec import encode_batch
from kvevents.jetstream import LocalNatsServer

from .helpers import batch


def write_capture(path: Path) -> None:
    """Two publishers; the second restarts (its seq goes back to 0) half way."""
    with CaptureWriter(path) as w:
        for i in range(30):
            w.write("tcp://10.0.0.1:5557", b"", i, encode_batch(batch(i)), recv_ts=float(i))
        for i in range(10):
            w.write("tcp://10.0.0.2:5557", b"", i, encode_batch(batch(i, life=1)), recv_ts=float(i))
        for i in range(15):
            w.write("tcp://10.0.0.2:5557", b"", i, encode_batch(batch(i, life=2)), recv_ts=50.0 + i)


def tiers(capture: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    assert main(["replay", str(capture), "--into-index", "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    return sorted((w["tiers"] for w in out["workers"]), key=json.dumps)


def test_capture_to_jetstream_and_back(
    nats_server: LocalNatsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = tmp_path / "a.kvcap"
    write_capture(original)
    assert main(["replay", str(original), "--publish", nats_server.url]) == 0
    assert "appended 55 batches" in capsys.readouterr().err
    # a second publish of the same capture is de-duplicated by message id
    assert main(["replay", str(original), "--publish", nats_server.url]) == 0
    assert "appended 0 batches" in capsys.readouterr().err

    back = tmp_path / "b.kvcap"
    assert main(["record", nats_server.url, "-o", str(back), "--count", "55", "-q"]) == 0
    capsys.readouterr()
    assert tiers(back, capsys) == tiers(original, capsys)


def test_record_from_jetstream_needs_a_stream(
    nats_server: LocalNatsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "record",
            nats_server.url,
            "--stream",
            "NOPE",
            "-o",
            str(tmp_path / "x.kvcap"),
            "--count",
            "1",
        ]
    )
    assert rc == 2
    assert "no JetStream stream 'NOPE'" in capsys.readouterr().err
