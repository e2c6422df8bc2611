"""``kvevents record`` and ``kvevents replay`` against live simulated engines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import kvevents.consumers as consumers
import kvevents.publishers as publishers
from kvevents.capture import CaptureWriter, read_capture
from kvevents.cli import main
from kvevents.codec import decode_batch
from kvevents.sim import SimEngineConfig, WorkloadConfig, generate_workload
from kvevents.sim.cluster import ClusterConfig, SimCluster

REPO = Path(__file__).resolve().parents[2]


def wait_until(pred: Callable[[], bool], timeout: float = 20.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def recorded_seqs(path: Path) -> dict[tuple[str, int], int]:
    """Highest seq per (source, rank) in a capture being written (its tail may be torn)."""
    if not path.exists() or path.stat().st_size == 0:
        return {}
    out: dict[tuple[str, int], int] = {}
    try:
        got = read_capture(path)
    except Exception:  # header not written yet
        return {}
    for rec in got.records:
        if rec.replay_end:
            continue
        key = (rec.source, decode_batch(rec.payload).data_parallel_rank or 0)
        out[key] = max(out.get(key, -1), rec.seq)
    return out


def summary_json(index: object) -> dict[tuple[str, int], dict[str, dict[str, int]]]:
    out = {}
    for wid, ws in index.summary().items():  # type: ignore[attr-defined]
        out[tuple(wid)] = {
            t: {"entries": s.entries, "tokens": s.tokens} for t, s in ws.tiers.items()
        }
    return out  # type: ignore[return-value]


def test_record_live_engines_then_replay_into_index_matches_live(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = SimEngineConfig(num_gpu_blocks=64, num_cpu_chunks=24, blocks_per_chunk=4)
    out = tmp_path / "live.kvcap"
    with SimCluster(ClusterConfig(num_engines=2, dp_ranks=2, engine=engine)) as cluster:
        cmd = [sys.executable, "-m", "kvevents.cli", "record", *cluster.endpoints, "-o", str(out)]
        for rep in cluster.replay_endpoints:
            cmd += ["--replay-endpoint", str(rep)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        live = consumers.Subscriber(
            cluster.endpoints,
            replay_endpoints=cluster.replay_endpoints,
            options=consumers.SubscriberOptions(catch_up=True),
        )
        index = consumers.BlockIndex(blocks_per_chunk=4)
        last: dict[tuple[str, int], int] = {}

        def pump(timeout: float = 0.01) -> None:
            item = live.receive(timeout=timeout)
            while item is not None:
                if isinstance(item, consumers.ReceivedBatch):
                    index.apply(item.source, item.dp_rank, item.batch)
                    last[item.worker] = item.seq
                item = live.receive(timeout=0)

        try:
            # Both the live subscriber and the recorder must have joined every publisher.
            assert (
                cluster.announce(
                    lambda w: (pump(), w in last and w in recorded_seqs(out))[1], timeout_s=30
                )
                == []
            )
            reqs = generate_workload(WorkloadConfig(num_requests=40, num_tenants=2, seed=9))
            for i, r in enumerate(reqs):
                cluster.workers[i % 4].engine.add_request(r)
            cluster.run_until_idle()
            targets = {w.worker_id: w.engine.stats.batches_published - 1 for w in cluster}

            def caught_up(seen: dict[tuple[str, int], int]) -> bool:
                return all(seen.get(w, -1) >= s for w, s in targets.items())

            assert wait_until(lambda: (pump(), caught_up(last))[1])
            assert wait_until(lambda: caught_up(recorded_seqs(out)))
        finally:
            live.close()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "recorded" in err and "anomalies: none" in err

    got = read_capture(out)
    assert got.tail_error is None  # stopped cleanly: no torn record
    assert got.meta["endpoints"] == cluster.endpoints

    assert main(["replay", str(out), "--into-index", "--json", "--blocks-per-chunk", "4"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    from_capture = {(w["source"], w["dp_rank"]): w["tiers"] for w in replayed["workers"]}
    assert from_capture == summary_json(index)
    assert replayed["stats"]["joined"] == index.stats.joined > 0
    assert [a["kind"] for a in replayed["anomalies"]] == []

    assert main(["replay", str(out), "--into-index", "--blocks-per-chunk", "4", "-q"]) == 0
    text = capsys.readouterr().out
    assert "index: 4 worker(s)" in text and "anomalies: none" in text
    for w in cluster:
        assert f"{w.endpoint}#{w.dp_rank}" in text


def test_replay_publish_reproduces_the_stream(
    sim_capture: tuple[Path, list[bytes]], tmp_path: Path
) -> None:
    path, payloads = sim_capture
    pub_ep = f"ipc://{tmp_path}/pub.ipc"
    rep_ep = f"ipc://{tmp_path}/replay.ipc"
    sub = consumers.Subscriber(
        [pub_ep], replay_endpoints=[rep_ep], options=consumers.SubscriberOptions(catch_up=True)
    )
    rc: list[int] = []
    runner = threading.Thread(
        target=lambda: rc.append(
            main(
                [
                    "replay",
                    str(path),
                    "--publish",
                    pub_ep,
                    "--replay-endpoint",
                    rep_ep,
                    "--max-rate",
                    "--hold",
                    "3",
                    "-q",
                ]
            )
        )
    )
    runner.start()
    got: list[consumers.ReceivedBatch] = []
    try:
        deadline = time.monotonic() + 20
        while len(got) < len(payloads) and time.monotonic() < deadline:
            item = sub.receive(timeout=0.1)
            if isinstance(item, consumers.ReceivedBatch):
                got.append(item)
    finally:
        sub.close()
        runner.join(timeout=30)
    assert rc == [0]
    assert [b.seq for b in got] == list(range(len(payloads)))
    assert [b.batch.events for b in got] == [decode_batch(p).events for p in payloads]
    assert [b.batch.ts for b in got] == [decode_batch(p).ts for p in payloads]
    assert {b.dp_rank for b in got} == {0}


def test_replay_publish_keeps_the_recorded_pace(tmp_path: Path) -> None:
    path = tmp_path / "paced.kvcap"
    from kvevents.codec import encode_batch
    from kvevents.events import KVEventBatch

    body = encode_batch(KVEventBatch(1.0, [], 0))
    with CaptureWriter(path) as w:
        for i in range(5):
            w.write("tcp://e:1", b"", i, body, recv_ts=1000.0 + 0.2 * i)
    ep = f"ipc://{tmp_path}/paced.ipc"
    t0 = time.monotonic()
    assert main(["replay", str(path), "--publish", ep, "--wait-subscribers", "0", "-q"]) == 0
    recorded_pace = time.monotonic() - t0
    t0 = time.monotonic()
    args = ["replay", str(path), "--publish", ep, "--wait-subscribers", "0", "--speed", "4", "-q"]
    assert main(args) == 0
    fast = time.monotonic() - t0
    assert recorded_pace >= 0.8
    assert fast < recorded_pace and fast >= 0.2


def test_replay_publish_needs_an_endpoint_per_recorded_publisher(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvevents.codec import encode_batch
    from kvevents.events import KVEventBatch

    path = tmp_path / "two.kvcap"
    with CaptureWriter(path) as w:
        w.write("tcp://a:1", b"", 0, encode_batch(KVEventBatch(1.0, [], 0)))
        w.write("tcp://b:1", b"", 0, encode_batch(KVEventBatch(1.0, [], 0)))
    assert main(["replay", str(path), "--publish", f"ipc://{tmp_path}/x.ipc"]) == 2
    err = capsys.readouterr().err
    assert "holds 2 publishers" in err and "tcp://a:1" in err and "tcp://b:1" in err
    assert main(["replay", str(path)]) == 2
    assert "exactly one of --into-index or --publish" in capsys.readouterr().err


def test_record_refuses_mismatched_replay_endpoints_and_bad_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["record", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "--replay-endpoint"]
    assert main([*args, "tcp://127.0.0.1:3", "-o", str(tmp_path / "x.kvcap")]) == 2
    assert "one --replay-endpoint per endpoint" in capsys.readouterr().err
    missing_dir = tmp_path / "no" / "such" / "dir" / "x.kvcap"
    assert main(["record", f"ipc://{tmp_path}/r.ipc", "-o", str(missing_dir), "--count", "1"]) == 2
    assert "No such file or directory" in capsys.readouterr().err


def test_record_stops_after_count_with_a_complete_file(tmp_path: Path) -> None:
    ep = f"ipc://{tmp_path}/count.ipc"
    pub = publishers.ZmqEventPublisher(endpoint=ep)
    from kvevents.events import KVEventBatch

    out = tmp_path / "count.kvcap"
    stop = threading.Event()

    def feed() -> None:  # keeps publishing until the recorder has what it needs
        while not stop.is_set():
            pub.publish(KVEventBatch(time.time(), [], 0))
            stop.wait(0.01)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        assert main(["record", ep, "-o", str(out), "--count", "5", "-q"]) == 0
        first = read_capture(out).records
        assert main(["record", ep, "-o", str(out), "--count", "3", "--append", "-q"]) == 0
    finally:
        stop.set()
        feeder.join()
        pub.shutdown()
    got = read_capture(out)
    assert got.tail_error is None and len(got.records) == 8
    assert got.records[:5] == first
    seqs = [r.seq for r in got.records[:5]]
    assert seqs == list(range(seqs[0], seqs[0] + 5))
    assert got.records[5].seq > seqs[-1]


def test_replay_into_index_reports_the_gaps_of_a_capture(
    sim_capture: tuple[Path, list[bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = sim_capture
    holed = tmp_path / "holed.kvcap"
    with CaptureWriter(holed) as w:
        for rec in read_capture(path).records:
            if rec.seq not in (5, 6):
                w.write_record(rec)
    assert main(["replay", str(holed), "--into-index", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    kinds = [a["kind"] for a in js["anomalies"]]
    assert kinds and set(kinds) <= {"gap", "unrecoverable_loss"}
    assert any(a["first_seq"] == 5 for a in js["anomalies"])
    assert main(["replay", str(holed), "--into-index", "-q"]) == 0
    out = capsys.readouterr().out
    assert "anomalies (" in out and "tcp://engine-a:5557#kv#0 seq 5..6" in out
