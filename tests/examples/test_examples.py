"""Each script of ``examples/`` runs as a user runs it: its own process, real sockets
(ipc), its test mode making it stop by itself.  Consumers are started first and say
``following ...`` once subscribed; engines are started after that line."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from kvevents import read_capture

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def start(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=REPO,
    )


def wait_for_line(proc: subprocess.Popen[str], text: str, timeout: float = 60) -> str:
    """Read the process's stderr until a line containing ``text``."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.1)
        if ready:
            line = proc.stderr.readline()
            if text in line:
                return line
            if not line and proc.poll() is not None:
                break
    raise AssertionError(f"{proc.args}: no line with {text!r} (exit {proc.poll()})")


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out


def engine(ep: str, rep: str, *args: str) -> dict[str, int]:
    """Run publish_engine.py to its end; its totals."""
    proc = start("publish_engine.py", "--endpoint", ep, "--replay-endpoint", rep, "--json", *args)
    return json.loads(finish(proc).splitlines()[-1])


ENGINE_RUN = ["--requests", "50", "--interval", "0.02", "--hold", "0.5"]


@pytest.fixture
def eps(tmp_path: Path) -> Callable[[str], tuple[str, str]]:
    return lambda name: (f"ipc://{tmp_path}/{name}.ipc", f"ipc://{tmp_path}/{name}-r.ipc")


def test_follow_engines_gets_every_batch_and_joins_the_cpu_placeholders(
    eps: Callable[[str], tuple[str, str]],
) -> None:
    ep, rep = eps("a")
    follower = start("follow_engines.py", ep, "--replay-endpoint", rep, "--from-start",
                     "--idle", "2", "--duration", "60", "--json")  # fmt: skip
    wait_for_line(follower, "following")
    totals = engine(ep, rep, *ENGINE_RUN)
    got = json.loads(finish(follower).splitlines()[-1])
    assert totals["dropped_batches"] == 0 and totals["cpu_placeholders"] > 0
    assert got["batches"] == totals["batches"] and got["events"] == totals["events"]
    # A subscriber joining mid-stream may see a gap at the start; replay repairs it.
    assert got["lost_batches"] == 0 and set(got["anomalies"]) <= {"gap"}
    # Every CPU placeholder (block_size 0, no tokens) found its GPU store.
    assert got["joined"] == totals["cpu_placeholders"] and got["unjoined"] == 0
    (tiers,) = got["workers"].values()
    assert 0 < tiers["GPU"] <= 32 and tiers["CPU"] > 0  # the engine's pool: 32 GPU blocks


def test_follow_engines_resets_a_restarted_engine(eps: Callable[[str], tuple[str, str]]) -> None:
    ep, rep = eps("b")
    follower = start("follow_engines.py", ep, "--replay-endpoint", rep, "--from-start",
                     "--idle", "4", "--duration", "60", "--json")  # fmt: skip
    wait_for_line(follower, "following")
    first = engine(ep, rep, *ENGINE_RUN)
    second = engine(ep, rep, *ENGINE_RUN, "--seed", "1")  # the same engine, restarted
    out = finish(follower).splitlines()
    got = json.loads(out[-1])
    assert got["anomalies"].get("publisher_restart") == 1, out
    assert got["resets"] >= 1
    assert any(line.startswith("anomaly publisher_restart") for line in out)
    assert "worker reset" in "\n".join(out)
    assert got["batches"] <= first["batches"] + second["batches"]


def test_route_prompts_sends_each_tenant_to_the_engine_holding_its_prefix(
    eps: Callable[[str], tuple[str, str]],
) -> None:
    (a, ar), (b, br) = eps("t0"), eps("t12")
    router = start("route_prompts.py", a, b, "--replay-endpoint", ar, "--replay-endpoint", br,
                   "--json", "--timeout", "60")  # fmt: skip
    wait_for_line(router, "following")
    engine_a = start("publish_engine.py", "--endpoint", a, "--replay-endpoint", ar,
                     "--tenants", "0", *ENGINE_RUN[:-1], "3")  # fmt: skip
    engine_b = start("publish_engine.py", "--endpoint", b, "--replay-endpoint", br,
                     "--tenants", "1,2", *ENGINE_RUN[:-1], "3")  # fmt: skip
    answers = [json.loads(line) for line in finish(router).splitlines()]
    finish(engine_a)
    finish(engine_b)
    assert [r["worker"] for r in answers] == [f"{a}#0", f"{b}#0", f"{b}#0"]
    for r in answers:  # the 8-block (128-token) system prompt is reusable, the question not
        assert r["gpu"] + r["cpu"] == 128 and r["tokens"] == 168


def test_async_consumer_follows_on_asyncio(eps: Callable[[str], tuple[str, str]]) -> None:
    ep, rep = eps("c")
    consumer = start("async_consumer.py", ep, "--replay-endpoint", rep, "--from-start",
                     "--idle", "2", "--duration", "60", "--every", "0.2")  # fmt: skip
    wait_for_line(consumer, "following")
    totals = engine(ep, rep, *ENGINE_RUN)
    out = finish(consumer).splitlines()
    got = json.loads(out[-1])
    assert got["batches"] == totals["batches"] and set(got["anomalies"]) <= {"gap"}
    assert got["joined"] == totals["cpu_placeholders"] > 0
    assert any(line.startswith("... ") for line in out)  # the other task ran meanwhile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvevents_") and "{" not in line.split(" ")[0]:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
        elif line.startswith("kvevents_"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


def test_prometheus_consumer_serves_the_counters(eps: Callable[[str], tuple[str, str]]) -> None:
    ep, rep = eps("d")
    port = free_port()
    consumer = start("prometheus_consumer.py", ep, "--replay-endpoint", rep, "--from-start",
                     "--port", str(port), "--idle", "4", "--duration", "60")  # fmt: skip
    wait_for_line(consumer, "following")
    totals = engine(ep, rep, *ENGINE_RUN)
    deadline = time.monotonic() + 30
    metrics: dict[str, float] = {}
    while time.monotonic() < deadline:
        metrics = scrape(port)
        if metrics.get("kvevents_subscriber_batches_total") == totals["batches"]:
            break
        time.sleep(0.05)  # polling a condition, bounded by the deadline
    assert metrics["kvevents_subscriber_batches_total"] == totals["batches"]
    assert metrics["kvevents_subscriber_events_total"] == totals["events"]
    assert metrics["kvevents_index_joined_total"] == totals["cpu_placeholders"] > 0
    assert metrics["kvevents_decoder_tolerant_batches_total"] == 0  # vLLM-shaped payloads
    finish(consumer)


def test_the_sample_capture_script_writes_where_told_and_matches_the_tracked_file(
    tmp_path: Path,
) -> None:
    tracked = EXAMPLES / "sample.kvcap"
    before = tracked.read_bytes()
    out = tmp_path / "s.kvcap"
    subprocess.run(
        [sys.executable, str(EXAMPLES / "make_sample_capture.py"), str(out)],
        check=True, env=ENV, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    assert read_capture(out).records == read_capture(tracked).records
    default = subprocess.run(
        [sys.executable, str(EXAMPLES / "make_sample_capture.py")],
        check=True, env=ENV, capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    written = Path(default.stdout.split("wrote ", 1)[1].strip())
    assert written.exists() and written.parent != EXAMPLES
    assert tracked.read_bytes() == before  # the tracked file is never rewritten
