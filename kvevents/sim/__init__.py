"""An engine simulator that emits vLLM-shaped KV events (drives the demo and tests).

:class:`SimEngine` is one engine (one DP rank): a :class:`GPUBlockPool` with prefix
caching and vLLM-compatible hashes, an optional CPU tier (:class:`SimOffload`, over
``kvevents.publishers.offload``), and a publisher.  :func:`generate_workload` makes a
seeded chat workload.
"""

from kvevents.sim.block_pool import (
    BlockPoolStats,
    GPUBlockPool,
    KVCacheGroupSpec,
    RequestHasher,
    group_block_hashes,
    hash_block_size,
)
from kvevents.sim.engine import BatchSink, EngineStats, RequestResult, SimEngine, SimEngineConfig
from kvevents.sim.offload import (
    OffloadSimStats,
    SimOffload,
    expected_block_bytes,
    offload_available,
)
from kvevents.sim.workload import SimRequest, WorkloadConfig, generate_workload

__all__ = [
    "BatchSink",
    "BlockPoolStats",
    "EngineStats",
    "GPUBlockPool",
    "KVCacheGroupSpec",
    "OffloadSimStats",
    "RequestHasher",
    "RequestResult",
    "SimEngine",
    "SimEngineConfig",
    "SimOffload",
    "SimRequest",
    "WorkloadConfig",
    "expected_block_bytes",
    "generate_workload",
    "group_block_hashes",
    "hash_block_size",
    "offload_available",
]
