"""Cache policies of the CPU offloading manager: LRU, ARC and a registry for more."""

from kvevents.publishers.offload.policies.arc import ARCCachePolicy
from kvevents.publishers.offload.policies.base import CachePolicy, ChunkStatus, order_request_keys
from kvevents.publishers.offload.policies.lru import LRUCachePolicy
from kvevents.publishers.offload.policies.registry import (
    get_cache_policy,
    known_cache_policies,
    register_cache_policy,
)

__all__ = [
    "ARCCachePolicy",
    "CachePolicy",
    "ChunkStatus",
    "LRUCachePolicy",
    "get_cache_policy",
    "known_cache_policies",
    "order_request_keys",
    "register_cache_policy",
]
