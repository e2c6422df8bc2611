"""The demo's report: the comparison table as text, as JSON, and as a plot.

One job: presenting a :class:`~kvevents.demo.results.DemoReport`.  Imports the
demo's config and results; matplotlib (the ``demo`` extra) only in :func:`write_plot`.
"""

from __future__ import annotations

from typing import Any

from kvevents.demo.config import KV_AWARE_POLICIES, POLICY_LABELS
from kvevents.demo.results import DemoReport

__all__ = ["format_report", "report_to_json", "write_plot"]


def format_report(report: DemoReport) -> str:
    """The demo's comparison as a text table."""
    cfg, eng = report.config, report.engine
    sizes = "/".join(str(g.block_size) for g in eng.groups)
    cpu = (
        f"CPU {eng.num_cpu_chunks} chunks x {eng.blocks_per_chunk} blocks ({eng.cpu_cache_policy})"
        if eng.num_cpu_chunks
        else "no CPU tier"
    )
    lines = [
        f"kvevents demo: {cfg.engines} engines x {cfg.dp_ranks} DP rank(s), GPU {eng.num_gpu_blocks} "
        f"blocks of {sizes} tokens, {cpu}"
        + (f", KV on {eng.device}" if eng.device != "cpu" else ""),
        f"workload: {cfg.requests} chat requests over HTTP through kvevents serve, "
        f"{cfg.tenants} tenants with shared system prompts, {cfg.concurrent_sessions} "
        f"conversations open at once, {cfg.concurrency} requests in flight, seed {cfg.seed}",
        "",
    ]
    header = (
        f"{'policy':<20} {'GPU hit':>8} {'CPU hit':>8} {'total':>7} {'tokens saved':>13} "
        f"{'prefilled':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'req/s':>6} {'events/s':>9} "
        f"{'anomalies':>9}"
    )
    lines += [header, "-" * len(header)]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    for r in report.results:
        lines.append(
            f"{POLICY_LABELS.get(r.policy, r.policy):<20} {r.rate(r.gpu_hit_tokens):>8.1%} "
            f"{r.rate(r.cpu_hit_tokens):>8.1%} {r.hit_rate:>7.1%} {r.tokens_saved:>13,} "
            f"{r.computed_tokens:>10,} {ms(r.ttft_p50_s):>9} {ms(r.ttft_p99_s):>9} "
            f"{r.requests_per_s:>6.1f} {r.events_per_s:>9,.0f} {sum(r.anomalies.values()):>9}"
        )
    lines.append("")
    names = [r.policy for r in report.results]
    if "kv-aware" in names and "round-robin" in names:
        kv, rr = report.result("kv-aware"), report.result("round-robin")
        if rr.computed_tokens:
            lines.append(
                f"KV-aware routing reused {kv.hit_rate:.1%} of prompt tokens vs {rr.hit_rate:.1%} "
                f"for round-robin: {rr.computed_tokens / max(kv.computed_tokens, 1):.2f}x fewer "
                "tokens to prefill."
            )
    if "kv-aware" in names and "kv-aware-gpu" in names:
        kv, gpu = report.result("kv-aware"), report.result("kv-aware-gpu")
        lines.append(
            f"Seeing the CPU tier (GPU and CPU events joined) reused {kv.hit_rate:.1%} vs "
            f"{gpu.hit_rate:.1%} for a router fed GPU events only."
        )
    for policy in KV_AWARE_POLICIES:
        if policy in names:
            kv = report.result(policy)
            if kv.requests:
                lines.append(
                    f"Router prediction ({POLICY_LABELS.get(policy, policy)}, index built from "
                    f"the event stream at arrival) matched the cached_tokens the engine "
                    f"reported exactly for {kv.predicted_exact}/{kv.requests} requests."
                )
    for r in report.results:
        if r.anomalies:
            kinds = ", ".join(f"{k} x{n}" for k, n in sorted(r.anomalies.items()))
            lines.append(f"anomalies ({r.policy}): {kinds}")
            lines.extend(f"  {d}" for d in r.anomaly_details)
    if not any(r.anomalies for r in report.results):
        lines.append("anomalies: none (no seq gaps, losses or restarts)")
    lines.extend(f"note: {n}" for n in report.notes)
    lines.append(f"total wall time {report.wall_s:.1f} s")
    return "\n".join(lines)


def report_to_json(report: DemoReport) -> dict[str, Any]:
    """The report as a JSON-ready dict (rates are fractions, times seconds)."""
    policies = []
    for r in report.results:
        policies.append(
            {
                "policy": r.policy,
                "requests": r.requests,
                "prompt_tokens": r.prompt_tokens,
                "gpu_hit_tokens": r.gpu_hit_tokens,
                "cpu_hit_tokens": r.cpu_hit_tokens,
                "computed_tokens": r.computed_tokens,
                "tokens_saved": r.tokens_saved,
                "gpu_hit_rate": r.rate(r.gpu_hit_tokens),
                "cpu_hit_rate": r.rate(r.cpu_hit_tokens),
                "hit_rate": r.hit_rate,
                "predicted_exact": r.predicted_exact,
                "reported_cached_tokens": r.reported_cached_tokens,
                "failed": r.failed,
                "ttft_p50_s": r.ttft_p50_s,
                "ttft_p99_s": r.ttft_p99_s,
                "requests_per_s": r.requests_per_s,
                "batches": r.batches,
                "events": r.events,
                "events_per_s": r.events_per_s,
                "wall_s": r.wall_s,
                "anomalies": dict(r.anomalies),
                "anomaly_details": list(r.anomaly_details),
                "requests_per_worker": dict(r.requests_per_worker),
            }
        )
    cfg, eng = report.config, report.engine
    return {
        "engines": cfg.engines,
        "dp_ranks": cfg.dp_ranks,
        "requests": cfg.requests,
        "concurrency": cfg.concurrency,
        "seed": cfg.seed,
        "engine": {
            "block_sizes": [g.block_size for g in eng.groups],
            "num_gpu_blocks": eng.num_gpu_blocks,
            "num_cpu_chunks": eng.num_cpu_chunks,
            "blocks_per_chunk": eng.blocks_per_chunk,
            "cpu_cache_policy": eng.cpu_cache_policy,
            "device": eng.device,
        },
        "policies": policies,
        "wall_s": report.wall_s,
        "notes": list(report.notes),
    }


def write_plot(report: DemoReport, path: str) -> str | None:
    """Write a PNG comparing the policies; returns ``None`` on success, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvevents[demo]')"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    names = [POLICY_LABELS.get(r.policy, r.policy).replace(" (", "\n(") for r in report.results]
    gpu = [100 * r.rate(r.gpu_hit_tokens) for r in report.results]
    cpu = [100 * r.rate(r.cpu_hit_tokens) for r in report.results]
    ax1.bar(names, gpu, label="GPU hit", color="#3b75af")
    ax1.bar(names, cpu, bottom=gpu, label="CPU hit", color="#9ecae9")
    for i, r in enumerate(report.results):
        ax1.text(i, gpu[i] + cpu[i] + 1, f"{r.hit_rate:.0%}", ha="center")
    ax1.set_ylabel("prompt tokens reused (%)")
    ax1.set_ylim(0, 100)
    ax1.set_title("prefix-cache hit rate by tier")
    ax1.legend(loc="upper right")
    for r in report.results:
        label = POLICY_LABELS.get(r.policy, r.policy)
        ax2.plot(range(1, len(r.saved_curve) + 1), r.saved_curve, label=label)
    ax2.set_xlabel("requests routed")
    ax2.set_ylabel("prompt tokens saved (cumulative)")
    ax2.set_title("tokens saved over the workload")
    ax2.legend(loc="upper left")
    cfg = report.config
    fig.suptitle(f"kvevents demo: {cfg.engines} engines, {cfg.requests} requests, seed {cfg.seed}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
