"""The demo's disaggregated scenario: simulated prefill and decode engines behind
``kvevents serve``, the same seeded multi-turn chat workload routed with the KV-aware
prefill choice and with round-robin, and what each reused on its prefill engines.

One job: :func:`run_disagg` and :func:`format_disagg`.  Imports the demo's config and
stack, the service's config and the load generator; httpx (the ``serve`` extra) when it
runs.

Reuse is the prefill engines' own ground truth (their simulators' GPU and CPU hit
tokens over their prompt tokens): in a disaggregated fleet the prompt is computed
there, and a follow-up turn reuses its history only on the prefill engine that
computed the turn before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvevents.demo.config import DemoConfig
from kvevents.demo.stack import LocalStack
from kvevents.serve import require_serve_extra
from kvevents.serve.loadgen import run_loadgen

__all__ = ["DISAGG_POLICIES", "DisaggResult", "format_disagg", "run_disagg"]

DISAGG_POLICIES: tuple[str, ...] = ("kv-aware", "round-robin")
"""The prefill choices compared: the KV-aware cost, and round-robin as the baseline."""


@dataclass
class DisaggResult:
    """One policy's run: requests (``disaggregated`` of them in two steps), the
    prefill engines' prompt and reused tokens (their own counters), the decode engines'
    received tokens, the truth check of the prefill steps, time to first token per
    path, and the prefill steps per prefill engine."""

    policy: str
    requests: int = 0
    failed: int = 0
    disaggregated: int = 0
    prefill_prompt_tokens: int = 0
    prefill_reused_tokens: int = 0
    prefill_computed_tokens: int = 0
    decode_received_tokens: int = 0
    truth_exact: int = 0
    truth_checks: int = 0
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    prefills: dict[str, int] = field(default_factory=dict)

    @property
    def prefill_reuse(self) -> float:
        """Reused over prompt tokens on the prefill engines."""
        p = self.prefill_prompt_tokens
        return self.prefill_reused_tokens / p if p else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "requests": self.requests,
            "failed": self.failed,
            "disaggregated": self.disaggregated,
            "prefill_reuse": round(self.prefill_reuse, 4),
            "prefill_prompt_tokens": self.prefill_prompt_tokens,
            "prefill_reused_tokens": self.prefill_reused_tokens,
            "prefill_computed_tokens": self.prefill_computed_tokens,
            "decode_received_tokens": self.decode_received_tokens,
            "truth_exact": self.truth_exact,
            "truth_checks": self.truth_checks,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p90_s": self.ttft_p90_s,
            "prefills": self.prefills,
        }


def _run_one(
    policy: str,
    config: DemoConfig,
    prefill: int,
    decode: int,
    min_uncached: int,
    progress: Callable[[str, int, int], None] | None,
) -> DisaggResult:
    import httpx

    sim = config.sim_http()
    serve = config.serve(policy, pd_min_uncached_tokens=min_uncached)
    res = DisaggResult(policy)
    with LocalStack(0, serve=serve, sim=sim, prefill=prefill, decode=decode) as stack:
        deadline = time.monotonic() + config.catch_up_timeout_s
        while time.monotonic() < deadline:  # poll until the service has caught up
            try:
                if httpx.get(stack.url + "/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)

        def tick(done: int, total: int) -> None:
            if progress is not None:
                progress(policy, done, total)

        report = asyncio.run(run_loadgen(config.loadgen(stack.url), progress=tick))
        lg = report.to_json()
        res.requests, res.failed = lg["ok"], lg["failed"]
        res.disaggregated = lg["paths"].get("disaggregated", {}).get("requests", 0)
        res.ttft_p50_s, res.ttft_p90_s = lg["ttft_p50_s"], lg["ttft_p90_s"]
        res.prefills = lg["prefill_workers"]
        for e in stack.engines:
            st = e.engine.stats
            if e.role == "prefill":
                res.prefill_prompt_tokens += st.prompt_tokens
                res.prefill_reused_tokens += st.gpu_hit_tokens + st.cpu_hit_tokens
                res.prefill_computed_tokens += st.computed_tokens
            else:
                res.decode_received_tokens += st.remote_tokens
        roles = httpx.get(stack.url + "/workers", timeout=10).json()["roles"]
        pre = roles.get("prefill", {})
        res.truth_exact = pre.get("exact", 0)
        res.truth_checks = pre.get("exact", 0) + pre.get("over", 0) + pre.get("under", 0)
    return res


def run_disagg(
    config: DemoConfig | None = None,
    *,
    prefill: int = 3,
    decode: int = 2,
    min_uncached: int = 64,
    policies: Sequence[str] = DISAGG_POLICIES,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[DisaggResult]:
    """Run the workload of ``config`` once per policy of ``policies`` on ``prefill``
    prefill and ``decode`` decode engines (fresh ones each time), disaggregating
    requests whose best prefill engine would compute at least ``min_uncached`` tokens."""
    require_serve_extra("kvevents demo --disaggregated")
    config = config or DemoConfig()
    return [_run_one(p, config, prefill, decode, min_uncached, progress) for p in policies]


def format_disagg(results: Sequence[DisaggResult]) -> str:
    """The scenario's table: per policy, requests, disaggregated ones, reuse on the
    prefill engines, prefill tokens computed, time to first token and the truth check."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    head = (
        f"{'prefill choice':<15}{'requests':>9}{'split':>7}{'prefill reuse':>15}"
        f"{'computed':>10}{'TTFT p50':>10}{'TTFT p90':>10}{'exact':>11}"
    )
    lines = ["disaggregated scenario (prefill engines' own counters)", head]
    for r in results:
        lines.append(
            f"{r.policy:<15}{r.requests:>9}{r.disaggregated:>7}{r.prefill_reuse:>15.1%}"
            f"{r.prefill_computed_tokens:>10}{ms(r.ttft_p50_s):>10}{ms(r.ttft_p90_s):>10}"
            f"{f'{r.truth_exact}/{r.truth_checks}':>11}"
        )
    return "\n".join(lines)
