"""Least-recently-used policy with request-aware ranks (vLLM's ``LRUCachePolicy``).

Every tracked key has a logical rank ``(major, minor)``; the smallest evictable rank is
evicted first.

* A key inserted with a position on its :class:`ReqContext` ranks
  ``(request_rank, -position)``: the request's rank is drawn once from a global counter,
  and within a request the tail (higher position) ranks lower, so it goes first.
* A key without a position ranks ``(next_rank, 0)``: insertion order.
* :meth:`clear` (a cache reset) voids every request rank drawn before it; a request
  that spans the reset draws a new one.
* :meth:`touch` gives fresh, increasing ranks walking the keys in reverse, so
  ``keys[0]`` ends most recent.
* :meth:`on_request_access` takes the request's rank (drawing it on first use, even if
  no key is then raised) and raises each held key with a position to
  ``(request_rank, -position)`` if that is higher.
* A finished request's keys are touched one by one tail to head across its KV groups
  (:meth:`CachePolicy.on_request_finished`), so its head ends most recent.

Evictable keys live in a lazy min-heap: entries whose rank is stale, or whose chunk is
no longer evictable, are skipped when popped and the heap is rebuilt when stale entries
outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

from kvevents.publishers.offload.base import OffloadKey, ReqContext
from kvevents.publishers.offload.policies.base import (
    CachePolicy,
    ChunkStatus,
)

__all__ = ["LRUCachePolicy"]

Rank = tuple[int, int]

_SCRATCH_RANK = "kvevents.lru.request_rank"


class LRUCachePolicy(CachePolicy):
    """LRU over logical ranks; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._chunks: dict[OffloadKey, ChunkStatus] = {}
        self._ranks: dict[OffloadKey, Rank] = {}
        self._evictable: set[OffloadKey] = set()
        self._heap: list[tuple[Rank, OffloadKey]] = []
        self._next_rank = 0
        self._generation = 0  # bumped by clear(): request ranks drawn before are void

    # --- helpers -----------------------------------------------------------------------

    def _fresh_rank(self) -> Rank:
        rank = (self._next_rank, 0)
        self._next_rank += 1
        return rank

    def _request_rank(self, ctx: ReqContext) -> int:
        # Stored per policy instance so two managers sharing a context stay independent.
        slot = f"{_SCRATCH_RANK}.{id(self)}"
        entry = ctx.scratch.get(slot)
        if isinstance(entry, tuple) and entry[0] == self._generation:
            return int(entry[1])
        rank = self._next_rank
        self._next_rank += 1
        ctx.scratch[slot] = (self._generation, rank)
        return rank

    def _set_rank(self, key: OffloadKey, rank: Rank) -> None:
        self._ranks[key] = rank
        if key in self._evictable:
            self._push(key, rank)

    def _push(self, key: OffloadKey, rank: Rank) -> None:
        heapq.heappush(self._heap, (rank, key))
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._evictable) + 16:
            self._heap = [(self._ranks[k], k) for k in self._evictable]
            heapq.heapify(self._heap)

    def rank(self, key: OffloadKey) -> Rank | None:
        """The current logical rank of ``key`` (smaller = evicted sooner)."""
        return self._ranks.get(key)

    # --- membership --------------------------------------------------------------------

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self._chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, ctx: ReqContext) -> None:
        position = ctx.position(key)
        rank = (self._request_rank(ctx), -position) if position is not None else self._fresh_rank()
        self._chunks[key] = chunk
        self._evictable.discard(key)
        self._ranks[key] = rank

    def remove(self, key: OffloadKey) -> None:
        self._chunks.pop(key, None)
        self._ranks.pop(key, None)
        self._evictable.discard(key)

    def keys(self) -> Iterator[OffloadKey]:
        return iter(list(self._chunks))

    def __len__(self) -> int:
        return len(self._chunks)

    # --- recency -----------------------------------------------------------------------

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        for key in reversed(keys):
            if key in self._chunks:
                self._set_rank(key, self._fresh_rank())

    def on_request_access(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Raise each held key with a position to ``(request_rank, -position)`` if higher.

        The request's rank is taken first, on every call, even when no key is then
        raised (vLLM does the same): a request's rank dates from its first access.
        """
        request_rank = self._request_rank(ctx)
        for key in keys:
            current = self._ranks.get(key)
            position = ctx.position(key)
            if current is None or position is None:
                continue
            candidate = (request_rank, -position)
            if candidate > current:
                self._set_rank(key, candidate)

    # --- eviction ----------------------------------------------------------------------

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        if n > len(self._evictable):
            return None
        chosen: list[OffloadKey] = []
        chosen_set: set[OffloadKey] = set()
        skipped: list[tuple[Rank, OffloadKey]] = []
        while self._heap and len(chosen) < n:
            rank, key = heapq.heappop(self._heap)
            if key not in self._evictable or self._ranks.get(key) != rank or key in chosen_set:
                continue  # stale entry
            if key in protected:
                skipped.append((rank, key))
                continue
            chosen.append(key)
            chosen_set.add(key)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if len(chosen) < n:
            for key in chosen:
                heapq.heappush(self._heap, (self._ranks[key], key))
            return None
        out: list[tuple[OffloadKey, ChunkStatus]] = []
        for key in chosen:
            out.append((key, self._chunks.pop(key)))
            self._ranks.pop(key)
            self._evictable.discard(key)
        return out

    def mark_evictable(self, key: OffloadKey) -> None:
        if key in self._chunks and key not in self._evictable:
            self._evictable.add(key)
            self._push(key, self._ranks[key])

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)

    def clear(self) -> None:
        self._chunks.clear()
        self._ranks.clear()
        self._evictable.clear()
        self._heap.clear()
        self._next_rank = 0
        self._generation += 1
