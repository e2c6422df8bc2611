"""CPU KV offloading: keys, manager (LRU/ARC), events without block size, translator.

Importing this package never imports torch.  The torch-based transfer worker lives in
:mod:`kvevents.publishers.offload.transfer` and is loaded on first use of its names
(``CPUTransferWorker``, ``OffloadTransferDriver``, ``HostChunkBuffers``).
"""

from typing import Any

from kvevents.publishers.offload.base import (
    GROUP_SUFFIX_BYTES,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from kvevents.publishers.offload.manager import CPUOffloadingManager, OffloadManagerStats
from kvevents.publishers.offload.policies import (
    ARCCachePolicy,
    CachePolicy,
    ChunkStatus,
    LRUCachePolicy,
    get_cache_policy,
    known_cache_policies,
    register_cache_policy,
)
from kvevents.publishers.offload.translator import (
    ChunkSnapshot,
    OffloadEventTranslator,
    OffloadGroup,
    TranslatorStats,
    drain_kv_events,
)

_TORCH_NAMES = ("CPUTransferWorker", "HostChunkBuffers", "OffloadTransferDriver")

__all__ = [
    "GROUP_SUFFIX_BYTES",
    "ARCCachePolicy",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "CPUTransferWorker",
    "CachePolicy",
    "ChunkSnapshot",
    "ChunkStatus",
    "GPULoadStoreSpec",
    "HostChunkBuffers",
    "LRUCachePolicy",
    "LoadStoreSpec",
    "LookupResult",
    "OffloadEventTranslator",
    "OffloadGroup",
    "OffloadKey",
    "OffloadManagerStats",
    "OffloadPolicy",
    "OffloadTransferDriver",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
    "RequestOffloadingContext",
    "TransferResult",
    "TranslatorStats",
    "drain_kv_events",
    "get_cache_policy",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "known_cache_policies",
    "make_offload_key",
    "register_cache_policy",
]


def __getattr__(name: str) -> Any:
    """Load the torch transfer names lazily, so a torch-less install can import us."""
    if name in _TORCH_NAMES:
        from kvevents.publishers.offload import transfer

        return getattr(transfer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
