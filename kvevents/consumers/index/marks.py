"""Tier marks: content key -> bitset of the slots holding it, counted per (key, slot).

One job: the per-tier map the router walks (a slot is one (worker, KV-cache group); its
bit is ``1 << slot``) and the rule that keeps it counted: :meth:`TierMarks.mark` and
:meth:`TierMarks.unmark` are the only writers (called by :mod:`.refs` on a tier's first
and last reference, by :mod:`.eviction` when an entry is evicted).

:class:`TierMarks` is the specification.  With the compiled core, :func:`new_marks`
makes its ``kvevents_native.SlotMarks`` instead: the same writers and readers over flat
tables (an open-addressing table of 64-bit keys, a slot or a word bitset per key), which
the router's compiled walk reads without a Python object per key.  Either kind is read
through :class:`Marks`; snapshots write both as :class:`TierMarks` (:func:`as_tier_marks`)
and a restored index takes the core's kind again (:func:`adopt`).  Imports nothing from
the index.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from kvevents.native import NATIVE

__all__ = ["Marks", "TierMarks", "adopt", "as_tier_marks", "new_marks"]


class Marks(Protocol):
    """What a tier's marks answer, whichever core keeps them."""

    def get(self, key: int, default: Any = None, /) -> Any:
        """The bitset of slots holding ``key`` (a bit per slot), or ``default``."""

    def __len__(self) -> int:
        """Content keys held by some slot."""

    def __iter__(self) -> Iterator[int]:
        """The content keys, in the order they were first marked (since last unmarked)."""

    def __getitem__(self, key: int) -> int: ...

    def keys(self) -> Any: ...

    def items(self) -> Any: ...

    def mark(self, ck: int, slot: int) -> None:
        """One more reference of ``ck`` by ``slot``."""

    def unmark(self, ck: int, slot: int) -> None:
        """One reference of ``ck`` by ``slot`` fewer (the slot's bit goes with the last)."""


_BITS: list[int] = [1 << s for s in range(64)]
"""``1 << slot`` by slot, shared: a key one slot holds maps to this object (no new int)."""


def _new_bit(slot: int) -> int:
    """``1 << slot`` for a slot beyond :data:`_BITS`, which grows to hold it."""
    _BITS.extend(1 << s for s in range(len(_BITS), slot + 1))
    return _BITS[slot]


class TierMarks(dict[int, int]):
    """Content key -> bitset of slots, with a count of extra references per (key, slot).

    Marks are counted: two engine blocks of one slot with the same content key (e.g. one
    LoRA name over two adapter paths) are two references, and removing one keeps the
    other.  ``dups`` holds the references beyond the first, keyed ``(key, 1 << slot)``;
    it is almost always empty.
    """

    __slots__ = ("dups",)

    def __init__(self) -> None:
        super().__init__()
        self.dups: dict[tuple[int, int], int] = {}

    def mark(self, ck: int, slot: int) -> None:
        """One more reference of ``ck`` by ``slot``."""
        try:
            bit = _BITS[slot]
        except IndexError:
            bit = _new_bit(slot)
        v = self.get(ck)
        if v is None:
            self[ck] = bit
        elif v & bit:
            d = self.dups
            d[(ck, bit)] = d.get((ck, bit), 0) + 1
        else:
            self[ck] = v | bit

    def unmark(self, ck: int, slot: int) -> None:
        """One reference of ``ck`` by ``slot`` fewer (the slot's bit goes with the last)."""
        try:
            bit = _BITS[slot]
        except IndexError:
            bit = _new_bit(slot)
        d = self.dups
        if d:
            c = d.get((ck, bit))
            if c:
                if c == 1:
                    del d[(ck, bit)]
                else:
                    d[(ck, bit)] = c - 1
                return
        v = self.get(ck)
        if v == bit:
            del self[ck]  # the slot was its only holder
        elif v is not None and v & bit:
            self[ck] = v & ~bit


def new_marks() -> Marks:
    """An empty tier's marks: the compiled core's when it runs, else :class:`TierMarks`."""
    if NATIVE is not None:
        return NATIVE.SlotMarks()  # type: ignore[no-any-return]
    return TierMarks()


def as_tier_marks(marks: Any) -> TierMarks:
    """``marks`` as a :class:`TierMarks` with the same keys, bitsets and extra references,
    each in the same order (the snapshot's form)."""
    if type(marks) is TierMarks:
        return marks
    out = TierMarks()
    out.update(marks.items())
    out.dups.update(marks.dup_items())
    return out


def adopt(marks: TierMarks) -> Marks:
    """``marks`` in the kind :func:`new_marks` makes (a restored snapshot's marks, for
    the core that runs now)."""
    if NATIVE is None:
        return marks
    out: Any = new_marks()
    for ck, bits in marks.items():
        out.load(ck, bits)
    for (ck, bit), count in marks.dups.items():
        out.load_dup(ck, bit.bit_length() - 1, count)
    return out  # type: ignore[no-any-return]
