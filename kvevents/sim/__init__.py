"""An engine simulator that emits vLLM-shaped KV events (drives the demo and tests).

:class:`SimEngine` is one engine (one DP rank): a :class:`GPUBlockPool` with prefix
caching and vLLM-compatible hashes, an optional CPU tier (:class:`SimOffload`, over
``kvevents.publishers.offload``), and a publisher.  :func:`generate_workload` makes a
seeded chat workload.  :class:`SimCluster` puts engines behind real ZMQ publishers on
loopback.  The demo that drives these engines through ``kvevents serve``
(``kvevents demo``) is :mod:`kvevents.demo`, a layer above: this package never imports it
(nor ``kvevents.serve``).
"""

from kvevents.sim.block_pool import (
    BlockPoolStats,
    GPUBlockPool,
    KVCacheGroupSpec,
    RequestHasher,
    group_block_hashes,
    hash_block_size,
)
from kvevents.sim.cluster import (
    ClusterConfig,
    SimCluster,
    SimWorker,
    engine_endpoint,
    loopback_endpoint,
)
from kvevents.sim.engine import (
    AdmissionRecord,
    BatchSink,
    BeforeLookup,
    EngineStats,
    RequestResult,
    SimEngine,
    SimEngineConfig,
)
from kvevents.sim.offload import (
    OffloadSimStats,
    SimOffload,
    expected_block_bytes,
)
from kvevents.sim.workload import SimRequest, WorkloadConfig, generate_workload

__all__ = [
    "AdmissionRecord",
    "BatchSink",
    "BeforeLookup",
    "BlockPoolStats",
    "ClusterConfig",
    "EngineStats",
    "GPUBlockPool",
    "KVCacheGroupSpec",
    "OffloadSimStats",
    "RequestHasher",
    "RequestResult",
    "SimCluster",
    "SimEngine",
    "SimEngineConfig",
    "SimOffload",
    "SimRequest",
    "SimWorker",
    "WorkloadConfig",
    "engine_endpoint",
    "expected_block_bytes",
    "generate_workload",
    "group_block_hashes",
    "hash_block_size",
    "loopback_endpoint",
]
