"""A simulated GPU block pool with prefix caching that emits vLLM's GPU events (as vLLM's
``BlockPool``).

The pool owns ``num_blocks`` physical blocks shared by every KV-cache group.  A block
that holds a full block of some request is *cached* under ``(digest, group)``; when the
request frees it, it goes to the tail of the free queue but stays cached (and "stored" on
the wire) until it is handed out again.  Events, in emission order:

* :meth:`GPUBlockPool.cache_full_blocks` emits one ``BlockStored`` covering the newly full
  blocks of one request in one group: ``parent_block_hash`` is the hash of the block
  before them (``None`` from the start), ``token_ids`` every token of those blocks (null
  blocks included, as vLLM's token range does), ``block_size`` the group's block size,
  one ``extra_keys`` entry per stored hash, ``lora_id``/``lora_name``,
  ``lookahead_token_ids`` with lookahead hashing, ``group_idx`` and
  ``kv_cache_spec_kind``/``kv_cache_spec_sliding_window``; null blocks are skipped;
* :meth:`GPUBlockPool.allocate` evicts lazily: a cached free block that is handed out again
  emits one ``BlockRemoved([hash])`` for its hash;
* :meth:`GPUBlockPool.reset` emits ``AllBlocksCleared`` when every block is free.

Hashes on the wire are vLLM's int form (:func:`kvevents.hashing.to_wire_hash`).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
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
from kvevents.sim.keys import SimKey, hash_extra_keys

__all__ = [
    "NULL_BLOCK",
    "SIM_SPEC_KINDS",
    "BlockPoolStats",
    "GPUBlockPool",
    "KVCacheGroupSpec",
    "RequestHasher",
    "group_block_hashes",
    "hash_block_size",
]


SIM_SPEC_KINDS: frozenset[str] = PREFIX_INDEXABLE_SPEC_KINDS | {"sliding_window"}
"""Group kinds the simulator models: full-prefix kinds and sliding-window attention."""

NULL_BLOCK = -1
"""vLLM's null block: the placeholder a sliding-window group holds for blocks that left its
window (or were never needed).  Never cached, never freed, never on the wire."""


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: ``block_size`` tokens per block, its attention kind and, for
    ``"sliding_window"``, the window in tokens.

    Full-prefix kinds (full, MLA and sink-full attention) need every block of a prefix;
    a sliding-window group needs only the blocks covering the window that ends at a
    prefix (vLLM's ``SlidingWindowManager``), and frees the ones before it.
    """

    block_size: int
    kind: str = "full_attention"
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.kind not in SIM_SPEC_KINDS:
            raise ConfigError(
                f"the simulator models {', '.join(sorted(SIM_SPEC_KINDS))} groups, "
                f"not {self.kind!r}"
            )
        if (self.kind == "sliding_window") != (self.sliding_window is not None):
            raise ConfigError("sliding_window is set exactly for kind 'sliding_window'")
        if self.sliding_window is not None and self.sliding_window < 2:
            raise ConfigError(f"sliding_window must be >= 2, got {self.sliding_window}")

    @property
    def is_full(self) -> bool:
        """Whether the group needs every block of a prefix (not a window)."""
        return self.kind != "sliding_window"


def hash_block_size(groups: Sequence[KVCacheGroupSpec]) -> int:
    """vLLM's hash granularity (``hash_block_size``): the block size of a single group, else
    the GCD."""
    if not groups:
        raise ConfigError("at least one KV-cache group is needed")
    return math.gcd(*(g.block_size for g in groups))


def group_block_hashes(raw: Sequence[bytes], block_size: int, unit: int) -> list[bytes]:
    """Group-granularity hashes from raw ``unit``-token hashes (groups with larger blocks):
    block *i* takes the raw hash at index ``(i+1)·k − 1`` with ``k = block_size / unit``."""
    k = block_size // unit
    return [raw[(i + 1) * k - 1] for i in range(len(raw) // k)]


class RequestHasher:
    """Chained vLLM block digests of a growing token sequence, at ``unit`` tokens per hash
    (vLLM's ``get_request_block_hasher``).

    ``extend(tokens)`` hashes every unit that can be hashed now; :attr:`digests` holds them
    all.  Hash-side extra keys come from ``key`` (LoRA, multimodal inputs, cache salt,
    prompt embeddings; :mod:`kvevents.sim.keys`) or, for a fixed value on every unit,
    ``extra_keys``.  With ``lookahead = L > 0`` a unit ``[s, e)`` is hashed only once the
    tokens ``[e, e + L)`` exist, and its extra keys become ``(E, *tokens[e:e + L])``.
    Each ``extend`` call is one call of vLLM's hasher: the first one that starts past token
    0 and every later one walk the multimodal inputs from the last one, as vLLM does.
    """

    def __init__(
        self,
        unit: int,
        *,
        algo: str = "sha256_cbor",
        none: bytes | None = None,
        extra_keys: tuple[Any, ...] | None = None,
        key: SimKey | None = None,
        lookahead: int = 0,
    ) -> None:
        if lookahead < 0:
            raise ConfigError("lookahead must be >= 0")
        self.unit = unit
        self._fn = hash_function(algo)
        self._none = none if none is not None else none_hash(algo)
        self._extra = extra_keys
        self.key = key
        self.lookahead = lookahead
        self.digests: list[bytes] = []

    def _extras(self, start: int, end: int, tokens: Sequence[int], first_mm: int) -> Any:
        key = self.key
        la = self.lookahead
        if key is not None:
            extra = hash_extra_keys(key, start, end + la, first_mm=first_mm)
        else:
            extra = self._extra
        if la:
            return (extra, *tokens[end : end + la])
        return extra

    def extend(self, tokens: Sequence[int]) -> list[bytes]:
        """Hash the units of ``tokens`` hashable now and not hashed yet; returns
        :attr:`digests`."""
        u = self.unit
        done = len(self.digests)
        total = (len(tokens) - self.lookahead) // u
        if total <= done:
            return self.digests
        first_mm = 0
        if done and self.key is not None and self.key.mm_features:
            first_mm = len(self.key.mm_features) - 1
        parent = self.digests[-1] if self.digests else self._none
        for i in range(done, total):
            s, e = i * u, (i + 1) * u
            parent = self._fn((parent, tuple(tokens[s:e]), self._extras(s, e, tokens, first_mm)))
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
        # every (digest, group) a block is cached under, with the prefix length (tokens)
        # each stands for: the full-block hash, or a partial-tail entry (an alias)
        self._keys: list[list[tuple[tuple[bytes, int], int]]] = [[] for _ in range(num_blocks)]
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

    def block_keys(self, block: int) -> list[tuple[bytes, int]]:
        """Every ``(digest, group)`` a block is cached under: its full-block hash and any
        partial-tail entries, in the order they were added."""
        return [k for k, _ in self._keys[block]]

    def block_key(self, block: int) -> tuple[bytes, int] | None:
        """The ``(digest, group)`` a block is cached under, if any."""
        keys = self._keys[block]
        return keys[0][0] if keys else None

    # --- allocation --------------------------------------------------------------------
    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks a request reuses (prefix hit)."""
        for b in blocks:
            if b == NULL_BLOCK:
                continue
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
        if self._keys[b]:
            self.stats.evictions += 1
            self._drop_keys(b)

    def _drop_keys(self, b: int) -> None:
        """Forget every hash block ``b`` is cached under, one ``BlockRemoved`` each."""
        keys, self._keys[b] = self._keys[b], []
        for key, _ in keys:
            holders = self._cached[key]
            del holders[b]
            if not holders:
                del self._cached[key]
            if self.emit_events:
                self._events.append(BlockRemoved([to_wire_hash(key[0])], self.medium, key[1]))
                self.stats.removed_events += 1

    def _insert(self, b: int, key: tuple[bytes, int], num_tokens: int) -> None:
        self._keys[b].append((key, num_tokens))
        self._cached.setdefault(key, {})[b] = None

    def free(self, blocks: Sequence[int]) -> None:
        """Drop a reference on each block, in eviction-priority order: blocks whose
        count reaches 0 join the tail of the free queue in the order given."""
        for b in blocks:
            if b == NULL_BLOCK:
                continue
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
        event_extra_keys: Callable[[int, int], tuple[Any, ...] | None] | None = None,
        lookahead: int = 0,
    ) -> None:
        """Cache ``blocks[num_cached:num_full]`` of one request in one group and emit one
        ``BlockStored`` for them (vLLM's ``BlockPool.cache_full_blocks``).

        ``digests`` are the request's group-granularity digests, ``token_ids`` all its
        tokens.  Null blocks (:data:`NULL_BLOCK`) are skipped: no hash, no entry, but
        their tokens stay in the event's ``token_ids``.  ``event_extra_keys(start, end)``
        gives the event-side extra keys of the block ``[start, end)``; without it every
        entry is ``None``.  ``lookahead`` tokens after each block go to
        ``lookahead_token_ids``.
        """
        if num_full <= num_cached:
            return
        bs = spec.block_size
        hashes: list[int | bytes] = []
        extras: list[tuple[Any, ...] | None] = []
        ahead: list[list[int]] = []
        for i in range(num_cached, num_full):
            b = blocks[i]
            if b == NULL_BLOCK:
                continue
            key = (digests[i], group)
            if self._keys[b]:
                # partial -> full promotion: the block's partial-tail entries go first
                self._drop_keys(b)
            self._insert(b, key, (i + 1) * bs)
            self.stats.blocks_cached += 1
            hashes.append(to_wire_hash(digests[i]))
            extras.append(event_extra_keys(i * bs, (i + 1) * bs) if event_extra_keys else None)
            if lookahead:
                end = (i + 1) * bs
                ahead.append(list(token_ids[end : end + lookahead]))
        if not self.emit_events:
            return
        self._events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=to_wire_hash(digests[num_cached - 1]) if num_cached else None,
                token_ids=list(token_ids[num_cached * bs : num_full * bs]),
                block_size=bs,
                lora_id=lora_id,
                medium=self.medium,
                lora_name=lora_name,
                extra_keys=extras if extras else None,
                group_idx=group,
                kv_cache_spec_kind=spec.kind,
                kv_cache_spec_sliding_window=spec.sliding_window,
                lookahead_token_ids=ahead if lookahead else None,
            )
        )
        self.stats.stored_events += 1

    def cache_partial_block(
        self,
        block: int,
        digest: bytes,
        parent: bytes | None,
        num_tokens: int,
        token_ids: Sequence[int],
        unit: int,
        group: int,
        spec: KVCacheGroupSpec,
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        extra_keys: tuple[Any, ...] | None = None,
    ) -> None:
        """Make ``block`` reachable from the fine-grained prefix boundary ``num_tokens``
        inside it (vLLM's ``BlockPool.cache_partial_block``): cache it under ``digest``
        (the raw hash at that boundary) as well, and emit a one-hash ``BlockStored``
        with ``block_size = unit`` and the last hash unit's tokens.  Entries of the block
        standing for a shorter prefix are dropped first (``BlockRemoved``); an entry it
        already has emits nothing."""
        if block == NULL_BLOCK:
            return
        key = (digest, group)
        keys = self._keys[block]
        if any(k == key for k, _ in keys):
            return
        if keys and max(n for _, n in keys) < num_tokens:
            self._drop_keys(block)
        self._insert(block, key, num_tokens)
        if not self.emit_events:
            return
        self._events.append(
            BlockStored(
                block_hashes=[to_wire_hash(digest)],
                parent_block_hash=to_wire_hash(parent) if parent is not None else None,
                token_ids=list(token_ids),
                block_size=unit,
                lora_id=lora_id,
                medium=self.medium,
                lora_name=lora_name,
                extra_keys=[extra_keys],
                group_idx=group,
                kv_cache_spec_kind=spec.kind,
                kv_cache_spec_sliding_window=spec.sliding_window,
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
        self._keys = [[] for _ in range(self.num_blocks)]
        self._cached.clear()
        self.stats.resets += 1
        if self.emit_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """Detach and return the queued events, in emission order."""
        events, self._events = self._events, []
        return events
