"""Payload bytes to the index: :meth:`BlockIndex.apply_payload`'s two paths.

One job: apply one raw payload frame (vLLM's msgpack ``KVEventBatch``) of a worker.

* With the compiled core (:mod:`kvevents.native`), the payload is read by its parser
  (``kvevents_native.parse_batch``) into flat arrays, and :func:`apply_parsed` walks the
  parser's steps (``ParsedBatch.ops``): a run of consecutive GPU removals of one group is
  one :meth:`RefRules.remove` of its hashes (no event object: vLLM publishes one removal
  per evicted block), every other event goes through :meth:`Feeder.apply_other` as the
  event the Python decoder would have made, except that a store's token ids stay the
  parser's packed int64 bytes (:class:`ParsedTokens`): its content keys are chained by
  the core (``ParsedBatch.chain_blocks``), never re-packed.  The rules applied are the
  Python index's own, called in the same order as :meth:`Feeder.apply_events` calls them,
  so the state and every counter end exactly as ``apply(decode(payload))`` leaves them.
* A payload the parser does not read (a shape it leaves to the tolerant Python decoder:
  unknown event tags, duplicate keys, legacy positional forms, malformed bytes) and every
  payload in pure-Python mode is decoded by the index's :class:`~kvevents.codec.BatchDecoder`
  and applied by :meth:`Feeder.apply`; the fallbacks are counted in
  :class:`PayloadStats`.

Malformed input raises :class:`~kvevents.errors.DecodeError` before anything of the
payload is applied (both paths read the whole payload first); what the index held is
kept.  :class:`PayloadStats` lives beside the index, not in it (a side table keyed by
the index's feeder), so snapshots stay the index's state alone: equal streams give equal
snapshot bytes whichever path read them.  Imports the codec, the events,
:mod:`kvevents.native`, :mod:`kvevents.consumers.content`, :mod:`.apply` and
:mod:`.workers`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

import msgspec

from kvevents.codec import BatchDecoder, DecodeStats
from kvevents.consumers.content import StoreTokens
from kvevents.consumers.index.apply import Feeder
from kvevents.consumers.index.workers import GPU, WorkerState
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvevents.native import NATIVE

__all__ = [
    "ParsedTokens",
    "PayloadStats",
    "apply_parsed",
    "apply_payload",
    "payload_stats",
    "reads_natively",
]

_KEYS_PER_CALL = 64
"""Chain keys asked of the core at once (bounds the work a broken chain can waste)."""

_PARSER = (
    NATIVE if NATIVE is not None and hasattr(getattr(NATIVE, "ParsedBatch", None), "ops") else None
)
"""The compiled core when its parser has the apply steps (``ParsedBatch.ops``; an older
build of it reads payloads for the rest of kvevents but not for this: rebuild it)."""


def reads_natively() -> bool:
    """Whether :func:`apply_payload` reads payloads with the compiled parser."""
    return _PARSER is not None


_EXTRA = msgspec.msgpack.Decoder(list[tuple[Any, ...] | None])
_LOOKAHEAD = msgspec.msgpack.Decoder(list[list[int]])


@dataclass
class PayloadStats:
    """How :meth:`BlockIndex.apply_payload` read its payloads.

    ``native``: payloads read by the compiled parser.  ``python``: payloads decoded by
    the Python decoder (every payload in pure-Python mode).  ``fallbacks``: of
    ``python``, those the compiled parser left to it (a shape it does not read natively,
    malformed input included).  ``decoder``: the Python decoder used, with its
    :class:`~kvevents.codec.DecodeStats` (events skipped by unknown tag, ...).
    """

    native: int = 0
    python: int = 0
    fallbacks: int = 0
    decoder: BatchDecoder = field(default_factory=BatchDecoder, repr=False)

    @property
    def decode_stats(self) -> DecodeStats:
        """The Python decoder's counters."""
        return self.decoder.stats


_STATS: weakref.WeakKeyDictionary[Feeder, PayloadStats] = weakref.WeakKeyDictionary()


def payload_stats(feed: Feeder) -> PayloadStats:
    """The :class:`PayloadStats` of the index whose feeder is ``feed`` (made when new)."""
    stats = _STATS.get(feed)
    if stats is None:
        stats = _STATS[feed] = PayloadStats()
    return stats


def apply_payload(
    feed: Feeder, source: str, dp_rank: int, payload: bytes | bytearray | memoryview
) -> None:
    """Apply one payload frame of worker ``(source, dp_rank)`` (see the module
    docstring).  Raises :class:`~kvevents.errors.DecodeError` for a payload neither
    reader accepts, having applied nothing of it."""
    stats = payload_stats(feed)
    if _PARSER is not None:
        parsed = _PARSER.parse_batch(payload)
        if parsed is not None:
            stats.native += 1
            feed.stats.batches += 1
            apply_parsed(feed, feed.worker((source, dp_rank)), parsed)
            return
        stats.fallbacks += 1
    batch = stats.decoder.decode(payload)
    stats.python += 1
    feed.apply(source, dp_rank, batch)


def apply_parsed(feed: Feeder, w: WorkerState, parsed: Any) -> None:
    """Apply a ``kvevents_native.ParsedBatch`` from worker ``w``: the steps of
    :meth:`Feeder.apply_events`, in its order, with its counters."""
    stats = feed.stats
    remove, apply_other = feed.remove, feed.apply_other
    applied = block_events = 0
    try:
        for op in parsed.ops():
            code = op[0]
            if code == 3:  # a run of GPU removals of one group
                _, count, group, hashes = op
                applied += count
                block_events += len(hashes)
                if hashes:
                    remove(w, group, hashes, GPU)
                continue
            applied += 1
            if code == 0:
                ev: Any = _stored(parsed, op)
            elif code == 1:
                ev = BlockRemoved(*op[1:])
            else:
                ev = AllBlocksCleared()
            block_events += apply_other(w, ev)
    finally:
        stats.applied += applied
        stats.block_events += block_events


def _stored(parsed: Any, op: tuple[Any, ...]) -> BlockStored:
    """The BlockStored of a parser step ``(0, i, hashes, parent, token_bytes, ...)``."""
    raw = op[4]
    tokens = ParsedTokens(parsed, op[1], raw) if raw else []
    extra = op[9]
    look = op[16]
    return BlockStored(  # type: ignore[call-arg]
        op[2],
        op[3],
        cast(Any, tokens),
        *op[5:9],
        None if extra is None else _EXTRA.decode(extra),
        *op[10:16],
        None if look is None else _LOOKAHEAD.decode(look),
    )


class ParsedTokens(Sequence[int]):
    """A store's token ids as the compiled parser read them: little-endian int64 bytes,
    read as a sequence of ints where the index needs one (slices are ``memoryview``
    sequences), and packed already for the content keys (:meth:`store_tokens`)."""

    __slots__ = ("event", "ids", "packed", "parsed")

    def __init__(self, parsed: Any, event: int, packed: bytes) -> None:
        self.parsed = parsed
        self.event = event
        self.packed = packed
        self.ids = memoryview(packed).cast("q")

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...

    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        return cast("int | Sequence[int]", self.ids[i])

    def __iter__(self) -> Iterator[int]:
        return iter(cast("Sequence[int]", self.ids))

    def store_tokens(self, unit: int) -> StoreTokens:
        """The content-key maker of these tokens (see :func:`.content.store_tokens`)."""
        return NativeStoreTokens(self, unit)


class NativeStoreTokens(StoreTokens):
    """:class:`StoreTokens` whose block keys the compiled core chains, a run of blocks
    per call: a block without extras whose parent and start continue the run is the
    run's next key; anything else asks the core again (or, with extras, the Python
    rules).  Equal to :meth:`StoreTokens.block_key` by construction (the same xxh3-64
    chain over the same int64 bytes)."""

    __slots__ = ("_i", "_keys", "_next", "_parent", "_parsed", "_pos", "_size")

    def __init__(self, tokens: ParsedTokens, unit: int) -> None:
        self.tokens = tokens
        self.unit = unit
        self.packed = memoryview(tokens.packed)
        self._parsed = tokens.parsed
        self._i = tokens.event
        self._keys: list[int] = []
        self._pos = 0
        self._next = -1
        self._size = 0
        self._parent = 0

    def block_key(self, parent: int, start: int, size: int, extras: Any) -> int:
        if extras is not None:
            return super().block_key(parent, start, size, extras)
        keys = self._keys
        pos = self._pos
        if start != self._next or parent != self._parent or size != self._size or pos >= len(keys):
            got = self._parsed.chain_blocks(self._i, start, size, parent, self.unit, _KEYS_PER_CALL)
            if not got:
                return super().block_key(parent, start, size, extras)
            keys = self._keys = got
            self._size = size
            pos = 0
        k: int = keys[pos]
        self._pos = pos + 1
        self._next = start + size
        self._parent = k
        return k
