"""Metadata records: what the index knows about one engine block, and how it is kept.

One job: the record of one (worker, group, engine hash) and its named fields, each read
by one function here:

=====================  ==============================================================
:func:`content_key`    the key the block's marks use (None: not matchable: its
                       parent's key was unknown, its tokens could not be keyed, or it
                       is a partial tail)
:func:`chain_key`      the key its children chain on (the content key, unless the block
                       was hashed with lookahead tokens)
:func:`end_tokens`     one past its last token position (None: unknown)
:func:`block_size`     tokens in the block
:func:`parent_of`      its parent's engine hash (None: a root)
:func:`counted_parent` the parent whose resident-children count includes it (None for
                       a root or a :data:`FREE_LINK`, see :mod:`.eviction`)
:func:`gpu_refs`       its GPU references (on the GPU tier while positive)
:func:`has_free_link`  the memory cap does not count it among its parent's children
:func:`lora_name`      its LoRA name (None: none, or a packed record)
:func:`extra_keys`     its extra keys as the store carried them (None: none)
:func:`token_ids`      its token ids, when the index keeps them (None: not kept)
=====================  ==============================================================

A record is a value: :func:`pack` makes one, :func:`add_gpu`, :func:`with_free_link`,
:func:`without_free_link` and :func:`unkeyed` give a changed copy.  No other room looks
inside one, so a field moves here and nowhere else.  Imports nothing from the index.

The form is compact on purpose: a fleet's index holds millions of records, and a plain
int or a tuple of plain values costs a fraction of an object's memory and nothing to
the garbage collector (an instance of any Python class is tracked by it, and a full
collection then walks every record).  Measured with tracemalloc on CPython 3.11, a
record with a content key, a parent, an end and one GPU reference takes 48 B packed;
as a named record with its own key and parent ints, 151 B (a slotted dataclass of the
five fields such a record uses), 191 B (slotted, all ten fields) or 207 B (a
NamedTuple), plus one object the collector tracks.  It is also the snapshot's form,
byte for byte.  And it is what the compiled core keeps without a Python object at all:
a group's records are a :data:`RecordMap`, with the core a flat table of the packed
ints' 192 bits (:func:`new_record_map`; 32 B an entry and its index slots, against
about 140 B for a dict entry with its key and record ints).

A record is, usually, one packed int (about 52 bytes):

* bits 0-63: the content key (unsigned, :data:`CK_MASK`), bit 64: "has a content key"
  (:data:`HAS_CK`);
* bits 65-84: end position in blocks + 1 (0: unknown; :data:`END_SHIFT`);
* bits 85-104: block size in tokens (:data:`SIZE_SHIFT`);
* bits 105-169: parent hash + 1 (0: none; :data:`PARENT_SHIFT`, :data:`PARENT_MASK`);
* bit 170: :data:`FREE_LINK`;
* bits 171 and up: the GPU refcount (:data:`GPU_SHIFT`; one reference is
  :data:`GPU_ONE`).

Records with a LoRA name, extra keys, token ids, a bytes or negative parent, or fields
out of range are *wide*: the tuple ``(ck, end_blocks, parent, size, lora, extra, tokens,
gpu refs)`` (indices :data:`F_CK` ... :data:`F_GPU`), plus a ninth field
:data:`F_CHAIN`, the chain key children build on, when it differs from ``ck`` (the mark
key of a block hashed with lookahead tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any, Union

from kvevents.native import NATIVE

__all__ = [
    "CK_MASK",
    "END_SHIFT",
    "FIELD_MASK",
    "FREE_LINK",
    "F_CHAIN",
    "F_CK",
    "F_END",
    "F_EXTRA",
    "F_GPU",
    "F_LORA",
    "F_PARENT",
    "F_SIZE",
    "F_TOKENS",
    "GPU_ONE",
    "GPU_SHIFT",
    "GPU_TWO",
    "HAS_CK",
    "PARENT_MASK",
    "PARENT_SHIFT",
    "SIZE_SHIFT",
    "Hash",
    "Record",
    "RecordMap",
    "RefCounts",
    "add_gpu",
    "adopt_records",
    "block_size",
    "chain_key",
    "content_key",
    "counted_parent",
    "drop_gpu",
    "end_tokens",
    "extra_keys",
    "gpu_refs",
    "has_free_link",
    "holds_none",
    "lora_name",
    "new_record_map",
    "new_ref_counts",
    "pack",
    "packs_end",
    "packs_size",
    "parent_of",
    "plain_hash",
    "token_ids",
    "unkeyed",
    "with_free_link",
    "without_free_link",
]

Hash = Union[int, bytes]
"""An engine block hash as the wire carries it (int, or bytes from vLLM <= 0.23)."""

Record = Union[int, tuple[Any, ...]]
"""A metadata record: a packed int or, for the rare wide records, a tuple."""

RecordMap = MutableMapping[Hash, Record]
"""One KV-cache group's records by engine hash, in insertion order: a dict, or with the
compiled core its ``kvevents_native.RecordTable`` (the same items in a flat table of
32-byte entries; keys(), values() and items() are lists there).  Made by
:func:`new_record_map`."""

RefCounts = MutableMapping[Hash, int]
"""A CPU or STORAGE tier's refcounts by chunk-tail hash, in insertion order: a dict, or
with the compiled core a ``kvevents_native.RecordTable`` (counts are ints it holds)."""

if NATIVE is not None:
    MutableMapping.register(NATIVE.RecordTable)


def new_record_map() -> RecordMap:
    """An empty group's records: the compiled core's table when it runs, else a dict."""
    if NATIVE is not None:
        return NATIVE.RecordTable()  # type: ignore[no-any-return]
    return {}


def new_ref_counts() -> RefCounts:
    """An empty tier's refcounts: the compiled core's table when it runs, else a dict."""
    if NATIVE is not None:
        return NATIVE.RecordTable()  # type: ignore[no-any-return]
    return {}


def adopt_records(records: MutableMapping[Hash, Any]) -> Any:
    """``records`` (a restored snapshot's dict) in the kind :func:`new_record_map`
    makes, in the same order."""
    if NATIVE is None or type(records) is not dict:
        return records
    out = new_record_map()
    for h, m in records.items():
        out[h] = m
    return out


def holds_none(records: MutableMapping[Hash, Any], hashes: Iterable[Hash]) -> bool:
    """Whether no hash of ``hashes`` is a key of ``records`` (one C-level pass either
    way)."""
    if type(records) is dict:
        return records.keys().isdisjoint(hashes)
    return bool(records.isdisjoint(hashes))  # type: ignore[attr-defined]


F_CK, F_END, F_PARENT, F_SIZE, F_LORA, F_EXTRA, F_TOKENS, F_GPU, F_CHAIN = range(9)
"""Field indices of a tuple record."""
CK_MASK = (1 << 64) - 1
"""Mask of the content key bits (the key itself: content keys are unsigned 64-bit)."""
HAS_CK = 1 << 64
"""Set when the record has a content key."""
FIELD_MASK = (1 << 20) - 1
"""Mask of the 20-bit end and size fields (after shifting)."""
END_SHIFT = 65
"""Shift of the end field: end position in blocks + 1 (0: unknown)."""
SIZE_SHIFT = 85
"""Shift of the block size field (tokens)."""
PARENT_SHIFT = 105
"""Shift of the parent field: parent hash + 1 (0: none)."""
PARENT_MASK = (1 << 65) - 1
"""Mask of the parent field (after shifting)."""
FREE_LINK = 1 << 170
"""Set in the packed record of a resident block that its parent's resident-children count
(``GroupState.kids``) does not count: the block and its parent became resident in one
GPU store, the parent with no earlier place in the eviction queue, so the queue takes
the block first (see :class:`~.eviction.Eviction`).  Meaningless while the block is not
resident; tuple records never carry it."""
GPU_SHIFT = 171
"""Shift of the GPU refcount (the top bits: a packed record >= GPU_ONE is held on GPU)."""
GPU_ONE = 1 << GPU_SHIFT
"""One GPU reference, to add to or subtract from a packed record."""
GPU_TWO = 2 << GPU_SHIFT
"""Two GPU references: a packed record >= GPU_TWO stays held after one removal."""


def pack(
    ck: int | None,
    end_blocks: int | None,
    parent: Hash | None,
    size: int,
    lora: str | None = None,
    extra: Any = None,
    tokens: tuple[int, ...] | None = None,
    chain: int | None = None,
    gpu: int = 0,
) -> Record:
    """A record with a GPU refcount of ``gpu``: packed when every field fits, else a
    tuple.  (A new block of a GPU store is made holding its first GPU reference, see
    :meth:`.refs.RefRules.ref`.)"""
    if chain is not None and chain != ck:
        return (ck, end_blocks, parent, size, lora, extra, tokens, gpu, chain)
    if (
        lora is None
        and extra is None
        and tokens is None
        and (parent is None or (type(parent) is int and 0 <= parent <= CK_MASK))
        and (end_blocks is None or end_blocks < FIELD_MASK)
        and 0 < size <= FIELD_MASK
    ):
        v = (gpu << GPU_SHIFT) | (size << SIZE_SHIFT)
        if ck is not None:
            v |= ck | HAS_CK
        if end_blocks is not None:
            v |= (end_blocks + 1) << END_SHIFT
        if parent is not None:
            v |= (parent + 1) << PARENT_SHIFT
        return v
    return (ck, end_blocks, parent, size, lora, extra, tokens, gpu)


def plain_hash(h: Hash) -> bool:
    """Whether ``h`` fits a packed record's parent field (an unsigned 64-bit int)."""
    return type(h) is int and 0 <= h <= CK_MASK


def packs_size(size: int) -> bool:
    """Whether a block size fits a packed record."""
    return 0 < size <= FIELD_MASK


def packs_end(end_blocks: int) -> bool:
    """Whether an end position (in blocks) fits a packed record."""
    return end_blocks < FIELD_MASK


def with_free_link(m: Record) -> Record:
    """The packed record ``m`` with :data:`FREE_LINK` set (its link to its parent is not
    counted among the parent's resident children)."""
    assert isinstance(m, int), "only packed records carry a free link"
    return m | FREE_LINK


def has_free_link(m: Record) -> bool:
    """Whether the record carries :data:`FREE_LINK`."""
    return type(m) is int and bool(m & FREE_LINK)


def without_free_link(m: Record) -> Record:
    """The record with :data:`FREE_LINK` cleared."""
    return m & ~FREE_LINK if type(m) is int else m


def gpu_refs(m: Record) -> int:
    """The record's GPU refcount."""
    if isinstance(m, int):
        return m >> GPU_SHIFT
    count: int = m[F_GPU]
    return count


def add_gpu(m: Record, delta: int) -> Record:
    """The record with its GPU refcount changed by ``delta``."""
    if isinstance(m, int):
        return m + delta * GPU_ONE
    return (*m[:F_GPU], m[F_GPU] + delta, *m[F_CHAIN:])


def drop_gpu(m: Record) -> tuple[int, Record]:
    """The record's GPU refcount, and the record with one GPU reference fewer (when the
    count is 0 the record is returned unchanged: there is none to drop)."""
    if isinstance(m, int):
        count = m >> GPU_SHIFT
        return count, (m - GPU_ONE if count else m)
    count = m[F_GPU]
    return count, ((*m[:F_GPU], count - 1, *m[F_CHAIN:]) if count else m)


def content_key(m: Record) -> int | None:
    """The record's content key (the key its marks use), or None."""
    if isinstance(m, int):
        return m & CK_MASK if m & HAS_CK else None
    ck: int | None = m[F_CK]
    return ck


def chain_key(m: Record) -> int | None:
    """The key children of this block chain on (its content key unless it has lookahead)."""
    if isinstance(m, int):
        return m & CK_MASK if m & HAS_CK else None
    ck: int | None = m[F_CHAIN] if len(m) > F_CHAIN else m[F_CK]
    return ck


def unkeyed(m: Record) -> Record:
    """The record without its content key (a partial tail is never matched)."""
    if isinstance(m, int):
        return m & ~(CK_MASK | HAS_CK)
    return (None, *m[1:F_CHAIN])


def block_size(m: Record) -> int:
    """Tokens in the block."""
    if isinstance(m, int):
        return (m >> SIZE_SHIFT) & FIELD_MASK
    size: int = m[F_SIZE]
    return size


def end_tokens(m: Record) -> int | None:
    """One past the block's last token position, or None when unknown."""
    if isinstance(m, int):
        e = (m >> END_SHIFT) & FIELD_MASK
        return (e - 1) * ((m >> SIZE_SHIFT) & FIELD_MASK) if e else None
    end: int | None = m[F_END]
    return None if end is None else end * int(m[F_SIZE])


def parent_of(m: Record) -> Hash | None:
    """The parent block's hash, or None (a root, or unknown)."""
    if isinstance(m, int):
        p = (m >> PARENT_SHIFT) & PARENT_MASK
        return p - 1 if p else None
    parent: Hash | None = m[F_PARENT]
    return parent


def counted_parent(m: Record) -> Hash | None:
    """The parent whose resident-children count includes this (resident) block: its
    parent, or None for a root, an unknown parent or a :data:`FREE_LINK`."""
    if isinstance(m, int):
        if m & FREE_LINK:
            return None
        p = (m >> PARENT_SHIFT) & PARENT_MASK
        return p - 1 if p else None
    parent: Hash | None = m[F_PARENT]
    return parent


def lora_name(m: Record) -> str | None:
    """The LoRA name the block was stored with (packed records have none)."""
    name: str | None = None if isinstance(m, int) else m[F_LORA]
    return name


def extra_keys(m: Record) -> Any:
    """The block's extra keys as its store carried them (packed records have none)."""
    return None if isinstance(m, int) else m[F_EXTRA]


def token_ids(m: Record) -> tuple[int, ...] | None:
    """The block's token ids, kept when the index was built with ``keep_token_ids``
    (packed records keep none)."""
    tokens: tuple[int, ...] | None = None if isinstance(m, int) else m[F_TOKENS]
    return tokens
