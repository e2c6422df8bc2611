"""Decoding KV event batches: every shape a live producer sends, fastest path first.

One job: :class:`BatchDecoder` (and :func:`decode_batch`) with :class:`DecodeStats`.
Decoding tries the typed map form (vLLM >= 0.24), then the typed array form (<= 0.23),
and only then the tolerant generic walk; the form that worked last is tried first.  An
event with an unknown ``type`` tag is skipped and counted.  Anything else raises
:class:`~kvevents.errors.DecodeError`, and no other exception escapes.  Imports msgspec,
the events, the errors, the layouts, the guards and the raw-token types.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvevents.codec.guards import (
    TRUSTED_RECURSION_LIMIT,
    UNDECODABLE,
    bound_nesting,
    undecodable,
)
from kvevents.codec.layouts import (
    ARRAY_FIELDS,
    EVENT_CLASSES,
    EVENT_FIELDS,
    TOLERATED_MISSING,
    ArrayFormBatch,
    foreign_positional,
    from_array_twin,
    kind,
    relocate,
    split_batch,
)
from kvevents.codec.raw_tokens import RawTokensBatch, RawTokensBlockStored
from kvevents.errors import DecodeError
from kvevents.events import BlockStored, KVEvent, KVEventBatch

__all__ = ["BatchDecoder", "DecodeStats", "decode_batch"]


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
        self._array_form = msgspec.msgpack.Decoder(ArrayFormBatch)
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
            and sys.getrecursionlimit() <= TRUSTED_RECURSION_LIMIT
        ):
            try:
                return self._map_form.decode(payload)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
            except UNDECODABLE as exc:
                raise undecodable(exc, payload) from exc
            return self._decode_after_map(payload)
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise DecodeError(f"payload must be bytes, got {type(payload).__name__}")
        if sys.getrecursionlimit() > TRUSTED_RECURSION_LIMIT:
            bound_nesting(payload)
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
        except UNDECODABLE as exc:
            raise undecodable(exc, payload) from exc
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
        except UNDECODABLE as exc:
            raise undecodable(exc, payload) from exc
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
            if sys.getrecursionlimit() > TRUSTED_RECURSION_LIMIT:
                bound_nesting(payload)
            try:
                return self._raw_tokens.decode(payload)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
            except UNDECODABLE as exc:
                raise undecodable(exc, payload) from exc
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
            arr.ts, [from_array_twin(e) for e in arr.events], arr.data_parallel_rank
        )

    # --- the tolerant path ---------------------------------------------------------
    def _decode_generic(self, payload: bytes | bytearray | memoryview) -> KVEventBatch:
        try:
            raw = self._generic.decode(payload)
        except msgspec.DecodeError as exc:
            raise DecodeError(f"$: not a msgpack document: {exc}") from exc
        self.stats.tolerant_batches += 1
        ts, raw_events, rank = split_batch(raw)
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
            if tag not in EVENT_CLASSES:
                self._skip_unknown(tag)
                return None
            fields = dict(zip(ARRAY_FIELDS[tag], raw[1:]))
            self._drop_foreign_positional(tag, fields)
        elif isinstance(raw, dict):
            raw_tag = raw.get("type")
            if not isinstance(raw_tag, str):
                raise DecodeError(f"{where}: map event has no string 'type' key")
            tag = raw_tag
            if tag not in EVENT_CLASSES:
                self._skip_unknown(tag)
                return None
            names = EVENT_FIELDS[tag]
            fields = {k: v for k, v in raw.items() if k in names}
        else:
            raise DecodeError(f"{where}: event must be an array or a map, got {kind(raw)}")
        cls = EVENT_CLASSES[tag]
        for name in TOLERATED_MISSING:
            if name in EVENT_FIELDS[tag] and name not in fields:
                fields[name] = None
        try:
            return msgspec.convert(fields, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise DecodeError(f"{where} ({tag}): {relocate(str(exc))}") from exc
        except (TypeError, ValueError, OverflowError) as exc:
            raise DecodeError(f"{where} ({tag}): {exc}") from exc

    def _drop_foreign_positional(self, tag: str, fields: dict[str, Any]) -> None:
        """Read as ``None`` (and count) optional positional values of the wrong type.

        Positions are vLLM's; another producer may put its own extension in a slot that
        vLLM later gave an optional field.  The core fields are never dropped, so a
        malformed event still fails.
        """
        for name in foreign_positional(tag, fields):
            fields[name] = None
            self.stats.ignored_fields[f"{tag}.{name}"] += 1

    def _skip_unknown(self, tag: str) -> None:
        self.stats.skipped_events["unknown_tag"] += 1
        self.stats.unknown_tags[tag] += 1


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
