"""SGLang's KV-event wire, modelled for tests (not shipped with kvevents).

A current SGLang producer (python/sglang/srt/disaggregation/kv_events.py) keeps vLLM's
pre-0.24 array form but sends a salted store as an 8-element array whose last element is
a ``{"cache_salt": ...}`` map: the slot where vLLM 0.13-0.15 carried ``lora_name``.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["SglBatch", "SglMetadata", "SglRemoved", "SglStored", "SglStoredWithMetadata"]


class SglEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class SglMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class SglStored(SglEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SglStoredWithMetadata(SglStored, tag="BlockStored", kw_only=True):
    metadata: SglMetadata


class SglRemoved(SglEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SglBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None
