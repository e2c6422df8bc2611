"""``kvevents demo``: the README's main command."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvevents.cli import main
from kvevents.demo import DemoConfig, DemoReport, run_demo, waves
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


def test_the_same_seed_sends_the_same_workload(quick_report: DemoReport) -> None:
    # over HTTP, which engine answers first varies from run to run; the conversations,
    # and so the prompts the engines see, do not
    again = run_demo(DemoConfig.quick(policies=("round-robin",)))
    assert (
        again.result("round-robin").prompt_tokens == quick_report.result("kv-aware").prompt_tokens
    )
    for r in quick_report.results:
        assert r.failed == 0 and r.ttft_p50_s is not None and r.requests_per_s > 0
        assert sum(r.requests_per_worker.values()) == r.requests
        # what the clients were told they reused is what the engines counted
        assert r.reported_cached_tokens == r.tokens_saved
