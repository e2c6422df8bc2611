"""What a :class:`~kvevents.seqtrack.StreamTracker` remembers of a stream's
past: the fingerprints of the last delivered seqs and the seq ranges reported lost.

One job: :class:`SeqHistory`.  Imports nothing of kvevents.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable

__all__ = ["SeqHistory"]

_INF = float("inf")


class SeqHistory:
    """The last ``size`` delivered seqs' fingerprints and the lost ranges reaching back
    ``size`` seqs from the newest one.

    :attr:`ring` slot ``seq % size`` holds ``(seq, fingerprint)`` of the newest delivered
    seq with that slot (the tracker writes it directly on its hot path:
    ``ring[seq % size] = (seq, fingerprint)``); :attr:`lost` the inclusive ``(lo, hi)``
    ranges reported lost, in increasing order."""

    __slots__ = ("lost", "ring", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.ring: list[tuple[int, Hashable] | None] = [None] * size
        self.lost: list[tuple[int, int]] = []

    def fingerprint(self, seq: int) -> Hashable | None:
        """The fingerprint delivered with ``seq``, None when it is not remembered."""
        entry = self.ring[seq % self.size]
        return entry[1] if entry is not None and entry[0] == seq else None

    def known(self, seq: int) -> bool:
        """Whether ``seq``'s delivery is remembered."""
        entry = self.ring[seq % self.size]
        return entry is not None and entry[0] == seq

    def seen(self, seq: int, fingerprint: Hashable) -> bool:
        """Whether ``seq`` was delivered with ``fingerprint`` (as far as remembered)."""
        entry = self.ring[seq % self.size]
        return entry is not None and entry[0] == seq and entry[1] == fingerprint

    def add_lost(self, lo: int, hi: int) -> None:
        """Remember ``lo..hi`` as lost (above every range remembered), forgetting ranges
        more than ``size`` seqs below ``hi``."""
        lost = self.lost
        lost.append((lo, hi))
        floor = hi - self.size
        while lost and lost[0][1] < floor:
            lost.pop(0)

    def is_lost(self, seq: int) -> bool:
        """Whether ``seq`` is in a remembered lost range."""
        lost = self.lost
        i = bisect.bisect_right(lost, (seq, _INF)) - 1
        return i >= 0 and lost[i][0] <= seq <= lost[i][1]
