"""``kvevents demo``: the README's main command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvevents.cli import main
from kvevents.sim.demo import DemoConfig, DemoReport, run_demo, waves
from kvevents.sim.workload import WorkloadConfig, generate_workload


def test_waves_never_hold_two_turns_of_one_session() -> None:
    reqs = generate_workload(WorkloadConfig(num_requests=100, seed=1))
    ws = waves(reqs, 8)
    assert [r for w in ws for r in w] == reqs
    for w in ws:
        assert 1 <= len(w) <= 8
        assert len({r.session for r in w}) == len(w)


@pytest.fixture(scope="module")
def quick_report() -> DemoReport:
    return run_demo(DemoConfig.quick())


def test_kv_aware_routing_beats_round_robin_and_random(quick_report: DemoReport) -> None:
    kv = quick_report.result("kv-aware")
    rr = quick_report.result("round-robin")
    rnd = quick_report.result("random")
    assert kv.requests == rr.requests == rnd.requests == DemoConfig.quick().requests
    assert kv.prompt_tokens == rr.prompt_tokens  # the same workload for every policy
    assert kv.hit_rate > rr.hit_rate + 0.05
    assert kv.hit_rate > rnd.hit_rate + 0.05
    assert kv.computed_tokens < rr.computed_tokens
    for r in quick_report.results:
        assert not r.anomalies, r.anomalies
        assert r.events > 0 and r.batches > 0
        assert r.tokens_saved == r.gpu_hit_tokens + r.cpu_hit_tokens
    # The router's view, built only from events, mostly predicts the engines exactly.
    assert kv.predicted_exact >= 0.8 * kv.requests


def test_the_gpu_only_router_sees_no_cpu_tier(quick_report: DemoReport) -> None:
    kv, gpu = quick_report.result("kv-aware"), quick_report.result("kv-aware-gpu")
    assert gpu.requests == kv.requests and gpu.prompt_tokens == kv.prompt_tokens
    assert not gpu.anomalies
    # its index was fed GPU events only; the engines still have (and use) a CPU tier
    assert all(tiers["CPU"][0] == 0 for tiers in gpu.index_holdings.values())
    assert any(tiers["CPU"][0] > 0 for tiers in kv.index_holdings.values())
    assert gpu.cpu_hit_tokens > 0


def test_the_demo_command_prints_the_comparison_and_writes_a_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")  # the `demo` extra
    png = tmp_path / "demo.png"
    assert main(["demo", "--quick", "--seed", "3", "--plot", str(png), "-q"]) == 0
    out = capsys.readouterr().out
    for policy in ("kv-aware ", "kv-aware (GPU only)", "round-robin", "random"):
        assert any(line.startswith(policy) for line in out.splitlines())
    assert "for a router fed GPU events only" in out
    assert "GPU hit" in out and "CPU hit" in out and "tokens saved" in out
    assert "KV-aware routing reused" in out
    assert f"plot written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_demo_is_deterministic_for_a_seed(quick_report: DemoReport) -> None:
    again = run_demo(DemoConfig.quick(policies=("kv-aware", "round-robin")))
    for policy in ("kv-aware", "round-robin"):
        a, b = quick_report.result(policy), again.result(policy)
        assert (a.gpu_hit_tokens, a.cpu_hit_tokens, a.events) == (
            b.gpu_hit_tokens,
            b.cpu_hit_tokens,
            b.events,
        )


def test_engines_with_several_dp_ranks_are_routed_as_separate_workers() -> None:
    cfg = DemoConfig.quick(engines=2, dp_ranks=2, requests=40, policies=("kv-aware",))
    report = run_demo(cfg)
    (kv,) = report.results
    assert kv.requests == 40 and not kv.anomalies
    assert set(kv.requests_per_worker) <= {
        "engine0/dp0",
        "engine0/dp1",
        "engine1/dp0",
        "engine1/dp1",
    }
    assert len(kv.requests_per_worker) >= 3


def test_demo_option_errors_are_reported_not_raised(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--quick", "--hold", "-1", "--plot", ""]) == 2
    assert "kvevents: error:" in capsys.readouterr().err


def test_the_report_lists_every_anomaly_by_policy() -> None:
    from collections import Counter

    from kvevents.sim.demo import PolicyResult, format_report
    from kvevents.sim.engine import SimEngineConfig

    ok = PolicyResult("kv-aware", requests=1, prompt_tokens=100, gpu_hit_tokens=50)
    bad = PolicyResult(
        "round-robin",
        requests=1,
        prompt_tokens=100,
        gpu_hit_tokens=10,
        computed_tokens=90,
        anomalies=Counter({"unrecoverable_loss": 1}),
        anomaly_details=["unrecoverable_loss tcp://127.0.0.1:9#0: seq 3..5 no longer buffered"],
    )
    text = format_report(DemoReport(DemoConfig(), SimEngineConfig(), [ok, bad], 1.0))
    assert "anomalies (round-robin): unrecoverable_loss x1" in text
    assert "  unrecoverable_loss tcp://127.0.0.1:9#0: seq 3..5 no longer buffered" in text
    assert "anomalies: none" not in text
    assert "50.0%" in text and "10.0%" in text


def test_hybrid_engines_with_two_block_sizes_route_end_to_end() -> None:
    from kvevents.sim import KVCacheGroupSpec, SimEngineConfig

    engine = SimEngineConfig(
        groups=(KVCacheGroupSpec(16), KVCacheGroupSpec(32)),
        num_gpu_blocks=160,
        num_cpu_chunks=96,
        blocks_per_chunk=2,
        decode_tokens_per_step=16,
    )
    cfg = DemoConfig.quick(engine=engine, requests=48, policies=("kv-aware", "round-robin"))
    report = run_demo(cfg)
    kv, rr = report.result("kv-aware"), report.result("round-robin")
    assert not kv.anomalies and not rr.anomalies
    assert kv.hit_rate > rr.hit_rate
    assert kv.predicted_exact >= 0.7 * kv.requests


def test_demo_engine_flags_shape_the_engines(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--quick", "--requests", "24", "--policy", "kv-aware", "--plot", "", "-q"]
    shape = ["--block-sizes", "16,32", "--gpu-blocks", "200", "--cpu-chunks", "64"]
    assert main([*args, *shape, "--blocks-per-chunk", "2", "--cpu-policy", "arc"]) == 0
    out = capsys.readouterr().out
    assert "GPU 200 blocks of 16/32 tokens, CPU 64 chunks x 2 blocks (arc)" in out
    assert "anomalies: none" in out
    assert main([*args, *shape, "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["engine"]["block_sizes"] == [16, 32] and js["plot"] is None
    (kv,) = js["policies"]
    assert kv["policy"] == "kv-aware" and kv["requests"] == 24 and kv["anomalies"] == {}
    assert kv["tokens_saved"] == kv["gpu_hit_tokens"] + kv["cpu_hit_tokens"] > 0
    assert main([*args, "--block-sizes", "16,x"]) == 2
    assert "--block-sizes wants integers" in capsys.readouterr().err
    assert main([*args, "--gpu-blocks", "0"]) == 2
    assert "num_gpu_blocks must be positive" in capsys.readouterr().err


def test_without_matplotlib_the_plot_is_skipped_with_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from kvevents.sim.demo import PolicyResult, write_plot
    from kvevents.sim.engine import SimEngineConfig

    report = DemoReport(DemoConfig(), SimEngineConfig(), [PolicyResult("kv-aware")], 0.1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    png = tmp_path / "none.png"
    why = write_plot(report, str(png))
    assert why is not None and "matplotlib is not installed" in why
    assert not png.exists()


def test_the_demo_records_its_stream_and_the_capture_replays_to_the_same_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cap = tmp_path / "demo.kvcap"
    cfg = DemoConfig.quick(requests=36, policies=("kv-aware",), record_path=str(cap))
    (kv,) = run_demo(cfg).results
    assert main(["replay", str(cap), "--into-index", "--json", "--blocks-per-chunk", "4"]) == 0
    js = json.loads(capsys.readouterr().out)
    replayed = {
        f"{w['source']}#{w['dp_rank']}": {
            t: (v["entries"], v["tokens"]) for t, v in w["tiers"].items()
        }
        for w in js["workers"]
    }
    assert replayed == kv.index_holdings
    assert js["anomalies"] == []
    assert main(["inspect", str(cap), "--summary", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["events"] == kv.events and summary["meta"]["recorder"] == "kvevents demo"
