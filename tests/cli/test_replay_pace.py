"""``kvevents replay --publish`` keeps the recorded pace from the first batch on; the
``--wait-subscribers`` pause that lets subscribers connect is not part of the schedule."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import kvevents.consumers as consumers
from kvevents.capture import CaptureWriter
from kvevents.cli import main
from kvevents.codec import encode_batch
from kvevents.events import BlockRemoved, KVEventBatch


def paced_capture(path: Path, n: int, gap_s: float) -> None:
    with CaptureWriter(path) as w:
        for i in range(n):
            body = encode_batch(KVEventBatch(1.0 + i, [BlockRemoved([i], "GPU")], 0))
            w.write("tcp://engine:5557", b"", i, body, recv_ts=1000.0 + gap_s * i)


def arrival_offsets(endpoint: str, args: list[str], n: int) -> list[float]:
    """Run ``replay --publish endpoint ARGS`` and return when each of its ``n`` batches
    reached a subscriber, in seconds after the first."""
    sub = consumers.Subscriber([endpoint])
    rc: list[int] = []
    runner = threading.Thread(target=lambda: rc.append(main(["replay", *args, "-q"])))
    arrivals: list[float] = []
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while len(arrivals) < n and time.monotonic() < deadline:
            item = sub.receive(timeout=0.05)
            if isinstance(item, consumers.ReceivedBatch):
                arrivals.append(time.monotonic())
    finally:
        runner.join(timeout=30)
        sub.close()
    assert rc == [0]
    assert len(arrivals) == n, f"{len(arrivals)} of {n} batches arrived"
    return [t - arrivals[0] for t in arrivals]


@pytest.mark.parametrize("wait", [None, "1.0"])
def test_a_capture_recorded_1s_apart_at_speed_4_arrives_a_quarter_second_apart(
    tmp_path: Path, wait: str | None
) -> None:
    path = tmp_path / "paced.kvcap"
    paced_capture(path, 4, 1.0)
    ep = f"ipc://{tmp_path}/paced.ipc"
    args = [str(path), "--publish", ep, "--speed", "4"]
    if wait is not None:
        args += ["--wait-subscribers", wait]  # default 0.5 s otherwise
    offsets = arrival_offsets(ep, args, 4)
    for got, want in zip(offsets, [0.0, 0.25, 0.5, 0.75]):
        assert got == pytest.approx(want, abs=0.1), offsets


def test_max_rate_sends_without_pauses(tmp_path: Path) -> None:
    path = tmp_path / "paced.kvcap"
    paced_capture(path, 4, 1.0)
    ep = f"ipc://{tmp_path}/fast.ipc"
    offsets = arrival_offsets(ep, [str(path), "--publish", ep, "--max-rate"], 4)
    assert offsets[-1] < 0.2, offsets


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--speed", "0"], "--speed must be a number > 0"),
        (["--speed", "-2"], "--speed must be a number > 0"),
        (["--wait-subscribers", "-1"], "--wait-subscribers must be a number of seconds >= 0"),
        (["--hold", "-1"], "--hold must be a number of seconds >= 0"),
        (["--source", "tcp://nope:1"], "no such publisher in the capture; recorded: tcp://engine"),
    ],
)
def test_bad_pacing_values_are_one_line_errors(
    tmp_path: Path, args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "paced.kvcap"
    paced_capture(path, 1, 1.0)
    assert main(["replay", str(path), "--publish", f"ipc://{tmp_path}/x.ipc", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
