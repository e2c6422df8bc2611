"""An operator's first day, through the real command line: an engine that cannot be
heard, a late join, a damaged capture, a config typo.  Each case checks the exact line
the user reads, the exit status, and that no traceback is printed."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvevents.capture import CaptureReader, CaptureWriter
from kvevents.codec import encode_batch
from kvevents.events import BlockStored, KVEventBatch
from kvevents.publishers import ZmqEventPublisher

from ._run import REPO, env, kvevents


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def no_traceback(r: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr


def batch(i: int, events: int = 8) -> KVEventBatch:
    stored = [
        BlockStored(
            block_hashes=[10 * i + k],
            parent_block_hash=None,
            token_ids=list(range(16)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        for k in range(events)
    ]
    return KVEventBatch(ts=float(i), events=stored, data_parallel_rank=0)


# --- nothing heard ---------------------------------------------------------------------


def test_record_from_a_host_that_does_not_resolve_says_so(tmp_path: Path) -> None:
    out = tmp_path / "x.kvcap"
    r = kvevents("record", "tcp://no-such-host.invalid:5557", "-o", str(out), "--duration", "2")
    assert r.returncode == 1
    no_traceback(r)
    assert r.stderr.splitlines() == [
        "kvevents: error: no publisher was heard on tcp://no-such-host.invalid:5557 (the host "
        f"name does not resolve) in 2.0 s; nothing written to {out}"
    ]
    assert not out.exists()


def test_record_from_a_dead_engine_with_a_replay_endpoint_says_so(tmp_path: Path) -> None:
    out = tmp_path / "x.kvcap"
    ep, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    r = kvevents("record", ep, "--replay-endpoint", rep, "-o", str(out), "--duration", "1")
    assert r.returncode == 1
    no_traceback(r)
    assert r.stderr.splitlines() == [
        f"kvevents: error: no publisher was heard on {ep} (no connection was made) in 1.0 s; "
        f"nothing written to {out}"
    ]


def test_record_from_an_idle_engine_warns_and_keeps_the_capture(tmp_path: Path) -> None:
    port = free_port()
    pub = ZmqEventPublisher(endpoint=f"tcp://*:{port}")
    out = tmp_path / "x.kvcap"
    try:
        r = kvevents("record", f"tcp://127.0.0.1:{port}", "-o", str(out), "--duration", "2")
    finally:
        pub.shutdown()
    assert r.returncode == 0
    no_traceback(r)
    lines = r.stderr.splitlines()
    assert lines[0] == (
        f"kvevents: warning: tcp://127.0.0.1:{port} connected but sent nothing in 2.0 s "
        "(an idle engine publishes only when its KV cache changes)"
    )
    assert lines[1].startswith("recorded 0 records (0 batches, 0 events)")
    assert out.exists()


def test_route_prompts_against_silent_engines_says_nothing_was_routed(tmp_path: Path) -> None:
    a, b = f"ipc://{tmp_path}/a.ipc", f"ipc://{tmp_path}/b.ipc"
    r = subprocess.run(
        [sys.executable, str(REPO / "examples" / "route_prompts.py"), a, b, "--timeout", "1"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
        cwd=REPO,
    )
    assert r.returncode == 1
    no_traceback(r)
    assert r.stdout == ""
    assert r.stderr.splitlines()[-1] == (
        f"route_prompts: no KV events from {a}, {b} in 1 s; nothing routed (is the engine "
        "running?  An idle engine publishes only once it serves a request)"
    )


# --- a late join: copies are not batches ------------------------------------------------


@pytest.fixture
def busy_publisher() -> Iterator[tuple[str, str]]:
    """A publisher with replay, sending 8-event batches every 4 ms until the test ends."""
    port, rport = free_port(), free_port()
    pub = ZmqEventPublisher(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
    stop = threading.Event()

    def run() -> None:
        i = 0
        while not stop.is_set():
            pub.publish(batch(i))
            i += 1
            stop.wait(0.004)  # the engine's pace

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"
    finally:
        stop.set()
        t.join()
        pub.shutdown()


def test_a_late_record_counts_distinct_batches_and_inspect_agrees(
    busy_publisher: tuple[str, str], tmp_path: Path
) -> None:
    ep, rep = busy_publisher
    time.sleep(0.8)  # join late: the publisher's ring holds ~200 batches by now
    out = tmp_path / "late.kvcap"
    r = kvevents("record", ep, "--replay-endpoint", rep, "-o", str(out), "--count", "300", "-q")
    assert r.returncode == 0, r.stderr
    no_traceback(r)
    with CaptureReader(out) as reader:
        recs = list(reader)
    batches = [x for x in recs if x.seq >= 0]
    distinct = {x.seq for x in batches}
    assert len(distinct) == 300  # --count counts batches, not copies of them
    copies = len(batches) - len(distinct)
    assert f"recorded {len(recs)} records (300 batches, 2400 events" in r.stderr
    if copies:
        assert f"{copies} copies of batches already written" in r.stderr

    s = json.loads(kvevents("inspect", str(out), "--summary", "--json").stdout)
    assert s["batches"] == 300 and s["events"] == 2400
    assert s["seq_duplicates"] == copies
    assert s["records"] == len(recs) == 300 + copies + s["replay_ends"]


# --- a damaged capture adds up ----------------------------------------------------------


def write_damaged(path: Path, n: int = 400) -> tuple[int, int]:
    """``n`` batches; 200 bytes overwritten every 37 kB, then the last 150 bytes cut.
    Returns (the file's size, the records' size before the damage)."""
    with CaptureWriter(path) as w:
        for i in range(n):
            w.write("tcp://e:1", b"", i, encode_batch(batch(i)), recv_ts=1000.0 + i)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        for off in range(37_000, size, 37_000):
            f.seek(off)
            f.write(b"\xff" * 200)
        f.truncate(size - 150)
    return size - 150, size


def test_inspect_and_replay_account_for_a_damaged_capture_the_same_way(tmp_path: Path) -> None:
    cap = tmp_path / "damaged.kvcap"
    size, _ = write_damaged(cap)
    ins = kvevents("inspect", str(cap), "--summary")
    rep = kvevents("replay", str(cap), "--into-index", "-q")
    assert ins.returncode == rep.returncode == 0
    no_traceback(ins)
    no_traceback(rep)
    acct = [ln for ln in ins.stdout.splitlines() if ln.startswith(("file ", "records ", "seqs ",
            "damaged ", "never "))]  # fmt: skip
    acct = acct[1:]  # the first "records" line is the summary's own headline
    assert acct and all(line in rep.stdout.splitlines() for line in acct)

    s = json.loads(kvevents("inspect", str(cap), "--summary", "--json").stdout)
    a = s["account"]
    assert a["file_bytes"] == size
    assert a["header_bytes"] + a["record_bytes"] + a["damaged_bytes"] == size
    assert (
        a["records"]
        == a["batches"] + a["copies"] + a["undecodable"] + a["malformed"] + (a["replay_ends"])
    )
    damaged = [d for d in a["damage"]]
    assert len(damaged) == len(s["skipped_ranges"]) >= 10
    missing = sum(last - first + 1 for d in damaged for _w, first, last in d["missing"])
    # every batch is either in the file or missing around a damaged range; only the
    # torn tail's own batch (after the last intact one) cannot be told
    assert a["batches"] + missing == 399
    assert a["never_recorded"] == []
    assert damaged[-1]["end"] == size  # the torn tail


def test_inspect_summary_for_one_worker_counts_its_records_and_batches(tmp_path: Path) -> None:
    cap = tmp_path / "two.kvcap"
    with CaptureWriter(cap) as w:
        for i in range(30):
            w.write("tcp://a:1", b"", i, encode_batch(batch(i, 2)), recv_ts=float(i))
            if i % 3 == 0:
                w.write("tcp://b:1", b"", i // 3, encode_batch(batch(i, 1)), recv_ts=float(i))
    both = json.loads(kvevents("inspect", str(cap), "--summary", "--json").stdout)
    one = json.loads(
        kvevents("inspect", str(cap), "--summary", "--json", "--worker", "tcp://b:1").stdout
    )
    assert (both["records"], both["batches"], both["events"]) == (40, 40, 70)
    assert (one["records"], one["batches"], one["events"]) == (10, 10, 10)


# --- a config typo ----------------------------------------------------------------------


def test_a_config_value_of_the_wrong_type_is_named_plainly(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.toml"
    cfg.write_text(
        'port = "abc"\n[[engine]]\nname = "a"\nurl = "http://127.0.0.1:1"\n'
        'events = "tcp://127.0.0.1:5557"\n'
    )
    r = kvevents("serve", "--config", str(cfg))
    assert r.returncode == 2
    no_traceback(r)
    assert r.stderr.splitlines() == [f"kvevents: error: {cfg}: port = 'abc' is not a whole number"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvevents",
            "serve",
            "--engine",
            "a=http://127.0.0.1:1,tcp://127.0.0.1:5557",
        ],
        capture_output=True,
        text=True,
        env={**env(), "KVEVENTS_SERVE_LOAD_TOKENS": "many"},
        timeout=60,
        cwd=REPO,
    )
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "kvevents: error: KVEVENTS_SERVE_LOAD_TOKENS: load_tokens = 'many' is not a number"
    ]
