"""Adaptive Replacement Cache policy (vLLM's ``ARCCachePolicy``).

State: ``T1`` (keys seen once), ``T2`` (keys reused), ghost lists ``B1``/``B2`` (keys
recently evicted from T1/T2, no data) and the target size ``p`` of T1 (a float starting
at 0).  Every list is ordered least-recently-used first.

* :meth:`insert` appends to T1 and drops the key from the ghosts.
* :meth:`touch` walks the keys in reverse: a T1 key that is not ready stays in T1 (moved
  to its MRU end), a ready one is promoted to T2's MRU end; a T2 key moves to T2's MRU
  end; a ghost hit adapts ``p`` (B1: ``p = min(p + max(1, |B2|/|B1|), capacity)``; B2:
  ``p = max(p - max(1, |B1|/|B2|), 0)``) and moves the ghost to its list's MRU end.
* :meth:`on_store_miss` does the ghost adaptation only.
* :meth:`evict` fills each slot from T1's LRU end while the (virtual) size of T1 is at
  least ``int(p)``, else from T2, falling back to the other list; evicted T1 keys join
  B1, T2 keys B2, and each ghost list is then trimmed to ``capacity``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvevents.publishers.offload.base import OffloadKey, ReqContext
from kvevents.publishers.offload.policies.base import (
    CachePolicy,
    ChunkStatus,
)

__all__ = ["ARCCachePolicy"]


class ARCCachePolicy(CachePolicy):
    """ARC; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    # --- membership --------------------------------------------------------------------

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        chunk = self.t1.get(key)
        return chunk if chunk is not None else self.t2.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, ctx: ReqContext) -> None:
        self.t2.pop(key, None)
        self.t1[key] = chunk
        self.t1.move_to_end(key)
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def keys(self) -> Iterator[OffloadKey]:
        return iter([*self.t1, *self.t2])

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    # --- recency -----------------------------------------------------------------------

    def _adapt(self, key: OffloadKey) -> bool:
        """Ghost-hit adaptation of ``p``; True if ``key`` was a ghost."""
        if key in self.b1:
            delta = max(1.0, len(self.b2) / len(self.b1))
            self.target_t1_size = min(self.target_t1_size + delta, float(self.capacity))
            self.b1.move_to_end(key)
            return True
        if key in self.b2:
            delta = max(1.0, len(self.b1) / len(self.b2))
            self.target_t1_size = max(self.target_t1_size - delta, 0.0)
            self.b2.move_to_end(key)
            return True
        return False

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        for key in reversed(keys):
            chunk = self.t1.get(key)
            if chunk is not None:
                if chunk.is_ready:
                    del self.t1[key]
                    self.t2[key] = chunk
                else:
                    self.t1.move_to_end(key)
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._adapt(key)

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        for key in reversed(keys):
            if key not in self.t1 and key not in self.t2:
                self._adapt(key)

    def on_key_finished(
        self, key: OffloadKey, reused: bool, insertion_only: bool, ctx: ReqContext
    ) -> None:
        """A reused key is promoted to T2 (or refreshed there); a key the request only
        stored is refreshed where it is."""
        if reused:
            chunk = self.t1.pop(key, None)
            if chunk is not None:
                self.t2[key] = chunk
            elif key in self.t2:
                self.t2.move_to_end(key)
        elif insertion_only:
            if key in self.t1:
                self.t1.move_to_end(key)
            elif key in self.t2:
                self.t2.move_to_end(key)

    # --- eviction ----------------------------------------------------------------------

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []

        def eligible(entries: Iterator[tuple[OffloadKey, ChunkStatus]]) -> Iterator[OffloadKey]:
            for key, chunk in entries:
                if chunk.ref_cnt == 0 and key not in protected:
                    yield key

        # Both scans only move forward, so a batch eviction stays linear.
        t1_scan = eligible(iter(self.t1.items()))
        t2_scan = eligible(iter(self.t2.items()))
        picks: list[tuple[OffloadKey, bool]] = []  # (key, from T1)
        virtual_t1 = len(self.t1)
        for _ in range(n):
            prefer_t1 = virtual_t1 >= int(self.target_t1_size)
            order = ((t1_scan, True), (t2_scan, False))
            if not prefer_t1:
                order = (order[1], order[0])
            for scan, from_t1 in order:
                key = next(scan, None)
                if key is not None:
                    picks.append((key, from_t1))
                    if from_t1:
                        virtual_t1 -= 1
                    break
            else:
                return None  # nothing changed yet
        out: list[tuple[OffloadKey, ChunkStatus]] = []
        for key, from_t1 in picks:
            if from_t1:
                out.append((key, self.t1.pop(key)))
                self.b1[key] = None
            else:
                out.append((key, self.t2.pop(key)))
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return out

    def mark_evictable(self, key: OffloadKey) -> None:
        return None  # eligibility is read from ref_cnt during the scan

    def mark_non_evictable(self, key: OffloadKey) -> None:
        return None

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0
