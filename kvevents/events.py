"""The wire classes of vLLM's KV-cache events (the vLLM 0.33 shape).

Class names, field names, field order, types and defaults match vLLM 0.33's
``vllm/distributed/kv_events.py`` (``EventBatch``, ``KVEventBatch``, ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) exactly, so ``msgspec.msgpack.Encoder().encode(batch)``
of these classes yields the same bytes as vLLM's ``ZmqEventPublisher._publisher_thread``:

* a batch is a 3-element msgpack array ``[ts, events, data_parallel_rank]``;
* each event is a msgpack map whose first key is ``"type"`` (the class name), followed
  by the fields in declaration order; only fields *with* a default are omitted when
  equal to it.

Hashes (:data:`ExternalBlockHash`) are ``int`` (the last 8 bytes of the digest as an
unsigned big-endian integer, vLLM's default) or raw digest ``bytes``.  Other producers
may send signed 64-bit ints; both are accepted.
"""

from typing import Any, Union

import msgspec

__all__ = [
    "LOCALITY_LOCAL",
    "LOCALITY_REMOTE",
    "MEDIA",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "PREFIX_INDEXABLE_SPEC_KINDS",
    "SPEC_KINDS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
]

ExternalBlockHash = Union[bytes, int]
"""A block hash as it travels: an int (vLLM default) or the raw digest bytes."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
MEDIA: tuple[str, ...] = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
"""The storage tiers named by ``medium``; ``None`` on the wire means GPU (≤0.10)."""

LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"

SPEC_KINDS: tuple[str, ...] = (
    "full_attention",
    "mla_attention",
    "sliding_window",
    "sliding_window_mla",
    "mamba",
    "chunked_local_attention",
    "sink_full_attention",
    "encoder_only_attention",
    "cross_attention",
    "unknown",
)
"""Values of ``BlockStored.kv_cache_spec_kind`` (vLLM's ``KVCacheSpecKind``)."""

PREFIX_INDEXABLE_SPEC_KINDS: frozenset[str] = frozenset(
    {"full_attention", "mla_attention", "sink_full_attention"}
)
"""Kinds whose blocks hold the KV of the whole prefix, so a prefix match may use them."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events with its wall-clock time (seconds since the epoch).

    ``data_parallel_rank`` is filled by the publisher; ``None`` only when a batch is
    encoded outside a publisher.
    """

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged KV-cache events; the tag key is ``"type"``."""


class BlockStored(KVCacheEvent):
    """Blocks became resident on ``medium``.

    ``block_size`` is the number of tokens per entry of ``block_hashes``.  A CPU/STORAGE
    placeholder from the offload tracker has ``token_ids=[]`` and ``block_size=0``: its
    size and tokens are known only from the GPU store of the same ``(group_idx, hash)``.
    ``extra_keys`` and ``lookahead_token_ids`` have one entry per block hash.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks are no longer resident on ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the emitting pool was dropped (carries no medium)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
"""Any of the three event classes."""


class KVEventBatch(EventBatch):
    """The batch published once per engine step (``events`` in emission order)."""

    events: list[KVEvent]
