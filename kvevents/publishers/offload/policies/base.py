"""The cache-policy interface of :class:`~kvevents.publishers.offload.CPUOffloadingManager`.

A policy orders the chunks the manager holds and chooses eviction victims, as vLLM's
``cpu/policies/``.  The
manager owns the chunk slots and reference counts; the policy owns recency.

Contracts:

* :meth:`CachePolicy.evict` is **atomic**: it returns exactly ``n`` ``(key, chunk)``
  pairs, removing them, or ``None`` having changed nothing.  It only takes chunks whose
  ``ref_cnt == 0`` (ready and unpinned) and whose key is not in ``protected``.
* :meth:`CachePolicy.mark_evictable` / :meth:`CachePolicy.mark_non_evictable` are
  called by the manager when a chunk's ``ref_cnt`` becomes / stops being 0.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

from kvevents.errors import ConfigError
from kvevents.publishers.offload.base import OffloadKey, ReqContext

__all__ = ["CachePolicy", "ChunkStatus", "order_request_keys"]


def order_request_keys(
    key_groups: Sequence[Sequence[OffloadKey]], ctx: ReqContext
) -> list[OffloadKey]:
    """All of a request's keys in one head-to-tail order across its KV groups.

    The groups are concatenated in the order given; when every key has a position on
    ``ctx`` they are then sorted by it (stably, so equal positions keep group order).
    """
    keys = [key for group in key_groups for key in group]
    positions: dict[OffloadKey, int] = {}
    for key in keys:
        position = ctx.position(key)
        if position is not None:
            positions[key] = position
    if len(positions) == len(set(keys)):
        keys.sort(key=positions.__getitem__)
    return keys


class ChunkStatus:
    """One CPU chunk slot held for a key.

    ``ref_cnt`` is ``-1`` while the write is in flight (not ready), ``0`` when ready and
    evictable, and ``> 0`` while pinned by that many loads.
    """

    __slots__ = ("chunk_id", "ref_cnt")

    def __init__(self, chunk_id: int) -> None:
        self.chunk_id = chunk_id
        self.ref_cnt = -1

    @property
    def is_ready(self) -> bool:
        """Whether the chunk's data has been written (loadable)."""
        return self.ref_cnt >= 0

    @property
    def is_evictable(self) -> bool:
        """Ready and not pinned."""
        return self.ref_cnt == 0

    def __repr__(self) -> str:
        return f"ChunkStatus(chunk_id={self.chunk_id}, ref_cnt={self.ref_cnt})"


class CachePolicy(ABC):
    """Recency bookkeeping and victim choice over ``capacity`` chunk slots."""

    def __init__(self, capacity: int) -> None:
        """``capacity``: chunk slots (>= 0; else :class:`~kvevents.errors.ConfigError`,
        a ``ValueError``)."""
        if capacity < 0:
            raise ConfigError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity

    # --- membership ---------------------------------------------------------------------

    @abstractmethod
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        """The chunk held for ``key``, or ``None``."""

    @abstractmethod
    def insert(self, key: OffloadKey, chunk: ChunkStatus, ctx: ReqContext) -> None:
        """Start tracking ``key`` (its chunk is not ready yet, so not evictable)."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Stop tracking ``key`` (a failed store); no ghost history is kept for it."""

    @abstractmethod
    def keys(self) -> Iterator[OffloadKey]:
        """Every tracked key (in no promised order)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of tracked keys."""

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.get(key) is not None  # type: ignore[arg-type]

    # --- recency ------------------------------------------------------------------------

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Mark ``keys`` recently used, walking them in reverse so ``keys[0]`` ends MRU."""

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """``keys`` were offered for storing and are absent (once per request per key).

        Default: :meth:`touch`.
        """
        self.touch(keys, ctx)

    def on_request_access(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """A request accessed ``keys`` for the first time (each key once per request).

        Called once per manager call with the keys new to the request, in call order:
        keys it loads (already pinned), ready keys it offers again, and keys it offers
        for storing, *before* they are inserted (so not held yet).  Default: no-op.
        """
        return None

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only: set[OffloadKey],
        reused: set[OffloadKey],
        ctx: ReqContext,
    ) -> None:
        """A request finished; ``key_groups`` are its keys per KV group, head to tail.

        ``insertion_only`` are keys it stored and never loaded, ``reused`` keys it
        loaded.  Every policy walks the request's keys the same way: across its groups in
        one head-to-tail order (:func:`order_request_keys`), tail first, each key handed
        to :meth:`on_key_finished`, so the request's head is handled last.
        """
        for key in reversed(order_request_keys(key_groups, ctx)):
            self.on_key_finished(key, key in reused, key in insertion_only, ctx)

    def on_key_finished(
        self, key: OffloadKey, reused: bool, insertion_only: bool, ctx: ReqContext
    ) -> None:
        """One key of a finished request (see :meth:`on_request_finished`).  Default:
        :meth:`touch` it, so the request's head ends most recent."""
        self.touch((key,), ctx)

    # --- eviction -----------------------------------------------------------------------

    @abstractmethod
    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Remove and return exactly ``n`` evictable, unprotected chunks, or ``None``."""

    @abstractmethod
    def mark_evictable(self, key: OffloadKey) -> None:
        """``key``'s chunk became evictable (``ref_cnt`` reached 0)."""

    @abstractmethod
    def mark_non_evictable(self, key: OffloadKey) -> None:
        """``key``'s chunk was pinned (``ref_cnt`` left 0)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything (cache reset)."""
