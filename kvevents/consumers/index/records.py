"""Metadata records: what the index knows about one engine block.

One job: :class:`BlockRecord`, the record of one (worker, group, engine hash): its
content key, position, block size, parent, LoRA name, extra keys, token ids (only with
``keep_token_ids``), GPU refcount, and the memory cap's free-link flag.  Imports nothing
from the index.

Every room reads and changes records through these named fields.  The snapshot writes a
record in its stored form (:meth:`BlockRecord.encoded`), the compact encoding the index
has always written, so snapshots stay byte for byte what they were:

* a *packed* record is one int: bits 0-63 the content key (:data:`CK_MASK`), bit 64
  "has a content key" (:data:`HAS_CK`), bits 65-84 end position in blocks + 1
  (:data:`END_SHIFT`, 0: unknown), bits 85-104 the block size (:data:`SIZE_SHIFT`),
  bits 105-169 parent hash + 1 (:data:`PARENT_SHIFT`, 0: none), bit 170
  :data:`FREE_LINK`, bits 171 and up the GPU refcount (:data:`GPU_SHIFT`);
* a *wide* record (a LoRA name, extra keys, token ids, a bytes or out-of-range parent,
  fields out of range, or a chain key other than its content key) is the tuple
  ``(key, end_blocks, parent, size, lora, extra, tokens, gpu)``, plus the chain key as
  a ninth field when it differs from the content key.

Which form a record takes is decided when it is made and kept for its life
(:attr:`BlockRecord.wide`).
"""

from __future__ import annotations

from typing import Any, Union

__all__ = [
    "CK_MASK",
    "END_SHIFT",
    "FIELD_MASK",
    "FREE_LINK",
    "GPU_SHIFT",
    "HAS_CK",
    "PARENT_MASK",
    "PARENT_SHIFT",
    "SIZE_SHIFT",
    "BlockRecord",
    "Hash",
    "StoredRecord",
    "packs_end",
    "packs_size",
    "plain_hash",
]

Hash = Union[int, bytes]
"""An engine block hash as the wire carries it (int, or bytes from vLLM <= 0.23)."""

StoredRecord = Union[int, tuple[Any, ...]]
"""A record's stored form: a packed int or a wide tuple (see the module docstring)."""

CK_MASK = (1 << 64) - 1
"""Mask of the content key bits (the key itself: content keys are unsigned 64-bit)."""
HAS_CK = 1 << 64
"""Set when the packed record has a content key."""
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
"""The free-link flag of a packed record (:attr:`BlockRecord.free_link`)."""
GPU_SHIFT = 171
"""Shift of the GPU refcount (the top bits)."""


def plain_hash(h: Hash) -> bool:
    """Whether ``h`` fits a packed record's parent field (an unsigned 64-bit int)."""
    return type(h) is int and 0 <= h <= CK_MASK


def packs_size(size: int) -> bool:
    """Whether a block size fits a packed record."""
    return 0 < size <= FIELD_MASK


def packs_end(end_blocks: int) -> bool:
    """Whether an end position (in blocks) fits a packed record."""
    return end_blocks < FIELD_MASK


class BlockRecord:
    """What the index knows about one engine block of one (worker, group).

    * ``key``: the content key the block's marks use (None: not matchable: its parent's
      key was unknown, its tokens could not be keyed, or it is a partial tail);
    * ``chain``: the key the block's children chain on (``key``, unless the block was
      hashed with lookahead tokens: then ``key`` covers them and ``chain`` does not);
    * ``end_blocks``: one past the block's last token, in blocks (None: unknown);
    * ``parent``: the parent block's engine hash (None: a root);
    * ``size``: tokens in the block; ``lora``, ``extra``: the store's LoRA name and the
      block's extra keys; ``tokens``: its token ids (only with ``keep_token_ids``);
    * ``gpu``: GPU references (the block is on the GPU tier while it is positive);
    * ``free_link``: the memory cap does not count this resident block among its
      parent's resident children (see :mod:`.eviction`); meaningless while the block is
      not resident;
    * ``wide``: stored as a tuple, not a packed int (see the module docstring).
    """

    __slots__ = (
        "chain",
        "end_blocks",
        "extra",
        "free_link",
        "gpu",
        "key",
        "lora",
        "parent",
        "size",
        "tokens",
        "wide",
    )

    def __init__(
        self,
        key: int | None,
        end_blocks: int | None,
        parent: Hash | None,
        size: int,
        lora: str | None = None,
        extra: Any = None,
        tokens: tuple[int, ...] | None = None,
        chain: int | None = None,
    ) -> None:
        self.key = key
        self.chain = key if chain is None else chain
        self.end_blocks = end_blocks
        self.parent = parent
        self.size = size
        self.lora = lora
        self.extra = extra
        self.tokens = tokens
        self.gpu = 0
        self.free_link = False
        self.wide = not (
            lora is None
            and extra is None
            and tokens is None
            and (parent is None or (type(parent) is int and 0 <= parent <= CK_MASK))
            and (end_blocks is None or end_blocks < FIELD_MASK)
            and 0 < size <= FIELD_MASK
            and self.chain == key
        )

    @property
    def end_tokens(self) -> int | None:
        """One past the block's last token position, or None when unknown."""
        return None if self.end_blocks is None else self.end_blocks * self.size

    @property
    def counted_parent(self) -> Hash | None:
        """The parent whose resident-children count includes this (resident) block: its
        parent, unless it is a root or its link is free."""
        return None if self.free_link else self.parent

    def unkeyed(self) -> BlockRecord:
        """A copy without content and chain keys (a partial tail is never matched)."""
        r = BlockRecord.__new__(BlockRecord)
        for name in self.__slots__:
            setattr(r, name, getattr(self, name))
        r.key = r.chain = None
        return r

    def encoded(self) -> StoredRecord:
        """The record's stored form (see the module docstring)."""
        if self.wide:
            t = (self.key, self.end_blocks, self.parent, self.size, self.lora, self.extra,
                 self.tokens, self.gpu)  # fmt: skip
            return t if self.chain == self.key else (*t, self.chain)
        v = (self.size << SIZE_SHIFT) | (self.gpu << GPU_SHIFT)
        if self.key is not None:
            v |= self.key | HAS_CK
        if self.end_blocks is not None:
            v |= (self.end_blocks + 1) << END_SHIFT
        if self.parent is not None:
            v |= (self.parent + 1) << PARENT_SHIFT  # type: ignore[operator]
        if self.free_link:
            v |= FREE_LINK
        return v

    @classmethod
    def decoded(cls, v: StoredRecord) -> BlockRecord:
        """The record whose stored form is ``v`` (the inverse of :meth:`encoded`)."""
        r = cls.__new__(cls)
        r.free_link = False
        r.lora = r.extra = r.tokens = None
        if isinstance(v, int):
            r.key = v & CK_MASK if v & HAS_CK else None
            e = (v >> END_SHIFT) & FIELD_MASK
            r.end_blocks = e - 1 if e else None
            r.size = (v >> SIZE_SHIFT) & FIELD_MASK
            p = (v >> PARENT_SHIFT) & PARENT_MASK
            r.parent = p - 1 if p else None
            r.free_link = bool(v & FREE_LINK)
            r.gpu = v >> GPU_SHIFT
            r.wide = False
            r.chain = r.key
        else:
            r.key, r.end_blocks, r.parent, r.size, r.lora, r.extra, r.tokens, r.gpu = v[:8]
            r.chain = v[8] if len(v) > 8 else r.key
            r.wide = True
        return r

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockRecord) and self.encoded() == other.encoded()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"BlockRecord({fields})"
