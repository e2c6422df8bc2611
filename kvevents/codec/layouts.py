"""The event layouts vLLM has written, and the generic (tolerant) reading of a batch.

One job: what each producer generation puts where.  The field tables
(:data:`EVENT_CLASSES`, :data:`EVENT_FIELDS`, :data:`ARRAY_FIELDS`, :data:`CORE_FIELDS`,
:data:`FIELD_TYPES`, :data:`TOLERATED_MISSING`), the typed array-form twins for vLLM
<= 0.23 (:class:`ArrayFormBatch`, :func:`from_array_twin`), and the helpers of the
generic walk (:func:`split_batch`, :func:`foreign_positional`, :func:`kind`,
:func:`relocate`).  Imports msgspec, the events and the errors.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from kvevents.errors import DecodeError
from kvevents.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
)

__all__ = [
    "ARRAY_FIELDS",
    "CORE_FIELDS",
    "EVENT_CLASSES",
    "EVENT_FIELDS",
    "FIELD_TYPES",
    "TOLERATED_MISSING",
    "ArrayCleared",
    "ArrayEvent",
    "ArrayFormBatch",
    "ArrayRemoved",
    "ArrayStored",
    "foreign_positional",
    "from_array_twin",
    "kind",
    "relocate",
    "split_batch",
]

EVENT_CLASSES: dict[str, type[KVEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    name: cls.__struct_fields__ for name, cls in EVENT_CLASSES.items()
}
# The fields vLLM ever wrote in positional (array) events, <= 0.23.
ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": EVENT_FIELDS["BlockStored"][:11],
    "BlockRemoved": EVENT_FIELDS["BlockRemoved"][:3],
    "AllBlocksCleared": (),
}
# Required in vLLM 0.33 but absent from older producers: read as None.
TOLERATED_MISSING = ("lora_id", "medium", "lora_name")
# Fields every producer has written in the same positions since vLLM 0.9 (and SGLang).
CORE_FIELDS: dict[str, frozenset[str]] = {
    "BlockStored": frozenset({"block_hashes", "parent_block_hash", "token_ids", "block_size"}),
    "BlockRemoved": frozenset({"block_hashes"}),
    "AllBlocksCleared": frozenset(),
}
# Each field's type, to test one positional value at a time.
FIELD_TYPES: dict[str, dict[str, Any]] = {
    name: {f.name: f.type for f in msgspec.structs.fields(cls)}
    for name, cls in EVENT_CLASSES.items()
}


# --- array-form twins: a typed fast path for vLLM <= 0.23 producers ---------------------
# Everything after the fields that every version wrote (0.9) has a default, so any
# element count from 0.9's on decodes.  The twins stop at the last field vLLM ever wrote
# positionally (0.23: ``kv_cache_spec_sliding_window`` / ``group_idx``): later fields were
# only ever sent as map keys, so elements past those are another producer's extensions
# and are ignored (msgspec drops extra trailing elements), never read as ``locality``.


class ArrayEvent(msgspec.Struct, array_like=True, tag=True, gc=False):
    pass


class ArrayStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrayRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class ArrayCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayFormBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[ArrayStored, ArrayRemoved, ArrayCleared]]
    data_parallel_rank: int | None = None


def from_array_twin(ev: ArrayEvent) -> KVEvent:
    if isinstance(ev, ArrayStored):
        return BlockStored(
            ev.block_hashes,
            ev.parent_block_hash,
            ev.token_ids,
            ev.block_size,
            ev.lora_id,
            ev.medium,
            ev.lora_name,
            ev.extra_keys,
            ev.group_idx,
            ev.kv_cache_spec_kind,
            ev.kv_cache_spec_sliding_window,
        )
    if isinstance(ev, ArrayRemoved):
        return BlockRemoved(ev.block_hashes, ev.medium, ev.group_idx)
    return AllBlocksCleared()


def foreign_positional(tag: str, fields: dict[str, Any]) -> list[str]:
    """Optional (non-core) fields of a positional event whose value does not fit the
    vLLM field in that position (``None`` always fits)."""
    core = CORE_FIELDS[tag]
    types = FIELD_TYPES[tag]
    foreign: list[str] = []
    for name, value in fields.items():
        if name in core or value is None:
            continue
        try:
            msgspec.convert(value, types[name], strict=True)
        except (msgspec.ValidationError, TypeError, ValueError, OverflowError):
            foreign.append(name)
    return foreign


def split_batch(raw: Any) -> tuple[float, list[Any], int | None]:
    """Return ``(ts, events, rank)`` of a generic batch, array- or map-shaped."""
    if isinstance(raw, (list, tuple)):
        if len(raw) < 2:
            raise DecodeError(
                f"$: batch array needs at least [ts, events], got {len(raw)} element(s)"
            )
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "ts" not in raw or "events" not in raw:
            raise DecodeError("$: batch map needs 'ts' and 'events' keys")
        ts, events = raw["ts"], raw["events"]
        rank = None
        for key in ("data_parallel_rank", "dp_rank", "attn_dp_rank"):
            if raw.get(key) is not None:
                rank = raw[key]
                break
    else:
        raise DecodeError(f"$: batch must be an array or a map, got {kind(raw)}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise DecodeError(f"$[0]: ts must be a number, got {kind(ts)}")
    if not isinstance(events, (list, tuple)):
        raise DecodeError(f"$[1]: events must be an array, got {kind(events)}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise DecodeError(f"$[2]: data_parallel_rank must be an int or nil, got {kind(rank)}")
    return float(ts), list(events), rank


def kind(value: Any) -> str:
    return {
        list: "array",
        tuple: "array",
        dict: "map",
        str: "string",
        bytes: "bin",
        bool: "bool",
        int: "int",
        float: "float",
        type(None): "nil",
    }.get(type(value), type(value).__name__)


def relocate(msg: str) -> str:
    """Turn msgspec's ``- at `$.field``` suffix into a field-relative location."""
    return msg.replace("- at `$", "- at `")
