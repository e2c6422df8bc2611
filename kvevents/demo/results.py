"""What the demo measured: one :class:`PolicyResult` per routing policy and the
:class:`DemoReport` that holds them.

One job: the demo's result types.  Imports only the demo's config and the sim engine's
config.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvevents.demo.config import DemoConfig
from kvevents.sim.engine import SimEngineConfig

__all__ = ["DemoReport", "PolicyResult"]


@dataclass
class PolicyResult:
    """What one policy achieved on the workload (tokens are prompt tokens)."""

    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    computed_tokens: int = 0
    predicted_tokens: int = 0
    predicted_exact: int = 0
    batches: int = 0
    events: int = 0
    wall_s: float = 0.0
    """Seconds spent routing and serving the workload (after start-up)."""
    consume_s: float = 0.0
    anomalies: Counter[str] = field(default_factory=Counter)
    anomaly_details: list[str] = field(default_factory=list)
    requests_per_worker: Counter[str] = field(default_factory=Counter)
    saved_curve: list[int] = field(default_factory=list)
    index_holdings: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    """What the index held at the end: per ``source#rank`` and tier, (entries, tokens)."""
    reported_cached_tokens: int = 0
    """Σ ``cached_tokens`` the engines reported to the clients."""
    failed: int = 0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    requests_per_s: float = 0.0

    @property
    def tokens_saved(self) -> int:
        return self.gpu_hit_tokens + self.cpu_hit_tokens

    def rate(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens reused from any tier."""
        return self.rate(self.tokens_saved)

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class DemoReport:
    """All policies' results, with the configuration that produced them."""

    config: DemoConfig
    engine: SimEngineConfig
    results: list[PolicyResult]
    wall_s: float
    notes: list[str] = field(default_factory=list)

    def result(self, policy: str) -> PolicyResult:
        for r in self.results:
            if r.policy == policy:
                return r
        raise KeyError(policy)
