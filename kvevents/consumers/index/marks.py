"""Tier marks: content key -> bitset of the slots holding it, counted per (key, slot).

One job: the per-tier map the router walks (a slot is one (worker, KV-cache group); its
bit is ``1 << slot``) and the rule that keeps it counted: :func:`mark` and
:func:`unmark` are the only writers (called by :mod:`.refs` on a tier's first and last
reference, by :mod:`.eviction` when an entry is evicted).  Imports nothing from the
index.
"""

from __future__ import annotations

__all__ = ["TierMarks", "add_dup", "drop_dup", "mark", "unmark"]


class TierMarks(dict[int, int]):
    """Content key -> bitset of slots, with a count of extra references per (key, slot).

    Marks are counted: two engine blocks of one slot with the same content key (e.g. one
    LoRA name over two adapter paths) are two references, and removing one keeps the
    other.  ``dups`` holds the references beyond the first; it is almost always empty.
    """

    __slots__ = ("dups",)

    def __init__(self) -> None:
        super().__init__()
        self.dups: dict[tuple[int, int], int] = {}


def add_dup(marks: TierMarks, ck: int, bit: int) -> None:
    """One more reference of ``ck`` by the slot ``bit`` that already marks it."""
    d = marks.dups
    d[(ck, bit)] = d.get((ck, bit), 0) + 1


def drop_dup(marks: TierMarks, ck: int, bit: int) -> bool:
    """Drop one extra reference of ``ck`` by ``bit``; False if there was none."""
    d = marks.dups
    c = d.get((ck, bit))
    if not c:
        return False
    if c == 1:
        del d[(ck, bit)]
    else:
        d[(ck, bit)] = c - 1
    return True


def mark(marks: TierMarks, ck: int, bit: int) -> None:
    """One more reference of ``ck`` by the slot ``bit`` (a key held by one slot shares
    the slot's bit object: no new int)."""
    v = marks.get(ck)
    if v is None:
        marks[ck] = bit
    elif v & bit:
        add_dup(marks, ck, bit)
    else:
        marks[ck] = v | bit


def unmark(marks: TierMarks, ck: int, bit: int) -> None:
    """One reference of ``ck`` by the slot ``bit`` fewer (the bit goes with the last)."""
    if marks.dups and drop_dup(marks, ck, bit):
        return
    v = marks.get(ck)
    if v is None:
        return
    if v == bit:  # the only holder
        del marks[ck]
        return
    v &= ~bit
    if v:
        marks[ck] = v
    else:
        del marks[ck]
