"""What a newcomer trips over first: ``--version``, ``python -m kvevents``, anomalies
printed once, a demo bound to loopback whose results survive a bad ``--plot``, one line
naming the extra for each missing optional dependency, and progress only on a terminal."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

import kvevents
import kvevents.demo as demo_module
from kvevents.capture import CaptureWriter, read_capture
from kvevents.cli import main
from kvevents.errors import MissingDependencyError
from kvevents.native import core_name

from ._run import env, on_terminal, without
from ._run import kvevents as run_kvevents

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sample.kvcap"
QUICK = ["demo", "--quick", "--requests", "24", "--plot", ""]


def test_version_and_python_dash_m() -> None:
    got = run_kvevents("--version")
    assert got.returncode == 0
    assert got.stdout.strip() == f"kvevents {kvevents.__version__} (core: {core_name()})"
    got = run_kvevents("inspect", str(SAMPLE), "--limit", "1")
    assert got.returncode == 0 and "BlockStored" in got.stdout


def test_a_usage_mistake_is_one_line_and_exit_2() -> None:
    rec = ["record", "ipc:///nonexistent/x.ipc", "-o", "/nonexistent/x.kvcap"]
    for args in (
        ["bogus"],
        ["inspect"],
        ["demo", "--policy", "best"],
        ["demo", "--requests", "0"],
        ["demo", "--engines", "-1"],
        ["demo", "--device", "tpu"],
        ["record", "tcp://x:1"],  # no -o
        [*rec, "--count", "0"],
        [*rec, "--duration", "-1"],
        ["replay", str(SAMPLE), "--publish", "ipc:///nonexistent/x", "--buffer-steps", "0"],
    ):
        got = run_kvevents(*args)
        assert got.returncode == 2, args
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvevents"), got.stderr
        assert ": error: " in lines[0]


@pytest.fixture
def holed_capture(sim_capture: tuple[Path, list[bytes]], tmp_path: Path) -> Path:
    path, _ = sim_capture
    holed = tmp_path / "holed.kvcap"
    with CaptureWriter(holed) as w:
        for rec in read_capture(path).records:
            if rec.seq not in (5, 6):
                w.write_record(rec)
    return holed


def test_each_anomaly_is_reported_once(holed_capture: Path) -> None:
    got = run_kvevents("replay", str(holed_capture), "--into-index", "--json")
    assert got.returncode == 0
    anomalies = json.loads(got.stdout)["anomalies"]
    assert anomalies  # a gap and the loss that follows it
    assert got.stderr == ""  # no log line repeating them
    got = run_kvevents("replay", str(holed_capture), "--into-index")
    assert got.returncode == 0 and got.stderr == ""
    printed = [x for x in got.stdout.splitlines() if x.startswith("anomaly ")]
    assert len(printed) == len(anomalies)
    assert len(set(printed)) == len(printed)


# --- the demo ------------------------------------------------------------------------------
@pytest.fixture
def bound_endpoints(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The addresses the demo's engine publishers were actually bound to."""
    seen: list[str] = []
    real = demo_module.run_demo

    def spy(config: Any, **kw: Any) -> Any:
        start = kw.pop("on_start")

        def on_start(policy: str, cluster: Any) -> None:
            seen.extend(w.engine_endpoint for w in cluster.workers)
            seen.extend(w.engine_replay_endpoint for w in cluster.workers)
            start(policy, cluster)

        return real(config, on_start=on_start, **kw)

    monkeypatch.setattr(demo_module, "run_demo", spy)
    return seen


def test_the_demo_binds_loopback_unless_told_otherwise(
    bound_endpoints: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*QUICK, "--policy", "random", "-q"]) == 0
    assert bound_endpoints and all(e.startswith("tcp://127.0.0.1:") for e in bound_endpoints)
    bound_endpoints.clear()
    assert main([*QUICK, "--policy", "random", "-q", "--host", "0.0.0.0"]) == 0
    assert bound_endpoints and all(e.startswith("tcp://0.0.0.0:") for e in bound_endpoints)
    capsys.readouterr()
    args = [*QUICK, "--host", "0.0.0.0", "--endpoint", "tcp://127.0.0.1:5557"]
    assert main(args) == 2
    assert "--endpoint (its host included) or --host, not both" in capsys.readouterr().err


def test_results_come_before_the_plot_and_a_bad_plot_loses_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")  # the `demo` extra
    # A directory that does not exist: refused before anything runs.
    missing = tmp_path / "no" / "such" / "demo.png"
    assert main([*QUICK, "--plot", str(missing), "-q"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip().splitlines() == [
        f"kvevents: error: --plot {missing}: directory {missing.parent} does not exist"
    ]
    # A path that fails only when written (a directory): the results are printed first.
    taken = tmp_path / "taken.png"
    taken.mkdir()
    assert main([*QUICK, "--plot", str(taken), "-q"]) == 2
    out = capsys.readouterr()
    assert "KV-aware routing reused" in out.out and "plot written" not in out.out
    (line,) = out.err.strip().splitlines()
    assert line.startswith(f"kvevents: error: --plot {taken}: the plot was not written")
    # The same with --json: a whole JSON object, then the error line.
    assert main([*QUICK, "--plot", str(taken), "-q", "--json"]) == 2
    out = capsys.readouterr()
    js = json.loads(out.out)
    assert js["plot"] is None and len(js["policies"]) == 4
    assert len(out.err.strip().splitlines()) == 1


def test_the_demo_without_torch_prints_the_same_hit_rates() -> None:
    """torch only moves the simulated KV bytes: the engine's events and reuse are the same
    with and without those copies (checked on a seeded in-process run, since the demo's
    HTTP path itself varies a little from run to run), and the demo runs without torch,
    saying so in one note."""
    pytest.importorskip("torch")
    from kvevents.events import KVEventBatch
    from kvevents.sim import SimEngineConfig, WorkloadConfig, generate_workload
    from kvevents.sim.engine import SimEngine

    def run(transfers: bool) -> tuple[list[list[object]], list[object]]:
        batches: list[KVEventBatch] = []

        class Sink:
            def publish(self, batch: KVEventBatch) -> None:
                batches.append(batch)

            def shutdown(self) -> None:
                return None

        cfg = SimEngineConfig(num_gpu_blocks=64, num_cpu_chunks=32, blocks_per_chunk=2,
                              transfers=transfers)  # fmt: skip
        engine = SimEngine(cfg, Sink())
        for r in generate_workload(WorkloadConfig(num_requests=60, seed=1)):
            engine.add_request(r)
        while not engine.idle:
            engine.step()
        return [list(b.events) for b in batches], list(engine.admissions)

    with_copies, without_copies = run(True), run(False)
    assert with_copies[0] and with_copies[1]
    assert with_copies == without_copies
    no_torch = without("torch", *QUICK, "--json", "-q")
    assert no_torch.returncode == 0, no_torch.stderr
    assert any("torch is not installed" in n for n in json.loads(no_torch.stdout)["notes"])
    assert no_torch.stderr == ""


# --- optional dependencies -------------------------------------------------------------------
def test_each_missing_optional_dependency_names_its_extra() -> None:
    got = without("torch", *QUICK, "--device", "cuda")
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [
        "kvevents: error: --device cuda needs torch, which is not installed: "
        "pip install 'kvevents[offload]'"
    ]
    got = without("matplotlib", *QUICK[:-2], "--policy", "random", "--plot", "x.png", "-q")
    assert got.returncode == 0 and got.stderr == ""
    assert got.stdout.strip().splitlines()[-1] == (
        "plot skipped: matplotlib is not installed (pip install 'kvevents[demo]')"
    )


def test_missing_torch_or_prometheus_client_raise_one_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from kvevents.metrics import StatsCollector, start_metrics_server

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'kvevents\[metrics\]'"):
        start_metrics_server(0, StatsCollector())
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "kvevents.publishers.offload.transfer", raising=False)
    import kvevents.publishers.offload as offload

    monkeypatch.delattr(offload, "transfer", raising=False)  # as if never imported

    with pytest.raises(MissingDependencyError, match=r"pip install 'kvevents\[offload\]'"):
        offload.CPUTransferWorker  # noqa: B018 - the lazy import is what is tested
    assert issubclass(MissingDependencyError, ImportError)


# --- progress ----------------------------------------------------------------------------------
def test_progress_shows_on_a_terminal_only(sim_capture: tuple[Path, list[bytes]]) -> None:
    path, _ = sim_capture
    for args, shows in (
        (["replay", str(path), "--into-index"], "replaying"),
        (["inspect", str(path), "--summary"], "summarizing"),
        ([*QUICK, "--policy", "random"], "requests routed"),
    ):
        rc, out, terminal = on_terminal(*args)
        assert rc == 0 and shows in terminal, (args, terminal)
        assert shows not in out
        piped = run_kvevents(*args)
        assert piped.returncode == 0 and shows not in piped.stderr + piped.stdout, args


def test_record_shows_a_live_counter_on_a_terminal(tmp_path: Path) -> None:
    from kvevents.events import KVEventBatch
    from kvevents.publishers import ZmqEventPublisher

    ep = f"ipc://{tmp_path}/rec.ipc"
    out = tmp_path / "rec.kvcap"
    stop = threading.Event()
    with ZmqEventPublisher(endpoint=ep) as pub:

        def feed() -> None:  # until the recorder has its batches
            while not stop.is_set():
                pub.publish(KVEventBatch(1.0, [], 0))
                stop.wait(0.01)

        feeder = threading.Thread(target=feed)
        feeder.start()
        try:
            rc, _, terminal = on_terminal("record", ep, "-o", str(out), "--count", "20")
        finally:
            stop.set()
            feeder.join()
    assert rc == 0
    assert f"recording {out}: " in terminal and "recorded 20 records (20 batches" in terminal
    assert len(read_capture(out).records) == 20
    assert env()["PYTHONPATH"]
