"""What a simulated HTTP engine is: its engine shape, its timing, its model names.

One job: :class:`SimHTTPConfig` and its defaults.  Imports only the sim engine's config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvevents.sim.block_pool import KVCacheGroupSpec
from kvevents.sim.engine import SimEngineConfig

__all__ = ["MODEL", "SimHTTPConfig", "default_http_engine"]

MODEL = "sim-model"
"""The base model id the simulated engines serve by default."""


def default_http_engine() -> SimEngineConfig:
    """The engine shape ``kvevents sim serve`` uses by default: 16-token blocks, 1024
    GPU blocks (16k tokens), 512 CPU chunks of 4 blocks."""
    return SimEngineConfig(
        groups=(KVCacheGroupSpec(16),),
        num_gpu_blocks=1024,
        num_cpu_chunks=512,
        blocks_per_chunk=4,
        decode_tokens_per_step=16,
        max_running=16,
    )


@dataclass(frozen=True)
class SimHTTPConfig:
    """Timing and shape of one simulated HTTP engine.

    ``step_s``: fixed cost of an engine step (seconds); ``prefill_s_per_token``: added
    per prompt token computed (not reused) in the step; ``default_max_tokens``: output
    length when a request gives no ``max_tokens``; ``loras``: adapter names served
    besides the base model; ``buffer_steps``: replay buffer of the publisher (batches);
    ``events_after_step``: a step's KV events are published once its simulated time
    (``step_s`` + prefill) has passed, as vLLM publishes them after the step's forward
    pass (False: at the step's start, before its prefill time).
    """

    engine: SimEngineConfig = field(default_factory=default_http_engine)
    step_s: float = 0.002
    prefill_s_per_token: float = 2e-5
    default_max_tokens: int = 32
    loras: tuple[str, ...] = ()
    buffer_steps: int = 10_000
    vocab_size: int = 32_000
    model: str = MODEL
    events_after_step: bool = True
