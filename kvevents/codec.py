"""Encoding and decoding of KV event batches and of their ZMQ frames.

* :func:`encode_batch` writes exactly vLLM 0.33's bytes (C§1.2, C§9.1).
* :func:`decode_batch` / :class:`BatchDecoder` read every shape a live producer sends
  (C§9.2): map events (vLLM ≥ 0.24) with unknown or missing optional keys, positional
  array events of every historical length (vLLM ≤ 0.23), 2- and 3-element batches,
  missing ``medium`` / ``lora_name`` / ``lora_id``, int (signed or unsigned 64-bit) or
  bytes hashes, and map-shaped batches (``{"ts", "events", rank}``) from other producers.
  An event with an unknown ``type`` tag is skipped and counted; the rest of the batch is
  kept (C§9.3).  Anything else raises :class:`~kvevents.errors.DecodeError`, and no other
  exception type escapes, whatever the payload's size or nesting depth: a payload nested
  deeper than Python's recursion limit lets msgspec walk (about 1,000 levels by default;
  :data:`MAX_NESTING_DEPTH` when the process raised that limit) is a ``DecodeError``.
* Frame helpers build and parse the live message ``[topic, seq, payload]`` and the
  replay request/reply of C§2.1–2.2.

:meth:`BatchDecoder.decode_raw_tokens` is a faster path for consumers that only hash or
forward token ids: GPU stores keep ``token_ids`` as the undecoded msgpack array
(:class:`RawTokensBlockStored`), so no Python int is built per token; turning 64 token ids
into ints is about 60 % of decoding a 4-block GPU store.

Decoding tries the fastest typed path first (map events, then array events) and only
falls back to a generic walk when the payload needs it, so well-formed vLLM traffic pays
no tolerance tax.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

import msgspec

from kvevents.errors import DecodeError, EncodeError, FrameError
from kvevents.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
)

__all__ = [
    "END_SEQ",
    "MAX_NESTING_DEPTH",
    "BatchDecoder",
    "DecodeStats",
    "LiveMessage",
    "RawTokensBatch",
    "RawTokensBlockStored",
    "RawTokensEvent",
    "ReplayReply",
    "WireShape",
    "decode_batch",
    "describe_payload",
    "encode_batch",
    "pack_live",
    "pack_replay_end",
    "pack_replay_reply",
    "pack_replay_request",
    "pack_seq",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "unpack_seq",
]

END_SEQ: bytes = b"\xff" * 8
"""The seq frame of the replay end marker: ``(-1).to_bytes(8, "big", signed=True)``."""

MAX_NESTING_DEPTH = 1000
"""Deepest container nesting decoded when the process raised Python's recursion limit.

msgspec walks nested containers recursively and stops at Python's recursion limit with a
``RecursionError`` (turned into :class:`~kvevents.errors.DecodeError`).  With a limit
raised above 4,000 that stop could come only after the C stack overflows, so the
decoder then checks the payload's nesting against this bound before decoding."""

_TRUSTED_RECURSION_LIMIT = 4000
"""Recursion limits up to this keep msgspec's recursion well inside a thread's C stack."""

_EVENT_CLASSES: dict[str, type[KVEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
_FIELDS: dict[str, tuple[str, ...]] = {
    name: cls.__struct_fields__ for name, cls in _EVENT_CLASSES.items()
}
# The fields vLLM ever wrote in positional (array) events, <= 0.23.
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": _FIELDS["BlockStored"][:11],
    "BlockRemoved": _FIELDS["BlockRemoved"][:3],
    "AllBlocksCleared": (),
}
# Required in vLLM 0.33 but absent from older producers: read as None (C§1.3).
_TOLERATED_MISSING = ("lora_id", "medium", "lora_name")
# Fields every producer has written in the same positions since vLLM 0.9 (and SGLang).
_CORE_FIELDS: dict[str, frozenset[str]] = {
    "BlockStored": frozenset({"block_hashes", "parent_block_hash", "token_ids", "block_size"}),
    "BlockRemoved": frozenset({"block_hashes"}),
    "AllBlocksCleared": frozenset(),
}
# Each field's type, to test one positional value at a time.
_FIELD_TYPES: dict[str, dict[str, Any]] = {
    name: {f.name: f.type for f in msgspec.structs.fields(cls)}
    for name, cls in _EVENT_CLASSES.items()
}

_ENCODER = msgspec.msgpack.Encoder()
_T = TypeVar("_T")


def encode_batch(batch: EventBatch) -> bytes:
    """Encode ``batch`` to the msgpack payload frame, byte-identical to vLLM 0.33.

    Raises :class:`~kvevents.errors.EncodeError` for objects msgpack cannot carry.
    """
    try:
        return _ENCODER.encode(batch)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise EncodeError(f"cannot encode batch: {exc}") from exc


# --- array-form twins: a typed fast path for vLLM <= 0.23 producers ---------------------
# Everything after the fields that every version wrote (0.9) has a default, so any
# element count from 0.9's on decodes.  The twins stop at the last field vLLM ever wrote
# positionally (0.23: ``kv_cache_spec_sliding_window`` / ``group_idx``): later fields were
# only ever sent as map keys, so elements past those are another producer's extensions
# and are ignored (msgspec drops extra trailing elements), never read as ``locality``.


class _ArrayEvent(msgspec.Struct, array_like=True, tag=True, gc=False):
    pass


class _ArrayStored(_ArrayEvent, tag="BlockStored"):
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


class _ArrayRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _ArrayFormBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[_ArrayStored, _ArrayRemoved, _ArrayCleared]]
    data_parallel_rank: int | None = None


def _from_array_twin(ev: _ArrayEvent) -> KVEvent:
    if isinstance(ev, _ArrayStored):
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
    if isinstance(ev, _ArrayRemoved):
        return BlockRemoved(ev.block_hashes, ev.medium, ev.group_idx)
    return AllBlocksCleared()


# --- raw token ids: the fast path for consumers that hash or forward tokens ------------

_TOKEN_LIST = msgspec.msgpack.Decoder(list[int])


class RawTokensBlockStored(KVCacheEvent, tag="BlockStored"):
    """A :class:`~kvevents.events.BlockStored` whose ``token_ids`` stay undecoded.

    Same tag, fields, order and defaults as ``BlockStored``; ``token_ids`` is the
    payload's own msgpack array as a :class:`msgspec.Raw` (a zero-copy view of the
    payload).  Encoding it writes the same bytes back.  The token ids are *not*
    validated while decoding: :meth:`token_list` validates them (raising
    :class:`~kvevents.errors.DecodeError`), and :meth:`to_stored` builds the plain event.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: msgspec.Raw
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

    def token_list(self) -> list[int]:
        """The token ids as ints; raises :class:`DecodeError` if they are not an int array."""
        try:
            return _TOKEN_LIST.decode(self.token_ids)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise DecodeError(f"BlockStored.token_ids: {exc}") from exc
        except _UNDECODABLE as exc:
            raise _undecodable(exc, self.token_ids) from exc

    def to_stored(self) -> BlockStored:
        """The equal :class:`~kvevents.events.BlockStored` (token ids decoded and checked)."""
        values = msgspec.structs.astuple(self)
        return BlockStored(values[0], values[1], self.token_list(), *values[3:])

    @classmethod
    def from_stored(cls, event: BlockStored) -> RawTokensBlockStored:
        """``event`` with its token ids re-encoded as msgpack (what a producer sends)."""
        values = msgspec.structs.astuple(event)
        raw = msgspec.Raw(_ENCODER.encode(event.token_ids))
        return cls(values[0], values[1], raw, *values[3:])


RawTokensEvent = Union[RawTokensBlockStored, BlockRemoved, AllBlocksCleared]
"""An event as :meth:`BatchDecoder.decode_raw_tokens` returns it."""


class RawTokensBatch(EventBatch):
    """A batch as :meth:`BatchDecoder.decode_raw_tokens` returns it."""

    events: list[RawTokensEvent]


@dataclass
class DecodeStats:
    """Counters of what decoding skipped or had to tolerate.

    ``skipped_events`` counts skipped events by reason (``"unknown_tag"``);
    ``unknown_tags`` counts them by the tag seen.  ``tolerant_batches`` counts batches
    that needed the generic (slow) path.  ``ignored_fields`` counts, by
    ``"Class.field"``, optional values of positional (array) events that did not fit
    the vLLM field in that position and were read as ``None``: a foreign producer's
    extension (SGLang's ``{"cache_salt": ...}`` metadata sits where vLLM 0.13-0.15 put
    ``lora_name``).
    """

    skipped_events: Counter[str] = field(default_factory=Counter)
    unknown_tags: Counter[str] = field(default_factory=Counter)
    tolerant_batches: int = 0
    ignored_fields: Counter[str] = field(default_factory=Counter)


class BatchDecoder:
    """A reusable decoder for payload frames, keeping :class:`DecodeStats`.

    Not thread-safe: use one per thread (they are cheap).
    """

    def __init__(self, stats: DecodeStats | None = None) -> None:
        self.stats = stats if stats is not None else DecodeStats()
        self._map_form = msgspec.msgpack.Decoder(KVEventBatch)
        self._array_form = msgspec.msgpack.Decoder(_ArrayFormBatch)
        self._generic = msgspec.msgpack.Decoder()
        self._raw_tokens = msgspec.msgpack.Decoder(RawTokensBatch)
        self._array_first = False

    def decode(self, payload: bytes | bytearray | memoryview) -> KVEventBatch:
        """Decode one payload frame.

        Raises :class:`DecodeError` if it is malformed, nested too deeply or too large
        to decode; no other exception escapes.
        """
        # The common case first, with no extra call: map events (vLLM >= 0.24) in bytes,
        # under a recursion limit that keeps msgspec's walk safe.
        if (
            type(payload) is bytes
            and not self._array_first
            and sys.getrecursionlimit() <= _TRUSTED_RECURSION_LIMIT
        ):
            try:
                return self._map_form.decode(payload)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
            except _UNDECODABLE as exc:
                raise _undecodable(exc, payload) from exc
            return self._decode_after_map(payload)
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise DecodeError(f"payload must be bytes, got {type(payload).__name__}")
        if sys.getrecursionlimit() > _TRUSTED_RECURSION_LIMIT:
            _bound_nesting(payload)
        # A producer keeps one event form, so try the form that worked last time first.
        first, second = (
            (self._decode_array, self._decode_map)
            if self._array_first
            else (self._decode_map, self._decode_array)
        )
        try:
            try:
                return first(payload)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
            try:
                batch = second(payload)
            except (msgspec.ValidationError, msgspec.DecodeError):
                return self._decode_generic(payload)
        except DecodeError:
            raise
        except _UNDECODABLE as exc:
            raise _undecodable(exc, payload) from exc
        self._array_first = not self._array_first
        return batch

    def _decode_after_map(self, payload: bytes) -> KVEventBatch:
        """:meth:`decode`'s remaining tries once the map form failed on ``payload``."""
        try:
            try:
                batch = self._decode_array(payload)
            except (msgspec.ValidationError, msgspec.DecodeError):
                return self._decode_generic(payload)
        except DecodeError:
            raise
        except _UNDECODABLE as exc:
            raise _undecodable(exc, payload) from exc
        self._array_first = True
        return batch

    def decode_raw_tokens(self, payload: bytes | bytearray | memoryview) -> RawTokensBatch:
        """Decode one payload frame, keeping each ``BlockStored``'s token ids as msgpack.

        The fast path for consumers that hash or forward token ids.  Every shape
        :meth:`decode` reads is read here too, with the same events except that each
        ``BlockStored`` is a :class:`RawTokensBlockStored` (``token_ids`` not validated
        until used); a payload that the typed map-form path cannot read goes through
        :meth:`decode` and its stores are re-encoded.  ``RawTokensBlockStored.to_stored``
        of each store gives exactly what :meth:`decode` returns.  Raises
        :class:`DecodeError` as :meth:`decode` does.  The events hold views of
        ``payload``: a ``bytearray`` payload must not change while they are alive.
        """
        if not self._array_first and isinstance(payload, (bytes, bytearray, memoryview)):
            if sys.getrecursionlimit() > _TRUSTED_RECURSION_LIMIT:
                _bound_nesting(payload)
            try:
                return self._raw_tokens.decode(payload)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
            except _UNDECODABLE as exc:
                raise _undecodable(exc, payload) from exc
        batch = self.decode(payload)
        return RawTokensBatch(
            batch.ts,
            [
                RawTokensBlockStored.from_stored(e) if isinstance(e, BlockStored) else e
                for e in batch.events
            ],
            batch.data_parallel_rank,
        )

    def _decode_map(self, payload: bytes | bytearray | memoryview) -> KVEventBatch:
        return self._map_form.decode(payload)

    def _decode_array(self, payload: bytes | bytearray | memoryview) -> KVEventBatch:
        arr = self._array_form.decode(payload)
        return KVEventBatch(
            arr.ts, [_from_array_twin(e) for e in arr.events], arr.data_parallel_rank
        )

    # --- the tolerant path ---------------------------------------------------------
    def _decode_generic(self, payload: bytes | bytearray | memoryview) -> KVEventBatch:
        try:
            raw = self._generic.decode(payload)
        except msgspec.DecodeError as exc:
            raise DecodeError(f"$: not a msgpack document: {exc}") from exc
        self.stats.tolerant_batches += 1
        ts, raw_events, rank = _split_batch(raw)
        events: list[KVEvent] = []
        for i, raw_event in enumerate(raw_events):
            event = self._convert_event(raw_event, f"$[1][{i}]")
            if event is not None:
                events.append(event)
        return KVEventBatch(ts, events, rank)

    def _convert_event(self, raw: Any, where: str) -> KVEvent | None:
        if isinstance(raw, (list, tuple)):
            if not raw or not isinstance(raw[0], str):
                raise DecodeError(f"{where}: array event must start with its type tag (a string)")
            tag = raw[0]
            if tag not in _EVENT_CLASSES:
                self._skip_unknown(tag)
                return None
            fields = dict(zip(_ARRAY_FIELDS[tag], raw[1:]))
            self._drop_foreign_positional(tag, fields)
        elif isinstance(raw, dict):
            raw_tag = raw.get("type")
            if not isinstance(raw_tag, str):
                raise DecodeError(f"{where}: map event has no string 'type' key")
            tag = raw_tag
            if tag not in _EVENT_CLASSES:
                self._skip_unknown(tag)
                return None
            names = _FIELDS[tag]
            fields = {k: v for k, v in raw.items() if k in names}
        else:
            raise DecodeError(f"{where}: event must be an array or a map, got {_kind(raw)}")
        cls = _EVENT_CLASSES[tag]
        for name in _TOLERATED_MISSING:
            if name in _FIELDS[tag] and name not in fields:
                fields[name] = None
        try:
            return msgspec.convert(fields, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise DecodeError(f"{where} ({tag}): {_relocate(str(exc))}") from exc
        except (TypeError, ValueError, OverflowError) as exc:
            raise DecodeError(f"{where} ({tag}): {exc}") from exc

    def _drop_foreign_positional(self, tag: str, fields: dict[str, Any]) -> None:
        """Read as ``None`` (and count) optional positional values of the wrong type.

        Positions are vLLM's; another producer may put its own extension in a slot that
        vLLM later gave an optional field.  The core fields are never dropped, so a
        malformed event still fails.
        """
        for name in _foreign_positional(tag, fields):
            fields[name] = None
            self.stats.ignored_fields[f"{tag}.{name}"] += 1

    def _skip_unknown(self, tag: str) -> None:
        self.stats.skipped_events["unknown_tag"] += 1
        self.stats.unknown_tags[tag] += 1


def _foreign_positional(tag: str, fields: dict[str, Any]) -> list[str]:
    """Optional (non-core) fields of a positional event whose value does not fit the
    vLLM field in that position (``None`` always fits)."""
    core = _CORE_FIELDS[tag]
    types = _FIELD_TYPES[tag]
    foreign: list[str] = []
    for name, value in fields.items():
        if name in core or value is None:
            continue
        try:
            msgspec.convert(value, types[name], strict=True)
        except (msgspec.ValidationError, TypeError, ValueError, OverflowError):
            foreign.append(name)
    return foreign


# Every decode path (typed, positional, generic) walks nested containers recursively, in
# msgspec and in msgspec.convert.  Under Python's usual recursion limit a too-deep
# payload stops them with RecursionError, which becomes a DecodeError; under a raised
# limit (above _TRUSTED_RECURSION_LIMIT) the nesting is first bounded by
# MAX_NESTING_DEPTH, so that no walk can run past the C stack.  A buffer that cannot be
# read (a released or non-contiguous memoryview) is a DecodeError too.
_UNDECODABLE = (RecursionError, MemoryError, BufferError, ValueError)


def _guarded(
    decode: Callable[[bytes | bytearray | memoryview], _T],
    payload: bytes | bytearray | memoryview,
) -> _T:
    """Run ``decode(payload)`` letting only :class:`DecodeError` escape."""
    if sys.getrecursionlimit() > _TRUSTED_RECURSION_LIMIT:
        _bound_nesting(payload)
    try:
        return decode(payload)
    except DecodeError:
        raise
    except _UNDECODABLE as exc:
        raise _undecodable(exc, payload) from exc


def _bound_nesting(payload: bytes | bytearray | memoryview) -> None:
    try:
        too_deep = _nested_deeper_than(payload, MAX_NESTING_DEPTH)
    except (BufferError, ValueError, TypeError) as exc:
        raise _undecodable(exc, payload) from exc
    if too_deep:
        raise DecodeError(f"$: containers nested deeper than {MAX_NESTING_DEPTH} levels")


def _undecodable(exc: BaseException, payload: bytes | bytearray | memoryview) -> DecodeError:
    """The :class:`DecodeError` for a failure that is not about the payload's shape."""
    if isinstance(exc, RecursionError):
        return DecodeError(
            "$: containers nested too deeply to decode (past Python's recursion limit)"
        )
    if isinstance(exc, MemoryError):
        return DecodeError(f"$: payload of {len(payload)} bytes is too large to decode")
    return DecodeError(f"$: cannot read the payload buffer: {exc}")


# Bytes after a msgpack type byte, for the scalars of fixed size.
_FIXED_SIZES: dict[int, int] = {
    0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,
}  # fmt: skip
# (length bytes, extra bytes) of the length-prefixed types: bin, ext, str.
_SIZED: dict[int, tuple[int, int]] = {
    0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),
    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),
}  # fmt: skip
# (length bytes, items per entry) of the containers with a length field.
_CONTAINERS: dict[int, tuple[int, int]] = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def _nested_deeper_than(data: bytes | bytearray | memoryview, limit: int) -> bool:
    """Whether the msgpack document in ``data`` nests containers more than ``limit`` deep.

    An iterative walk of the type bytes (no recursion, no allocation per value).  It
    stops early on bytes that are not msgpack (the decoder reports those).
    """
    view = memoryview(data).cast("B")
    end = len(view)
    pos = 0
    open_items: list[int] = []  # items still expected by each open container
    while pos < end:
        b = view[pos]
        pos += 1
        items = -1  # a scalar; a container's entry count otherwise
        if b <= 0x7F or b >= 0xE0:
            pass
        elif b <= 0x8F:
            items = 2 * (b & 0x0F)
        elif b <= 0x9F:
            items = b & 0x0F
        elif b <= 0xBF:
            pos += b & 0x1F
        elif b in _FIXED_SIZES:
            pos += _FIXED_SIZES[b]
        elif b in _SIZED:
            width, extra = _SIZED[b]
            pos += width + extra + int.from_bytes(view[pos : pos + width], "big")
        elif b in _CONTAINERS:
            width, per_entry = _CONTAINERS[b]
            items = per_entry * int.from_bytes(view[pos : pos + width], "big")
            pos += width
        else:
            return False  # 0xC1 is never used: not msgpack
        if items >= 0 and len(open_items) >= limit:
            return True  # this container sits at depth len(open_items) + 1
        if items > 0:
            open_items.append(items)
            continue
        while open_items:  # one value is complete
            open_items[-1] -= 1
            if open_items[-1]:
                break
            open_items.pop()
        if not open_items:
            return False  # the document is complete
    return False


def _split_batch(raw: Any) -> tuple[float, list[Any], int | None]:
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
        raise DecodeError(f"$: batch must be an array or a map, got {_kind(raw)}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise DecodeError(f"$[0]: ts must be a number, got {_kind(ts)}")
    if not isinstance(events, (list, tuple)):
        raise DecodeError(f"$[1]: events must be an array, got {_kind(events)}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise DecodeError(f"$[2]: data_parallel_rank must be an int or nil, got {_kind(rank)}")
    return float(ts), list(events), rank


def _kind(value: Any) -> str:
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


def _relocate(msg: str) -> str:
    """Turn msgspec's ``- at `$.field``` suffix into a field-relative location."""
    return msg.replace("- at `$", "- at `")


_DEFAULT_DECODER: BatchDecoder | None = None


def decode_batch(
    payload: bytes | bytearray | memoryview, stats: DecodeStats | None = None
) -> KVEventBatch:
    """Decode one payload frame into a :class:`KVEventBatch`.

    Skipped events are counted into ``stats`` when given.  For a hot loop, keep a
    :class:`BatchDecoder` instead.  Raises :class:`DecodeError` on malformed input.
    """
    global _DEFAULT_DECODER
    if stats is not None:
        return BatchDecoder(stats).decode(payload)
    if _DEFAULT_DECODER is None:
        _DEFAULT_DECODER = BatchDecoder()
    return _DEFAULT_DECODER.decode(payload)


# --- producer version inference (C§1.3, C§9.16) -----------------------------------------

# Inclusive (first, last) 0.x minor releases that can write an array event of a given
# element count (tag included).  Boundaries follow C§1.3 and the golden vectors; where a
# field's first release is only known to a range, both neighbours are allowed.
_STORED_LEN_MINORS = {6: (9, 11), 7: (11, 15), 8: (13, 18), 9: (16, 20), 10: (19, 22), 12: (21, 23)}
_REMOVED_LEN_MINORS = {2: (9, 11), 3: (11, 20), 4: (19, 23)}
_MAP_KEY_MINORS = (  # newest first: a key present means "at least this release"
    ("lookahead_token_ids", 33),
    ("session_id", 30),
    ("ownership", 29),
    ("locality", 26),
)


@dataclass(frozen=True)
class WireShape:
    """What a payload's shape says about its producer.

    ``event_form`` is ``"map"`` (vLLM >= 0.24), ``"array"`` (<= 0.23), ``"mixed"`` or
    ``"none"`` (no events).  ``vllm_versions`` is the narrowest vLLM release range the
    shape fits (``"0.11-0.15"``, ``">=0.26"``), or ``""`` when it says nothing or fits
    no known release (a newer or foreign producer).
    """

    event_form: str
    batch_elements: int
    vllm_versions: str


def describe_payload(payload: bytes | bytearray | memoryview) -> WireShape:
    """Infer the producer's wire generation from a payload's shape (C§1.3, C§9.16).

    Raises :class:`DecodeError` if the payload is not a msgpack batch (nothing else
    escapes).
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise DecodeError(f"payload must be bytes, got {type(payload).__name__}")
    return _guarded(_describe, payload)


def _describe(payload: bytes | bytearray | memoryview) -> WireShape:
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, TypeError) as exc:
        raise DecodeError(f"$: not a msgpack document: {exc}") from exc
    _, events, _ = _split_batch(raw)
    n = len(raw) if isinstance(raw, (list, tuple)) else 0
    forms = {"array" if isinstance(e, (list, tuple)) else "map" for e in events}
    form = forms.pop() if len(forms) == 1 else ("mixed" if forms else "none")
    lo, hi = (9, 9) if n == 2 else (10, 99) if n == 3 else (0, 99)
    if form == "map":
        lo = max(lo, 24)
        keys = {k for e in events if isinstance(e, dict) for k in e}
        lo = max([lo] + [minor for key, minor in _MAP_KEY_MINORS if key in keys])
    elif form == "array":
        hi = min(hi, 23)
        tables = {"BlockStored": _STORED_LEN_MINORS, "BlockRemoved": _REMOVED_LEN_MINORS}
        for e in events:
            table = tables.get(e[0]) if e and isinstance(e[0], str) else None
            if table is not None:
                first, last = table.get(len(e), (0, -1))
                if _foreign_positional(e[0], dict(zip(_ARRAY_FIELDS[e[0]], e[1:]))):
                    first, last = 0, -1  # a value no vLLM release wrote in that slot
                lo, hi = max(lo, first), min(hi, last)
    if form in ("mixed",) or lo > hi or (lo, hi) == (0, 99):
        versions = ""
    elif hi == 99:
        versions = f">=0.{lo}"
    elif lo == hi:
        versions = f"0.{lo}"
    else:
        versions = f"0.{max(lo, 9)}-0.{hi}"
    return WireShape(form, n, versions)


# --- frames (C§2.1, C§2.2) --------------------------------------------------------------


def pack_seq(seq: int) -> bytes:
    """``seq`` as the 8-byte big-endian unsigned frame."""
    return seq.to_bytes(8, "big")


def unpack_seq(frame: bytes) -> int:
    """Read a live seq frame; it must be exactly 8 bytes (raises :class:`FrameError`)."""
    if len(frame) != 8:
        raise FrameError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


@dataclass(frozen=True)
class LiveMessage:
    """One live PUB message: ``[topic, seq, payload]``."""

    topic: bytes
    seq: int
    payload: bytes


def pack_live(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three frames of a live message."""
    return [topic, pack_seq(seq), payload]


def parse_live(frames: Sequence[bytes]) -> LiveMessage:
    """Parse a live message; exactly 3 frames with an 8-byte seq, else :class:`FrameError`."""
    if len(frames) != 3:
        raise FrameError(
            f"live message must have 3 frames [topic, seq, payload], got {len(frames)}"
        )
    topic, seq, payload = frames
    return LiveMessage(bytes(topic), unpack_seq(seq), bytes(payload))


def pack_replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to ask for every buffered batch with seq ≥ ``start_seq``."""
    return [b"", pack_seq(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int]:
    """Parse a request as a ROUTER receives it: ``[identity, b"", start]``.

    As in vLLM (C§2.2) only the frame count is checked: the middle (delimiter) frame is
    not inspected, and ``start`` is big-endian unsigned of any length (a 4-byte value
    works; an empty frame reads as 0).  Returns ``(identity, start_seq)``; any other
    frame count raises :class:`FrameError`.
    """
    if len(frames) != 3:
        raise FrameError(
            f"replay request must have 3 frames [identity, b'', start], got {len(frames)}"
        )
    identity, _delimiter, start = frames
    return bytes(identity), int.from_bytes(start, "big")


def pack_replay_reply(identity: bytes, topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One replayed batch as the ROUTER sends it (0.26+ layout, with the topic frame)."""
    return [identity, b"", topic, pack_seq(seq), payload]


def pack_replay_end(identity: bytes) -> list[bytes]:
    """The end-of-replay marker as the ROUTER sends it."""
    return [identity, b"", b"", END_SEQ, b""]


@dataclass(frozen=True)
class ReplayReply:
    """One reply a replay client received.  ``seq`` is ``None`` for the end marker."""

    seq: int | None
    topic: bytes
    payload: bytes

    @property
    def is_end(self) -> bool:
        return self.seq is None


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayReply:
    """Parse a replay reply as a DEALER (or REQ) receives it.

    Accepted layouts: ``[b"", topic, seq, payload]`` (DEALER, 0.26+),
    ``[b"", seq, payload]`` (DEALER before 0.26, or REQ 0.26+ with an empty topic),
    ``[seq, payload]`` (REQ before 0.26).  The end marker has ``END_SEQ`` as its seq;
    an empty payload also ends the replay.  Anything else raises :class:`FrameError`.
    """
    n = len(frames)
    if n == 4:
        if frames[0]:
            raise FrameError("replay reply must start with an empty delimiter frame")
        topic, seq_frame, payload = frames[1], frames[2], frames[3]
    elif n == 3:
        topic, seq_frame, payload = frames[0], frames[1], frames[2]
    elif n == 2:
        topic, seq_frame, payload = b"", frames[0], frames[1]
    else:
        raise FrameError(f"replay reply must have 2 to 4 frames, got {n}")
    if bytes(seq_frame) == END_SEQ or not payload:
        return ReplayReply(None, bytes(topic), b"")
    return ReplayReply(unpack_seq(seq_frame), bytes(topic), bytes(payload))
