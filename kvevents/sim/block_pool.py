"""A simulated GPU block pool with prefix caching that emits vLLM's GPU events (C§4.3).

The pool owns ``num_blocks`` physical blocks shared by every KV-cache group.  A block
that holds a full block of some request is *cached* under ``(digest, group)``; when the
request frees it, it goes to the tail of the free queue but stays cached (and "stored" on
the wire) until it is handed out again.  Events, in emission order:

* :meth:`GPUBlockPool.cache_full_blocks` emits one ``BlockStored`` covering the newly full
  blocks of one request in one group: ``parent_block_hash`` is the hash of the block
  before them (``None`` from the start), ``token_ids`` every token of those blocks,
  ``block_size`` the group's block size, ``group_idx`` and ``kv_cache_spec_kind``;
* :meth:`GPUBlockPool.allocate` evicts lazily: a cached free block that is handed out again
  emits one ``BlockRemoved([hash])`` for its hash;
* :meth:`GPUBlockPool.reset` emits ``AllBlocksCleared`` when every block is free.

Hashes on the wire are vLLM's int form (:func:`kvevents.hashing.to_wire_hash`).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvevents.errors import ConfigError
from kvevents.events import (
    MEDIUM_GPU,
    PREFIX_INDEXABLE_SPEC_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from kvevents.hashing import hash_function, none_hash, to_wire_hash

__all__ = [
    "BlockPoolStats",
    "GPUBlockPool",
    "KVCacheGroupSpec",
    "RequestHasher",
    "group_block_hashes",
    "hash_block_size",
]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: ``block_size`` tokens per block, and its attention kind.

    The simulator models prefix-indexable kinds only (full, MLA and sink-full
    attention), whose blocks hold the KV of the whole prefix.
    """

    block_size: int
    kind: str = "full_attention"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.kind not in PREFIX_INDEXABLE_SPEC_KINDS:
            raise ConfigError(
                f"the simulator models prefix-indexable groups only "
                f"({', '.join(sorted(PREFIX_INDEXABLE_SPEC_KINDS))}), not {self.kind!r}"
            )


def hash_block_size(groups: Sequence[KVCacheGroupSpec]) -> int:
    """vLLM's hash granularity (C§4.1): the block size of a single group, else the GCD."""
    if not groups:
        raise ConfigError("at least one KV-cache group is needed")
    return math.gcd(*(g.block_size for g in groups))


def group_block_hashes(raw: Sequence[bytes], block_size: int, unit: int) -> list[bytes]:
    """Group-granularity hashes from raw ``unit``-token hashes (C§4.1 coarser groups):
    block *i* takes the raw hash at index ``(i+1)·k − 1`` with ``k = block_size / unit``."""
    k = block_size // unit
    return [raw[(i + 1) * k - 1] for i in range(len(raw) // k)]


class RequestHasher:
    """Chained vLLM block digests of a growing token sequence, at ``unit`` tokens per hash.

    ``extend(tokens)`` hashes every newly full unit; :attr:`digests` holds them all.
    ``extra_keys`` (hash-side, C§4.2) are applied to every block; vLLM applies a LoRA's
    ``("lora", name, path)`` that way.
    """

    def __init__(
        self,
        unit: int,
        *,
        algo: str = "sha256_cbor",
        none: bytes | None = None,
        extra_keys: tuple[Any, ...] | None = None,
    ) -> None:
        self.unit = unit
        self._fn = hash_function(algo)
        self._none = none if none is not None else none_hash(algo)
        self._extra = extra_keys
        self.digests: list[bytes] = []

    def extend(self, tokens: Sequence[int]) -> list[bytes]:
        """Hash the full units of ``tokens`` not hashed yet; returns :attr:`digests`."""
        u = self.unit
        parent = self.digests[-1] if self.digests else self._none
        for i in range(len(self.digests), len(tokens) // u):
            parent = self._fn((parent, tuple(tokens[i * u : (i + 1) * u]), self._extra))
            self.digests.append(parent)
        return self.digests


@dataclass
class BlockPoolStats:
    """Counters of a :class:`GPUBlockPool`."""

    blocks_allocated: int = 0
    blocks_cached: int = 0
    evictions: int = 0
    stored_events: int = 0
    removed_events: int = 0
    resets: int = 0
    resets_refused: Counter[str] = field(default_factory=Counter)


class GPUBlockPool:
    """Physical blocks with a free queue (LRU eviction order) and a prefix cache.

    Not thread-safe; one engine drives it.  ``emit_events=False`` keeps the cache but
    queues no events.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        medium: str = MEDIUM_GPU,
        emit_events: bool = True,
    ) -> None:
        if num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.medium = medium
        self.emit_events = emit_events
        self.stats = BlockPoolStats()
        self._ref = [0] * num_blocks
        self._key: list[tuple[bytes, int] | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[tuple[bytes, int], dict[int, None]] = {}
        self._events: list[KVEvent] = []

    # --- queries -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out (free, cached or not)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Distinct ``(digest, group)`` entries currently cached."""
        return len(self._cached)

    def cached_block(self, digest: bytes, group: int) -> int | None:
        """A block holding ``(digest, group)``, or ``None``."""
        blocks = self._cached.get((digest, group))
        return next(iter(blocks)) if blocks else None

    def longest_hit(self, digests: Sequence[bytes], group: int) -> list[int]:
        """Blocks holding the longest cached prefix of ``digests`` in ``group``."""
        hit: list[int] = []
        for d in digests:
            b = self.cached_block(d, group)
            if b is None:
                break
            hit.append(b)
        return hit

    def block_key(self, block: int) -> tuple[bytes, int] | None:
        """The ``(digest, group)`` a block is cached under, if any."""
        return self._key[block]

    # --- allocation --------------------------------------------------------------------
    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks a request reuses (prefix hit)."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` blocks from the head of the free queue, evicting cached ones.

        Raises :class:`ConfigError` when fewer than ``n`` are free (the caller checks
        :attr:`num_free` first).
        """
        if n > len(self._free):
            raise ConfigError(f"asked for {n} blocks, only {len(self._free)} free")
        out: list[int] = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._evict(b)
            self._ref[b] = 1
            out.append(b)
        self.stats.blocks_allocated += n
        return out

    def _evict(self, b: int) -> None:
        key = self._key[b]
        if key is None:
            return
        self._key[b] = None
        holders = self._cached[key]
        del holders[b]
        if not holders:
            del self._cached[key]
        self.stats.evictions += 1
        if self.emit_events:
            self._events.append(BlockRemoved([to_wire_hash(key[0])], self.medium, key[1]))
            self.stats.removed_events += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop a reference on each block, in eviction-priority order: blocks whose
        count reaches 0 join the tail of the free queue in the order given."""
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    # --- caching -----------------------------------------------------------------------
    def cache_full_blocks(
        self,
        blocks: Sequence[int],
        digests: Sequence[bytes],
        num_cached: int,
        num_full: int,
        token_ids: Sequence[int],
        group: int,
        spec: KVCacheGroupSpec,
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        event_extra_keys: tuple[Any, ...] | None = None,
    ) -> None:
        """Cache ``blocks[num_cached:num_full]`` of one request in one group and emit one
        ``BlockStored`` for them.

        ``digests`` are the request's group-granularity digests, ``token_ids`` all its
        tokens.  ``event_extra_keys`` is the event-side extra key of every block (C§4.2),
        e.g. ``("my-lora",)``.
        """
        if num_full <= num_cached:
            return
        bs = spec.block_size
        for i in range(num_cached, num_full):
            b = blocks[i]
            key = (digests[i], group)
            if self._key[b] is None:
                self._key[b] = key
                self._cached.setdefault(key, {})[b] = None
                self.stats.blocks_cached += 1
        if not self.emit_events:
            return
        n = num_full - num_cached
        self._events.append(
            BlockStored(
                block_hashes=[to_wire_hash(d) for d in digests[num_cached:num_full]],
                parent_block_hash=to_wire_hash(digests[num_cached - 1]) if num_cached else None,
                token_ids=list(token_ids[num_cached * bs : num_full * bs]),
                block_size=bs,
                lora_id=lora_id,
                medium=self.medium,
                lora_name=lora_name,
                extra_keys=[event_extra_keys] * n if event_extra_keys is not None else None,
                group_idx=group,
                kv_cache_spec_kind=spec.kind,
            )
        )
        self.stats.stored_events += 1

    def reset(self) -> bool:
        """Drop every cached hash if no block is in use; emit ``AllBlocksCleared``.

        Returns ``False`` (and changes nothing) while any block is referenced.
        """
        if len(self._free) != self.num_blocks:
            self.stats.resets_refused["blocks_in_use"] += 1
            return False
        self._key = [None] * self.num_blocks
        self._cached.clear()
        self.stats.resets += 1
        if self.emit_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """Detach and return the queued events, in emission order."""
        events, self._events = self._events, []
        return events
