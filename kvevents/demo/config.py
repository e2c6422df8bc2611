"""What the demo runs: the policies it compares, the engine shape, the workload size
and timing (:class:`DemoConfig`), and how arrivals are cut into waves.

One job: the demo's configuration.  Imports the sim engine's, its HTTP front's and the
service's configs, the workload and the load generator's config (none of which needs
an extra at import).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvevents.serve.config import ServeConfig
from kvevents.serve.loadgen import LoadgenConfig
from kvevents.sim.block_pool import KVCacheGroupSpec
from kvevents.sim.engine import SimEngineConfig
from kvevents.sim.http import SimHTTPConfig
from kvevents.sim.workload import SimRequest

__all__ = ["KV_AWARE_POLICIES", "POLICIES", "POLICY_LABELS", "DemoConfig", "waves"]

POLICIES: tuple[str, ...] = ("kv-aware", "kv-aware-gpu", "round-robin", "random")
"""The routing policies the demo compares (``kv-aware-gpu``: KV-aware on GPU events only)."""

POLICY_LABELS: dict[str, str] = {"kv-aware-gpu": "kv-aware (GPU only)"}
"""How the report names a policy, where it differs from its id."""

KV_AWARE_POLICIES: tuple[str, ...] = ("kv-aware", "kv-aware-gpu")
"""The policies that route on the index (their predictions are checked)."""


def default_demo_engine() -> SimEngineConfig:
    """The demo's engine shape: one group of 16-token blocks, 96 GPU blocks and 128 CPU
    chunks of 4 blocks (small enough that placement matters)."""
    return SimEngineConfig(
        groups=(KVCacheGroupSpec(16),),
        num_gpu_blocks=96,
        num_cpu_chunks=128,
        blocks_per_chunk=4,
        decode_tokens_per_step=16,
        max_running=8,
    )


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs.  ``engine=None`` picks the default shape: one group of
    16-token blocks, 96 GPU blocks and 128 CPU chunks of 4 blocks per engine (small
    enough that placement matters).  ``wave`` is how many requests arrive between two
    catch-ups of the index.  ``bind`` is the engines' PUB endpoint (see
    :class:`~kvevents.sim.cluster.ClusterConfig`; a fixed port lets ``kvevents record``
    follow the engines).  ``hold_s`` keeps each policy's engines up that many seconds
    before routing starts and after it ends, so outside subscribers have time to
    connect (ZMQ retries a refused connection only every ~100 ms) and to fetch replays.
    ``device`` holds the engines' simulated KV cache (``"cuda"`` moves the offload copies
    through CUDA streams and pinned host memory).  ``record_path`` writes every batch the
    service's subscriber receives to a capture file (all policies, each its own engines).
    ``concurrency`` is how many requests the load generator keeps in flight;
    ``step_s`` / ``prefill_s_per_token`` the simulated engines' timing (100 µs per prompt
    token computed: 10k tokens/s of prefill, so reuse shows in time to first token); with
    ``dp_ranks`` > 1 every rank is its own simulated engine with its own HTTP front;
    ``load_tokens`` is the service's price of a request in flight (``--load-tokens``)."""

    engines: int = 4
    requests: int = 320
    seed: int = 0
    concurrency: int = 8
    dp_ranks: int = 1
    tenants: int = 4
    concurrent_sessions: int = 16
    policies: tuple[str, ...] = POLICIES
    engine: SimEngineConfig | None = None
    catch_up_timeout_s: float = 20.0
    bind: str = "tcp://127.0.0.1:0"
    hold_s: float = 0.0
    device: str = "cpu"
    record_path: str | None = None
    step_s: float = 0.002
    prefill_s_per_token: float = 1e-4
    load_tokens: float = 64.0

    @classmethod
    def quick(cls, **overrides: Any) -> DemoConfig:
        """A seconds-long run (fewer engines and requests)."""
        base = cls(engines=3, requests=72, concurrent_sessions=9, tenants=3, concurrency=6)
        return replace(base, **overrides)

    def engine_config(self) -> SimEngineConfig:
        """The engine shape: :attr:`engine`, else the default, on :attr:`device`."""
        base = self.engine or default_demo_engine()
        return base if self.device == "cpu" else replace(base, device=self.device)

    def sim_http(self) -> SimHTTPConfig:
        """The simulated engines' HTTP fronts: :meth:`engine_config` at the demo's timing."""
        return SimHTTPConfig(
            engine=self.engine_config(),
            step_s=self.step_s,
            prefill_s_per_token=self.prefill_s_per_token,
        )

    def serve(self, policy: str, **options: Any) -> ServeConfig:
        """The service's configuration routing by ``policy``, scraping the engines every
        0.25 s; ``options`` are further :class:`ServeConfig` fields."""
        return ServeConfig(
            policy=policy,
            blocks_per_chunk=self.engine_config().blocks_per_chunk,
            seed=self.seed,
            scrape_interval_s=0.25,
            load_tokens=self.load_tokens,
            **options,
        )

    def loadgen(self, url: str) -> LoadgenConfig:
        """The load generator's configuration against ``url``."""
        return LoadgenConfig(
            url,
            requests=self.requests,
            tenants=self.tenants,
            sessions=self.concurrent_sessions,
            concurrency=self.concurrency,
            seed=self.seed,
        )


def waves(requests: Sequence[SimRequest], size: int) -> list[list[SimRequest]]:
    """Split arrivals into waves of at most ``size``; a wave never holds two turns of one
    session (the later turn waits for the earlier answer)."""
    out: list[list[SimRequest]] = []
    cur: list[SimRequest] = []
    sessions: set[int] = set()
    for r in requests:
        if len(cur) >= size or r.session in sessions:
            out.append(cur)
            cur, sessions = [], set()
        cur.append(r)
        sessions.add(r.session)
    if cur:
        out.append(cur)
    return out
