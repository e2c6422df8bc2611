"""BlockIndex: which worker holds which prefix on which tier (DESIGN §4).

The index consumes KV event batches from many engines and answers one question fast:
for a prompt, how many of its leading tokens does each worker hold on GPU, CPU and
STORAGE?  Its heart is the *join*: a CPU/STORAGE placeholder ``BlockStored([H],
block_size=0, token_ids=[], group_idx=g)`` says nothing about size or tokens, so the
index recovers both from the GPU ``BlockStored`` of the same worker, group and hash
(C§5.3, C§6.1, C§8.6).

Model
-----
* A *worker* is ``(source, dp_rank)``.  Per worker and KV-cache group the index keeps
  GPU metadata per engine hash: block size, parent hash, token span, LoRA name, extra
  keys (and, with ``keep_token_ids``, the token ids), plus the block's content key.
* The GPU tier is refcounted per (worker, group, hash); the CPU and STORAGE tiers are
  refcounted per (worker, group, *chunk-tail* hash).  A chunk is the tail block and its
  ``blocks_per_chunk - 1`` parents.  Duplicate stores are normal (C§6.1); a removal of a
  hash the tier never announced is counted and harmless.
* Metadata outlives the GPU block (bounded by ``gpu_metadata_retention``), because the CPU
  store may arrive after the GPU removal (C§2.5).  A placeholder whose GPU store has not
  arrived yet waits in a bounded pending table and joins when it does; one that is pushed
  out, cleared or reset before it joins is counted as unjoined, never guessed.
* Matching is by *content*: every engine block ends at a canonical unit boundary
  (``canonical_block_size`` tokens) whose chained key over tokens, LoRA name and extra
  keys is independent of the engine's hash algorithm and seed
  (:mod:`kvevents.consumers.content`).  A content-key → worker bitset map per tier lets
  the router walk a prompt's keys once for all workers (see
  :mod:`kvevents.consumers.router`).  Marks are counted: two engine blocks of one group
  with the same content key are two references.
* Groups keep their kind and window (``kv_cache_spec_kind``,
  ``kv_cache_spec_sliding_window``) for the router's hybrid lookup, and their block size
  is the largest GPU block size seen: a smaller store is a partial tail, kept but never
  matched.
* Memory is bounded: at most ``max_blocks`` resident (worker, group, hash) entries (see
  :meth:`BlockIndex._evict` for the order: oldest first, leaves before their parents,
  decided by the stream alone), at most ``gpu_metadata_retention`` metadata records no
  tier holds, and at most ``max_pending`` waiting placeholders.  The bookkeeping the
  eviction order needs (resident children per entry, the eviction queue: about 60 bytes
  per resident entry) starts when more than half of ``max_blocks`` is first resident.

Caveat: stores are refcounted as DESIGN §4 asks, so a GPU re-announcement of prefix hits
(``kv_cache_report_mode="full"``, C§4.3) followed by the block's single removal leaves
the block counted until a later removal, ``AllBlocksCleared`` or a reset.

Not thread-safe: feed it from one thread (the subscriber's) and query from the same one,
or guard it with a lock.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Union

from xxhash import xxh3_64_intdigest as xxh

from kvevents.consumers.content import (
    ROOT_KEY,
    EventExtras,
    chain_block,
    chain_units,
    lookahead_key,
    lookahead_mm,
    pack_tokens,
    root_key,
    split_extras,
)
from kvevents.errors import ConfigError
from kvevents.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    PREFIX_INDEXABLE_SPEC_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

__all__ = [
    "TIERS",
    "BlockIndex",
    "BlockInfo",
    "ChunkSpan",
    "IndexStats",
    "TierSummary",
    "WorkerId",
    "WorkerSummary",
]

logger = logging.getLogger(__name__)

WorkerId = tuple[str, int]
"""A worker: ``(source, dp_rank)`` (source is the endpoint or capture name)."""

Hash = Union[int, bytes]

TIERS: tuple[str, str, str] = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
"""Tier names in index order: 0 = GPU, 1 = CPU, 2 = STORAGE."""
# Other spellings of the offload tiers seen on the wire: vLLM 0.26's "FS" / "OBJ" (before
# STORAGE replaced them) and other producers' names for host memory and storage.
_MEDIUM_ALIASES: dict[str | None, int] = {
    "CPU_PINNED": 1,
    "FS": 2,
    "OBJ": 2,
    "DISK": 2,
    "EXTERNAL": 2,
    "REMOTE": 2,
}
_TIER_OF: dict[str | None, int] = {
    None: 0,
    MEDIUM_GPU: 0,
    MEDIUM_CPU: 1,
    MEDIUM_STORAGE: 2,
    **_MEDIUM_ALIASES,
}
_SW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
_LOCAL_KINDS = frozenset({"chunked_local_attention"})
# Kinds vLLM's prefix cache does not consult (encoder outputs, cross attention).
_IGNORED_KINDS = frozenset({"encoder_only_attention", "cross_attention"})
# Kinds whose blocks get content keys: prefix-indexable ones, and the windowed kinds the
# hybrid lookup judges from their own blocks.
_KEYED_KINDS = PREFIX_INDEXABLE_SPEC_KINDS | _SW_KINDS | _LOCAL_KINDS
_PLACEHOLDER_TIER: dict[str | None, int] = {MEDIUM_CPU: 1, MEDIUM_STORAGE: 2, **_MEDIUM_ALIASES}
_NO_PENDING: dict[Any, list[int]] = {}  # the pending table seen by a worker without entries

# A metadata record is, for memory, usually one packed int (about 52 bytes):
#   bits 0-63 content key (unsigned), bit 64 "has a content key",
#   bits 65-84 end position in blocks + 1 (0: unknown), bits 85-104 block size,
#   bits 105-169 parent hash + 1 (0: none), bits 170+ the GPU refcount.
# Records with a LoRA name, extra keys, token ids, a bytes or negative parent, or fields
# out of range are a tuple (ck, end_blocks, parent, size, lora, extra, tokens, gpu refs),
# plus a ninth field, the chain key children build on, when it differs from ck (the mark
# key of a block hashed with lookahead tokens).
# Keeping the GPU refcount in the record saves a dict slot per GPU block.
_CK, _END, _PARENT, _SIZE, _LORA, _EXTRA, _TOKENS, _GPU, _CHAIN = range(9)
_Meta = Union[int, tuple[Any, ...]]
_M64 = (1 << 64) - 1
_M20 = (1 << 20) - 1
_HAS_CK = 1 << 64
_OFF = 0  # content keys are unsigned 64-bit (kept as a name: the field's offset)
_M65 = (1 << 65) - 1
_GSHIFT = 170
_G1 = 1 << _GSHIFT
_G2 = 2 << _GSHIFT


def _pack(
    ck: int | None,
    end_blocks: int | None,
    parent: Hash | None,
    size: int,
    lora: str | None = None,
    extra: Any = None,
    tokens: tuple[int, ...] | None = None,
    chain: int | None = None,
) -> _Meta:
    if chain is not None and chain != ck:
        return (ck, end_blocks, parent, size, lora, extra, tokens, 0, chain)
    if (
        lora is None
        and extra is None
        and tokens is None
        and (parent is None or (type(parent) is int and 0 <= parent <= _M64))
        and (end_blocks is None or end_blocks < _M20)
        and 0 < size <= _M20
    ):
        v = size << 85
        if ck is not None:
            v |= (ck + _OFF) | _HAS_CK
        if end_blocks is not None:
            v |= (end_blocks + 1) << 65
        if parent is not None:
            v |= (parent + 1) << 105
        return v
    return (ck, end_blocks, parent, size, lora, extra, tokens, 0)


def _gpu(m: _Meta) -> int:
    """The record's GPU refcount."""
    if isinstance(m, int):
        return m >> _GSHIFT
    count: int = m[_GPU]
    return count


def _add_gpu(m: _Meta, delta: int) -> _Meta:
    """The record with its GPU refcount changed by ``delta``."""
    if isinstance(m, int):
        return m + delta * _G1
    return (*m[:_GPU], m[_GPU] + delta, *m[_CHAIN:])


def _ck(m: _Meta) -> int | None:
    if isinstance(m, int):
        return (m & _M64) - _OFF if m & _HAS_CK else None
    ck: int | None = m[_CK]
    return ck


def _chain(m: _Meta) -> int | None:
    """The key children of this block chain on (its content key unless it has lookahead)."""
    if isinstance(m, int):
        return (m & _M64) - _OFF if m & _HAS_CK else None
    ck: int | None = m[_CHAIN] if len(m) > _CHAIN else m[_CK]
    return ck


def _unkeyed(m: _Meta) -> _Meta:
    """The record without its content key (a partial tail is never matched)."""
    if isinstance(m, int):
        return m & ~(_M64 | _HAS_CK)
    return (None, *m[1:_CHAIN])


def _size(m: _Meta) -> int:
    if isinstance(m, int):
        return (m >> 85) & _M20
    size: int = m[_SIZE]
    return size


def _end_tokens(m: _Meta) -> int | None:
    if isinstance(m, int):
        e = (m >> 65) & _M20
        return (e - 1) * ((m >> 85) & _M20) if e else None
    end: int | None = m[_END]
    return None if end is None else end * int(m[_SIZE])


def _parent(m: _Meta) -> Hash | None:
    if isinstance(m, int):
        p = (m >> 105) & _M65
        return p - 1 if p else None
    parent: Hash | None = m[_PARENT]
    return parent


def _field(m: _Meta, i: int) -> Any:
    return None if isinstance(m, int) else m[i]


@dataclass
class IndexStats:
    """Counters of a :class:`BlockIndex` (ints, or Counters by reason/tier label)."""

    batches: int = 0
    applied: int = 0
    """Events applied (every event of every batch, whatever its outcome)."""
    block_events: int = 0
    """Block hashes processed by stores and removals (the throughput unit)."""
    stored: Counter[str] = field(default_factory=Counter)
    """Stored blocks (GPU) or chunks (CPU/STORAGE), by tier."""
    removed: Counter[str] = field(default_factory=Counter)
    """Removed blocks or chunks, by tier."""
    joined: int = 0
    """Placeholder chunks that found their GPU metadata (immediately or later)."""
    joined_late: int = 0
    """Of ``joined``: those that waited in the pending table first."""
    pending: int = 0
    """Placeholder chunks that had to wait for their GPU store."""
    self_describing: int = 0
    """CPU/STORAGE chunks indexed directly from a self-describing store."""
    unjoined: Counter[str] = field(default_factory=Counter)
    """Placeholder chunks never joined, by reason."""
    skipped: Counter[str] = field(default_factory=Counter)
    """Blocks or events kept out of prefix matching (or ignored), by reason."""
    unknown_removals: Counter[str] = field(default_factory=Counter)
    """Removals of hashes the tier did not hold, by tier."""
    cleared: int = 0
    """AllBlocksCleared events applied."""
    resets: int = 0
    """reset_worker / remove_worker calls."""
    evicted_by_cap: int = 0
    """Resident entries dropped because ``max_blocks`` was reached."""
    metadata_evicted: int = 0
    """Retained GPU metadata dropped because ``gpu_metadata_retention`` was reached."""


@dataclass(frozen=True)
class ChunkSpan:
    """The chunk a CPU/STORAGE tail hash stands for (C§5.3)."""

    hashes: tuple[Hash, ...]
    """Engine hashes of the chunk's blocks, oldest first, as far as metadata reaches."""
    start: int | None
    """First token position of the chunk (``None`` if the position is unknown)."""
    end: int | None
    """One past the last token position."""
    blocks_per_chunk: int
    tokens: int
    """``blocks_per_chunk × block_size``."""


@dataclass(frozen=True)
class BlockInfo:
    """What the index knows about one (worker, group, hash)."""

    group: int
    block_size: int
    """Tokens in this engine block."""
    start: int | None
    """Token position where the block starts (``None`` if its prefix was never seen)."""
    end: int | None
    parent: Hash | None
    lora_name: str | None
    extra_keys: Any
    kind: str | None
    """The group's ``kv_cache_spec_kind`` (``None`` if never announced)."""
    tiers: frozenset[str]
    """Tiers holding this hash (CPU/STORAGE: as a chunk tail)."""
    indexed: bool
    """Whether the block takes part in prefix matching."""
    token_ids: tuple[int, ...] | None = None
    """The block's tokens (only with ``keep_token_ids=True``)."""
    chunk: ChunkSpan | None = None
    """For a CPU/STORAGE chunk tail: the chunk it stands for."""

    @property
    def num_tokens(self) -> int:
        """Tokens of this block (its block size)."""
        return self.block_size


@dataclass(frozen=True)
class TierSummary:
    """Blocks (GPU) or chunks (CPU/STORAGE) a worker holds on one tier, and their tokens."""

    entries: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class WorkerSummary:
    """Per-tier holdings of one worker (for ``kvevents replay --into-index``)."""

    worker: WorkerId
    groups: int
    blocks_per_chunk: int | None
    tiers: dict[str, TierSummary]
    retained_metadata: int
    """Metadata records kept for joins, resident or not."""


class _Group:
    """Per (worker, group) state."""

    __slots__ = (
        "bit",
        "block_size",
        "deferred",
        "group",
        "indexable_kind",
        "kids",
        "kind",
        "meta",
        "refs",
        "slot",
        "window",
    )

    def __init__(self, group: int, slot: int) -> None:
        self.group = group
        self.slot = slot
        self.bit = 1 << slot
        self.block_size = 0  # the largest GPU block size seen (smaller: partial tails)
        self.kind: str | None = None
        self.window: int | None = None  # kv_cache_spec_sliding_window
        # kind None, prefix-indexable, sliding window or chunked local: compute content keys
        self.indexable_kind = True
        self.meta: dict[Hash, _Meta] = {}
        # CPU and STORAGE refcounts per chunk-tail hash; index 0 stays empty (the GPU
        # refcount lives in the metadata record).
        self.refs: tuple[dict[Hash, int], dict[Hash, int], dict[Hash, int]] = ({}, {}, {})
        # For the memory cap: how many resident entries of this group name each hash as
        # their parent (absent: none), and the resident entries the eviction queue passed
        # over because they had resident children (evicted once they have none).
        self.kids: dict[Hash, int] = {}
        self.deferred: dict[Hash, None] = {}


class _Worker:
    __slots__ = ("bpc", "bpc_fixed", "eagle", "groups", "la_fixed", "lookahead", "wid")

    def __init__(
        self, wid: WorkerId, bpc: int, lookahead: int | None = None, eagle: bool = False
    ) -> None:
        self.wid = wid
        self.groups: dict[int, _Group] = {}
        self.bpc = bpc  # 0 = unknown
        self.bpc_fixed = bpc > 0
        self.lookahead = lookahead or 0  # speculative lookahead tokens per block hash
        self.la_fixed = lookahead is not None
        self.eagle = eagle  # EAGLE's drop of the last matched block


@dataclass(frozen=True)
class _SpecGroup:
    """Groups a worker's hybrid lookup judges together (vLLM's SpecGroup: one spec)."""

    cls: str
    """``"full"``, ``"sw"`` (sliding window) or ``"local"`` (chunked local attention)."""
    block_size: int
    window: int
    """Sliding window or attention chunk size in tokens (0 for full attention)."""
    bits: int
    """Slot bits of the member groups: a block is held when every member holds it."""
    slots: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Plan:
    """How vLLM would look a request up on one worker (see :mod:`kvevents.consumers.router`)."""

    wid: WorkerId
    blocked: str | None
    """Why the worker is never credited (a group kind vLLM's lookup is not modelled for,
    an unknown window or block size), or None."""
    unitary: bool
    """One KV-cache group in all (vLLM's UnitaryKVCacheCoordinator)."""
    spec_groups: tuple[_SpecGroup, ...]
    """In vLLM's GPU lookup order: full attention first."""
    align: int
    """Tokens a GPU hit is aligned to: the block size, or the lcm of the groups' sizes."""
    chunk_groups: tuple[tuple[str, int, int, int], ...]
    """Per offloaded group in the offload lookup order (full attention first):
    ``(cls, block size, window in chunks (0 for full), slot bit)``."""
    windowed: bool
    """Some group is windowed (sliding window or chunked local): the CPU bound starts one
    token short of the request."""
    bpc: int
    """Blocks per chunk (0: unknown, no CPU/STORAGE credit)."""
    lookahead: int
    """Speculative lookahead tokens hashed with each block (0: none)."""
    eagle: bool
    """EAGLE's drop of the last matched block."""


@dataclass
class _Layout:
    """What the router's walk needs about slots, rebuilt when slots change.

    The bitset walks serve *simple* workers: one full-attention group, no speculative
    mode.  Every other worker is looked up on its own, from its :class:`_Plan`.
    """

    canonical: int
    gpu_classes: list[tuple[int, int]]
    """(units per engine block, slot mask) for the slots of simple workers."""
    chunk_classes: list[tuple[int, int]]
    """(units per chunk, slot mask) for those slots whose worker's blocks_per_chunk is known."""
    gpu_mask: int
    chunk_mask: int
    slot_worker: dict[int, WorkerId]
    nslots: int = 0
    """One more than the highest simple slot."""
    pos_wids: list[WorkerId | None] = field(default_factory=list)
    """Indexed by ``slot + 1`` (a slot bit's ``bit_length()``): the simple slot's worker;
    ``nslots + 1`` entries."""
    pos_bits: list[int] = field(default_factory=list)
    """Indexed by ``slot + 1``: ``1 << slot`` (entry 0 is 0)."""
    simple_mask: int = 0
    """Slots of simple workers."""
    plans: dict[WorkerId, _Plan] = field(default_factory=dict)
    """Every worker's lookup plan."""
    complex_workers: tuple[WorkerId, ...] = ()
    """Workers the bitset walks do not serve (hybrid, windowed, speculative)."""
    complex_full_classes: list[tuple[int, int]] = field(default_factory=list)
    """(units per block, slot mask) of those workers' full-attention slots (without
    lookahead), whose prefix runs one walk finds for all of them."""
    complex_full_mask: int = 0


def _per_worker(config: Any, wid: WorkerId) -> Any:
    """A per-worker setting: one value for all, or a mapping by WorkerId, source or "*"."""
    if not isinstance(config, Mapping):
        return config
    for key in (wid, wid[0], "*"):
        if key in config:
            return config[key]
    return None


def _bpc_lookup(config: int | Mapping[Any, int] | None, wid: WorkerId) -> int:
    if config is None:
        return 0
    if isinstance(config, int):
        return config
    for key in (wid, wid[0]):
        if key in config:
            return int(config[key])
    return int(config.get("*", 0))


class BlockIndex:
    """Joins GPU, CPU and STORAGE KV events per worker into a content-keyed prefix index.

    Parameters
    ----------
    blocks_per_chunk:
        GPU blocks per CPU chunk (C§5.2).  An int for every engine, a mapping keyed by
        :data:`WorkerId` or by source (``"*"`` for the rest), or ``None`` to learn it per
        worker as the gcd of the block counts at which chunk tails fall.  A learned value
        is an upper bound that converges down as tails arrive; configure it when known.
    canonical_block_size:
        Tokens per content-key unit.  Engine block sizes must be multiples of it for their
        blocks to take part in matching (others are joined but skipped, counted).
    max_blocks:
        Cap on resident (worker, group, hash) entries: ``len(index)`` never exceeds it
        after an event is applied.  Beyond it entries are evicted oldest first, leaves
        before their parents (see :meth:`_evict`), and counted.
    gpu_metadata_retention:
        How many non-resident metadata records (GPU removed, CPU not (yet) stored, the
        inner blocks of a self-describing chunk) are kept for late CPU stores and as
        parents of later stores; the oldest beyond it are dropped and counted.
    max_pending:
        Cap on placeholder chunks waiting for their GPU store.
    keep_token_ids:
        Keep each block's token ids so :meth:`block_info` can return them.
    lookahead_tokens:
        Speculative decoding's lookahead hashing (vLLM's ``num_hash_lookahead_tokens``):
        each block hash also covers the next this-many tokens, and a prompt's last block
        is never hashed.  An int for every engine, a mapping keyed like
        ``blocks_per_chunk``, or ``None`` to learn it per worker from the
        ``lookahead_token_ids`` its events carry.
    eagle_drop:
        Speculative decoding without lookahead hashing: vLLM drops the last matched
        block of a hit (EAGLE needs its hidden states).  A bool for every engine or a
        mapping keyed like ``blocks_per_chunk``; the wire does not say it.
    """

    def __init__(
        self,
        *,
        blocks_per_chunk: int | Mapping[Any, int] | None = None,
        canonical_block_size: int = 16,
        max_blocks: int = 4_000_000,
        gpu_metadata_retention: int = 200_000,
        max_pending: int = 100_000,
        keep_token_ids: bool = False,
        lookahead_tokens: int | Mapping[Any, int] | None = None,
        eagle_drop: bool | Mapping[Any, bool] = False,
    ) -> None:
        if canonical_block_size <= 0:
            raise ConfigError("canonical_block_size must be positive")
        if max_blocks <= 0 or gpu_metadata_retention < 0 or max_pending < 0:
            raise ConfigError("max_blocks must be positive; retention and pending >= 0")
        if isinstance(blocks_per_chunk, int) and blocks_per_chunk <= 0:
            raise ConfigError("blocks_per_chunk must be positive")
        self.canonical_block_size = canonical_block_size
        self.max_blocks = max_blocks
        self.gpu_metadata_retention = gpu_metadata_retention
        self.max_pending = max_pending
        self.keep_token_ids = keep_token_ids
        self._bpc_config = blocks_per_chunk
        self._lookahead_config = lookahead_tokens
        self._eagle_config = eagle_drop
        self.stats = IndexStats()
        self._workers: dict[WorkerId, _Worker] = {}
        self._marks: tuple[_Marks, _Marks, _Marks] = (_Marks(), _Marks(), _Marks())
        self._slots: dict[int, tuple[_Worker, _Group]] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._pending: OrderedDict[tuple[WorkerId, int, Hash], list[int]] = OrderedDict()
        self._retired: OrderedDict[tuple[WorkerId, int, Hash], None] = OrderedDict()
        self._resident = 0
        self._layout: _Layout | None = None
        # placeholder entries waiting, per worker (a worker without any skips the table)
        self._npending: dict[WorkerId, int] = {}
        # The eviction queue: (group, hash) of each entry in the order it became resident
        # (a GPU store's blocks leaf first), as two parallel lists read from _qhead; stale
        # items are skipped when reached.  _ready: deferred entries whose last resident
        # child went away (evicted before the queue).
        self._qgroups: list[_Group] = []
        self._qhashes: list[Hash] = []
        self._qhead = 0
        self._qlimit = 1 << 16
        self._ready: deque[tuple[_Group, Hash]] = deque()
        self._storing = False  # a GPU store is being applied (its blocks are not queued yet)
        # The eviction bookkeeping (children counts, queue) starts once more than half the
        # cap is resident (_watch_hit), so an index far from its cap pays nothing for it.
        self._tracking = False
        self._watch = max_blocks // 2
        self._stale: set[WorkerId] = set()

    def set_stale(self, worker: WorkerId, stale: bool = True) -> None:
        """Mark ``worker`` stale (its stream and replay endpoint went silent: the router
        leaves it out) or live again.  What it holds is kept."""
        (self._stale.add if stale else self._stale.discard)(worker)

    @property
    def stale_workers(self) -> frozenset[WorkerId]:
        """The workers marked stale by :meth:`set_stale`."""
        return frozenset(self._stale)

    # ------------------------------------------------------------------ feeding

    def apply(self, source: str, dp_rank: int, batch: KVEventBatch) -> None:
        """Apply every event of ``batch`` from worker ``(source, dp_rank)`` in order."""
        stats = self.stats
        stats.batches += 1
        w = self._workers.get((source, dp_rank))
        if w is None:
            w = self._worker((source, dp_rank))
        # The dominant shape, a GPU BlockRemoved of one hash whose record is a packed int
        # (vLLM sends one event per freed block), is applied inline: the same steps as
        # _apply -> _remove, without the calls.  Everything else goes through _apply.
        groups = w.groups
        wid = w.wid
        gpu_marks = self._marks[0]
        retired = self._retired
        retention = self.gpu_metadata_retention
        applied = 0
        block_events = 0
        gpu_removed = 0  # not yet added to stats.removed["GPU"]
        try:
            for ev in batch.events:
                if type(ev) is BlockRemoved:
                    hashes = ev.block_hashes
                    medium = ev.medium
                    if medium == "CPU" or medium == "STORAGE":
                        if ev.group_idx is not None:  # (not a legacy removal)
                            if gpu_removed:
                                stats.removed[MEDIUM_GPU] += gpu_removed
                                gpu_removed = 0
                            applied += 1
                            block_events += len(hashes)
                            self._remove(w, ev.group_idx, hashes, _TIER_OF[medium])
                            continue
                    elif len(hashes) == 1 and (medium == "GPU" or medium is None):
                        group = ev.group_idx or 0
                        gs = groups.get(group)
                        if gs is not None:
                            h = hashes[0]
                            meta = gs.meta
                            m = meta.get(h)
                            if type(m) is int and m >= _G1:
                                applied += 1
                                block_events += 1
                                gpu_removed += 1
                                meta[h] = m - _G1
                                if m >= _G2:
                                    continue  # still held by another store
                                if m & _HAS_CK:
                                    ck = (m & _M64) - _OFF
                                    v = gpu_marks.get(ck)
                                    if gpu_marks.dups and _undup(gpu_marks, ck, gs.bit):
                                        pass  # another engine block of this slot has it
                                    elif v is not None:
                                        if v == gs.bit:  # the only holder
                                            del gpu_marks[ck]
                                        else:
                                            v &= ~gs.bit
                                            if v:
                                                gpu_marks[ck] = v
                                            else:
                                                del gpu_marks[ck]
                                r = gs.refs
                                if h in r[1] or h in r[2]:
                                    continue
                                self._resident -= 1
                                if gs.deferred:
                                    gs.deferred.pop(h, None)
                                p = (m >> 105) & _M65
                                if p and gs.kids:  # its parent has one resident child fewer
                                    kids = gs.kids
                                    p -= 1
                                    c = kids.get(p)
                                    if c is not None:
                                        if c > 1:
                                            kids[p] = c - 1
                                        else:
                                            del kids[p]
                                            if p in gs.deferred:
                                                self._ready.append((gs, p))
                                retired[(wid, group, h)] = None
                                if len(retired) > retention:
                                    self._trim_retired()
                                continue
                elif type(ev) is BlockStored and ev.medium == "GPU":
                    if gpu_removed:
                        stats.removed[MEDIUM_GPU] += gpu_removed
                        gpu_removed = 0
                    applied += 1
                    block_events += len(ev.block_hashes)
                    self._store_described(w, ev, 0)
                    continue
                elif type(ev) is BlockStored and w.bpc_fixed:
                    # a one-hash CPU/STORAGE placeholder whose GPU record is here: the
                    # join of _store_placeholder and _ref, inline
                    hashes = ev.block_hashes
                    tier = _PLACEHOLDER_TIER.get(ev.medium, 0)
                    if (
                        tier
                        and len(hashes) == 1
                        and not (ev.block_size > 0 and ev.token_ids)
                        and type(hashes[0]) is int
                    ):
                        group = ev.group_idx or 0
                        gs = groups.get(group)
                        if gs is not None and (
                            ev.kv_cache_spec_kind is None or gs.kind is not None
                        ):
                            h = hashes[0]
                            m = gs.meta.get(h)
                            if type(m) is int:
                                if gpu_removed:
                                    stats.removed[MEDIUM_GPU] += gpu_removed
                                    gpu_removed = 0
                                applied += 1
                                block_events += 1
                                stats.stored[TIERS[tier]] += 1
                                stats.joined += 1
                                r = gs.refs
                                refs = r[tier]
                                c = refs.get(h, 0)
                                refs[h] = c + 1
                                if c:
                                    continue
                                if m & _HAS_CK:
                                    marks = self._marks[tier]
                                    ck = (m & _M64) - _OFF
                                    v = marks.get(ck)
                                    if v is None:
                                        marks[ck] = gs.bit
                                    elif v & gs.bit:
                                        _dup(marks, ck, gs.bit)
                                    else:
                                        marks[ck] = v | gs.bit
                                if m >= _G1 or h in r[3 - tier]:
                                    continue
                                self._resident += 1
                                if retired:
                                    retired.pop((wid, group, h), None)
                                if self._tracking:
                                    self._enter(gs, h, m)
                                if self._resident > self._watch:
                                    self._watch_hit()
                                continue
                if gpu_removed:
                    stats.removed[MEDIUM_GPU] += gpu_removed
                    gpu_removed = 0
                self._apply(w, ev)
        finally:
            if gpu_removed:
                stats.removed[MEDIUM_GPU] += gpu_removed
            stats.applied += applied
            stats.block_events += block_events

    def apply_event(self, worker: WorkerId, event: KVEvent) -> None:
        """Apply one event from ``worker``."""
        w = self._workers.get(worker)
        if w is None:
            w = self._worker(worker)
        self._apply(w, event)

    def _apply(self, w: _Worker, ev: KVEvent) -> None:
        stats = self.stats
        stats.applied += 1
        if type(ev) is BlockStored:
            tier = _TIER_OF.get(ev.medium, -1)
            n = len(ev.block_hashes)
            stats.block_events += n
            if tier == 0:
                self._store_described(w, ev, 0)
            elif tier < 0:
                stats.skipped["unknown_medium"] += n
            elif ev.block_size > 0 and ev.token_ids:
                self._store_self_describing(w, ev, tier)
            elif ev.group_idx is None and any(isinstance(h, bytes) for h in ev.block_hashes):
                self._legacy_store(w, ev, tier)
            else:
                self._store_placeholder(w, ev, tier)
        elif type(ev) is BlockRemoved:
            tier = _TIER_OF.get(ev.medium, -1)
            stats.block_events += len(ev.block_hashes)
            if tier < 0:
                stats.skipped["unknown_medium"] += len(ev.block_hashes)
            elif (
                tier > 0
                and ev.group_idx is None
                and any(isinstance(h, bytes) for h in ev.block_hashes)
            ):
                self._legacy_remove(w, ev.block_hashes, tier)
            else:
                self._remove(w, ev.group_idx or 0, ev.block_hashes, tier)
        elif type(ev) is AllBlocksCleared:
            stats.cleared += 1
            self._clear_tiers(w, keep_metadata=True)
        else:  # pragma: no cover - the decoder yields only the three classes
            stats.skipped["unknown_event"] += 1

    # ------------------------------------------------------------------ workers

    def _worker(self, wid: WorkerId) -> _Worker:
        w = _Worker(
            wid,
            _bpc_lookup(self._bpc_config, wid),
            _per_worker(self._lookahead_config, wid),
            bool(_per_worker(self._eagle_config, wid)),
        )
        self._workers[wid] = w
        return w

    def _group(self, w: _Worker, group: int) -> _Group:
        gs = w.groups.get(group)
        if gs is None:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot = self._next_slot
                self._next_slot += 1
            gs = _Group(group, slot)
            w.groups[group] = gs
            self._slots[slot] = (w, gs)
            self._layout = None
        return gs

    def workers(self) -> list[WorkerId]:
        """Every worker the index has seen (and not removed), sorted."""
        return sorted(self._workers)

    def num_workers(self) -> int:
        """How many workers :meth:`workers` would list."""
        return len(self._workers)

    def snapshot(self) -> bytes:
        """This index's whole state as bytes (versioned msgpack): :meth:`restore` gives
        an index that answers and applies exactly as this one would from here on."""
        from kvevents.consumers.snapshot import snapshot_index

        return snapshot_index(self)

    @classmethod
    def restore(cls, data: bytes) -> BlockIndex:
        """An index from :meth:`snapshot` bytes; :class:`ConfigError` if they are not a
        snapshot this kvevents can read."""
        from kvevents.consumers.snapshot import restore_index

        index = restore_index(data)
        if not isinstance(index, cls):
            raise ConfigError(f"the snapshot holds a {type(index).__name__}, not a BlockIndex")
        index._layout = None  # derived from the rest; rebuilt by the next query
        return index

    def reset_worker(self, worker: WorkerId) -> None:
        """Forget everything a worker holds, metadata included (publisher restart, loss)."""
        w = self._workers.get(worker)
        if w is None:
            return
        self.stats.resets += 1
        self._clear_tiers(w, keep_metadata=False)

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget a worker entirely and free its slots."""
        w = self._workers.get(worker)
        if w is None:
            return
        self.stats.resets += 1
        self._clear_tiers(w, keep_metadata=False)
        for gs in w.groups.values():
            del self._slots[gs.slot]
            heapq.heappush(self._free_slots, gs.slot)
        del self._workers[worker]
        self._layout = None

    def _clear_tiers(self, w: _Worker, *, keep_metadata: bool) -> None:
        wid = w.wid
        for gs in w.groups.values():
            bit = gs.bit
            meta = gs.meta
            gpu_marks = self._marks[0]
            held: set[Hash] = set()
            for h, m in meta.items():
                if _gpu(m):
                    held.add(h)
                    ck = _ck(m)
                    if ck is not None:
                        _unmark(gpu_marks, ck, bit)
            for h in held:
                meta[h] = _add_gpu(meta[h], -_gpu(meta[h]))
            for tier in (1, 2):
                refs = gs.refs[tier]
                marks = self._marks[tier]
                for h in refs:
                    tm = gs.meta.get(h)
                    ck = _ck(tm) if tm is not None else None
                    if ck is not None:
                        _unmark(marks, ck, bit)
                held.update(refs)
                refs.clear()
            self._resident -= len(held)
            gs.kids.clear()  # nothing of the group is resident any more
            gs.deferred.clear()
            if keep_metadata:
                for h in held:
                    if h in gs.meta:
                        self._retire(wid, gs, h)
            else:
                for h in gs.meta:
                    self._retired.pop((wid, gs.group, h), None)
                gs.meta.clear()
        if self._npending.pop(wid, 0):
            dropped = [k for k in self._pending if k[0] == wid]
            for k in dropped:
                counts = self._pending.pop(k)
                self.stats.unjoined["cleared_while_pending"] += counts[1] + counts[2]

    # ------------------------------------------------------------------ stores

    def _store_described(self, w: _Worker, ev: BlockStored, tier: int) -> None:
        """A store that carries sizes and tokens (every GPU store, self-describing CPU)."""
        stats = self.stats
        hashes = ev.block_hashes
        n = len(hashes)
        gs = w.groups.get(ev.group_idx or 0)
        if gs is None:
            gs = self._group(w, ev.group_idx or 0)
        size = ev.block_size
        kind = ev.kv_cache_spec_kind
        if kind is not None and kind != gs.kind:
            self._set_kind(w, gs, kind)
        if size <= 0:
            stats.skipped["bad_block_size"] += n
            return
        partial = False
        if tier == 0 and size != gs.block_size:
            if size > gs.block_size:
                if gs.block_size:
                    self._unkey_partials(gs, size)
                gs.block_size = size
                self._layout = None
            else:
                # a store at hash granularity into a coarser group: vLLM's partial tail
                # (cache_partial_block), only looked up in Mamba "align" mode; it keeps
                # its metadata (for its removal) but is never matched
                partial = True
                stats.skipped["partial_tail"] += n
        window = ev.kv_cache_spec_sliding_window
        if tier == 0 and window is not None and window != gs.window:
            gs.window = window
            self._layout = None
        la = ev.lookahead_token_ids
        if la and tier == 0 and not w.la_fixed and la[0] and len(la[0]) != w.lookahead:
            w.lookahead = len(la[0])
            self._layout = None
        if tier >= 0:
            stats.stored[TIERS[tier]] += n
        toks = ev.token_ids
        need = n * size
        off = len(toks) - need
        if off < 0:
            stats.skipped["short_token_ids"] += n
            return
        unit = self.canonical_block_size
        index_keys = gs.indexable_kind and not partial
        if index_keys and size % unit:
            stats.skipped["block_size_not_multiple_of_canonical"] += n
            index_keys = False
        lora = ev.lora_name
        extras = ev.extra_keys
        parent = ev.parent_block_hash
        meta = gs.meta
        pk: int | None
        pend: int | None
        if parent is None:
            if extras and extras[0] is not None:
                ex0 = split_extras(extras[0], lora, True)
                pk = root_key(lora, ex0.salt if ex0 is not None else None)
            else:
                pk = ROOT_KEY if lora is None else root_key(lora)
            pend = 0
        else:
            pm = meta.get(parent)
            if pm is None:
                pk = pend = None
            elif type(pm) is int:  # _ck and _end_tokens of a packed record, inline
                pk = (pm & _M64) - _OFF if pm & _HAS_CK else None
                e = (pm >> 65) & _M20
                pend = (e - 1) * ((pm >> 85) & _M20) if e else None
            else:
                pk, pend = _chain(pm), _end_tokens(pm)
        if off and index_keys:
            # leading blocks the engine did not hash (null blocks outside a window):
            # chain over their tokens so the hashed blocks' keys stay positional
            if pk is not None:
                try:
                    pk = chain_units(pk, toks[:off], unit) if off % unit == 0 else None
                except ConfigError:
                    pk = None
            if pend is not None:
                pend += off
        pending = self._pending if w.wid in self._npending else _NO_PENDING
        self._storing = tier == 0  # (until _queue_store: see _evict)
        first = 0
        if (
            tier == 0
            and index_keys
            and lora is None
            and extras is None
            and not la
            and not off
            and not self.keep_token_ids
            and not pending
            and size <= _M20
            and (parent is None or (type(parent) is int and 0 <= parent <= _M64))
            and (pend is None or pend // size + n < _M20)
        ):
            # Fast path for the usual GPU store: new records packed inline (the fields
            # of _pack added up) and refcounted as _ref would (a hash with no record has
            # no residency and no retirement entry: both always go with a record).  It
            # stops at the first block that needs the general path below.
            q = size // unit
            # the blocks' canonical units as slices of the packed tokens, in order
            tbuf: memoryview | None
            try:
                tbuf = memoryview(pack_tokens(toks[off:] if off else toks))
            except ConfigError:
                tbuf = None  # ids no key can be made of: the general path counts them
            width = 8 * unit
            ta = 0
            marks = self._marks[0]
            r1, r2 = gs.refs[1], gs.refs[2]
            bit = gs.bit
            fixed = (size << 85) + _G1  # block size and a GPU refcount of 1
            keyed = fixed + _HAS_CK + _OFF  # plus the key flag and offset
            step = 1 << 65
            end_field = ((pend // size + 1) << 65) if pend is not None else 0
            parent_field = ((parent + 1) << 105) if parent is not None else 0
            resident = self._resident
            watch = self._watch
            tracking = self._tracking
            setdefault = meta.setdefault
            kids = gs.kids
            kids_get = kids.get
            try:
                for h in hashes if tbuf is not None else ():
                    if type(h) is not int or not 0 <= h <= _M64:
                        break
                    if pk is not None:
                        if q == 1:
                            k = xxh(tbuf[ta : ta + width], pk)  # type: ignore[index]
                            ta += width
                        else:
                            k = pk
                            for _ in range(q):
                                k = xxh(tbuf[ta : ta + width], k)  # type: ignore[index]
                                ta += width
                        v = keyed + k
                    else:
                        ta += q * width
                        k = None
                        v = fixed
                    if end_field:
                        v += end_field + step
                    v += parent_field
                    # insert only if new (a fresh int is never the stored object)
                    if setdefault(h, v) is not v:
                        break  # the hash has a record: the general path takes over
                    if end_field:
                        end_field += step
                    if k is not None:
                        mv = marks.get(k)
                        if mv is None:
                            marks[k] = bit
                        elif mv & bit:
                            _dup(marks, k, bit)
                        else:
                            marks[k] = mv | bit
                    else:
                        stats.skipped["unknown_parent"] += 1
                    if h not in r1 and h not in r2:
                        resident += 1
                        if tracking and parent is not None:
                            kids[parent] = kids_get(parent, 0) + 1
                        if resident > watch:
                            self._resident = resident
                            self._watch_hit()
                            resident = self._resident
                            watch = self._watch
                            tracking = True
                    pk = k
                    parent_field = (h + 1) << 105
                    parent = h
                    first += 1
            finally:
                self._resident = resident
            if first == n:
                self._queue_store(gs, hashes)
                return  # (index_keys held: nothing to count as skipped)
            if first:
                pend = None if pend is None else pend + first * size
        t = tuple(toks) if index_keys or self.keep_token_ids else ()
        for i in range(first, n):
            h = hashes[i]
            m = meta.get(h)
            ck = _ck(m) if m is not None else None
            if m is None or (ck is None and pk is not None and index_keys):
                end = pend + size if pend is not None else None
                base = off + i * size
                chain = None
                if index_keys and pk is not None:
                    ex: EventExtras | None = None
                    if extras is not None and i < len(extras) and extras[i] is not None:
                        ex = split_extras(extras[i], lora, i == 0 and ev.parent_block_hash is None)
                    try:
                        chain = ck = chain_block(pk, t[base : base + size], unit, ex)
                        if la and i < len(la) and la[i]:
                            ck = lookahead_key(chain, la[i], lookahead_mm(ex, size))
                    except ConfigError:
                        chain = ck = None  # token ids outside int64: no content key
                        stats.skipped["bad_token_ids"] += 1
                elif index_keys:
                    stats.skipped["unknown_parent"] += 1
                m = _pack(
                    ck,
                    end // size if end is not None else None,
                    parent,
                    size,
                    lora,
                    extras[i] if extras is not None and i < len(extras) else None,
                    t[base : base + size] if self.keep_token_ids else None,
                    chain,
                )
                if h in meta:  # an orphan healed: keep its refcount, re-key its residencies
                    m = _add_gpu(m, _gpu(meta[h]))
                    self._rekey(gs, h, meta[h], m)
                meta[h] = m
                if pending:
                    p = pending.pop((w.wid, gs.group, h), None)
                    if p is not None:
                        self._join_pending(w, gs, h, m, p)
                pk, pend = (chain if chain is not None else ck), end
            else:
                if tier == 0:
                    # LRU touch: move to the end of the group's insertion order
                    del meta[h]
                    meta[h] = m
                pk, pend = _chain(m), _end_tokens(m)
            parent = h
            self._ref(w, gs, tier, h, ck)
        if tier == 0:
            self._queue_store(gs, hashes)
            if not index_keys and not gs.indexable_kind:
                stats.skipped["kind:" + (gs.kind or "none")] += n

    def _store_self_describing(self, w: _Worker, ev: BlockStored, tier: int) -> None:
        gs = w.groups.get(ev.group_idx or 0)
        if gs is not None and gs.block_size and ev.block_size != gs.block_size:
            # a partial tail at hash granularity (C§5.8): join its last hash instead
            self.stats.skipped["self_describing_partial"] += 1
            self._store_placeholder(w, ev, tier, tails=ev.block_hashes[-1:])
            return
        # record metadata for every constituent (no tier refs), then ref the chunk tail
        self._store_described(w, ev, -1)
        gs = w.groups[ev.group_idx or 0]
        if not gs.block_size:
            gs.block_size = ev.block_size
            self._layout = None
        hashes = ev.block_hashes
        tail = hashes[-1]
        for h in hashes[:-1]:
            # the chunk's other blocks keep their metadata as retained records (bounded
            # by gpu_metadata_retention) unless a tier holds them
            if h in gs.meta and not self._held(gs, h):
                self._retire(w.wid, gs, h)
        m = gs.meta.get(tail)
        if m is None:  # pragma: no cover - bad input already counted
            return
        self.stats.self_describing += 1
        self.stats.stored[TIERS[tier]] += 1
        self._observe_tail(w, gs, m)
        self._ref(w, gs, tier, tail, _ck(m))

    def _store_placeholder(
        self, w: _Worker, ev: BlockStored, tier: int, tails: Iterable[Hash] | None = None
    ) -> None:
        stats = self.stats
        gs = w.groups.get(ev.group_idx or 0)
        if gs is None:
            gs = self._group(w, ev.group_idx or 0)
        kind = ev.kv_cache_spec_kind
        if kind is not None and kind != gs.kind and gs.kind is None:
            self._set_kind(w, gs, kind)
        meta = gs.meta
        for h in ev.block_hashes if tails is None else tails:
            stats.stored[TIERS[tier]] += 1
            m = meta.get(h)
            if m is None:
                self._add_pending(w.wid, gs.group, h, tier)
                continue
            stats.joined += 1
            self._observe_tail(w, gs, m)
            self._ref(w, gs, tier, h, _ck(m))

    def _add_pending(self, wid: WorkerId, group: int, h: Hash, tier: int) -> None:
        self.stats.pending += 1
        key = (wid, group, h)
        p = self._pending.get(key)
        if p is None:
            p = self._pending[key] = [0, 0, 0]
            self._npending[wid] = self._npending.get(wid, 0) + 1
        p[tier] += 1
        while len(self._pending) > self.max_pending:
            (owid, _, _), old = self._pending.popitem(last=False)
            self._unpend(owid)
            if not self.stats.unjoined["pending_overflow"]:
                logger.warning(
                    "block index: more than %d CPU/STORAGE stores wait for their GPU store; "
                    "dropping the oldest (counted as unjoined[pending_overflow])",
                    self.max_pending,
                )
            self.stats.unjoined["pending_overflow"] += old[1] + old[2]

    def _unpend(self, wid: WorkerId) -> None:
        """One pending entry of ``wid`` fewer (it left the table)."""
        n = self._npending.get(wid, 0) - 1
        if n > 0:
            self._npending[wid] = n
        else:
            self._npending.pop(wid, None)

    def _join_pending(self, w: _Worker, gs: _Group, h: Hash, m: _Meta, p: list[int]) -> None:
        self._unpend(w.wid)  # (the caller took the entry out of the table)
        ck = _ck(m)
        for tier in (1, 2):
            for _ in range(p[tier]):
                self.stats.joined += 1
                self.stats.joined_late += 1
                self._observe_tail(w, gs, m)
                self._ref(w, gs, tier, h, ck)

    def _legacy_store(self, w: _Worker, ev: BlockStored, tier: int) -> None:
        """≤0.23 CPU store: bytes hashes, no group, meaningless block_size (C§9.16).

        Each hash is looked up in every group of the worker, as the raw digest and as its
        wire int (the digest's last 8 bytes); repeated occurrences of one hash go to the
        next group that knows it (a hash can key several groups, C§5.3).
        """
        used: dict[Hash, int] = {}
        for raw in ev.block_hashes:
            self.stats.stored[TIERS[tier]] += 1
            found = self._legacy_find(w, raw, used, lambda gs, h: h in gs.meta)
            if found is None:
                self.stats.unjoined["legacy_unknown_hash"] += 1
                continue
            gs, h = found
            self.stats.joined += 1
            m = gs.meta[h]
            self._observe_tail(w, gs, m)
            self._ref(w, gs, tier, h, _ck(m))

    def _legacy_remove(self, w: _Worker, hashes: Iterable[Hash], tier: int) -> None:
        used: dict[Hash, int] = {}
        for raw in hashes:
            found = self._legacy_find(w, raw, used, lambda gs, h: h in gs.refs[tier])
            if found is None:
                self.stats.unknown_removals[TIERS[tier]] += 1
                continue
            gs, h = found
            self._remove(w, gs.group, [h], tier)

    @staticmethod
    def _legacy_find(
        w: _Worker, raw: Hash, used: dict[Hash, int], has: Any
    ) -> tuple[_Group, Hash] | None:
        forms: list[Hash] = [raw]
        if isinstance(raw, bytes):
            forms.append(int.from_bytes(raw[-8:], "big"))
        skip = used.get(raw, 0)
        for g in sorted(w.groups):
            gs = w.groups[g]
            for h in forms:
                if has(gs, h):
                    if skip:
                        skip -= 1
                        break
                    used[raw] = used.get(raw, 0) + 1
                    return gs, h
        return None

    # ------------------------------------------------------------------ refs

    def _ref(self, w: _Worker, gs: _Group, tier: int, h: Hash, ck: int | None) -> None:
        """Count one more residency of ``h`` on ``tier``; ``ck`` is its content key.

        For the GPU tier the record of ``h`` holds the refcount; if the memory cap has
        just dropped that record, there is nothing to count.
        """
        if tier < 0:
            return
        r = gs.refs
        if tier == 0:
            meta = gs.meta
            m = meta.get(h)
            if m is None:
                # the memory cap dropped this entry whole while it was being applied
                # (e.g. while joining its pending CPU stores); nothing left to count
                return
            if isinstance(m, int):
                c = m >> _GSHIFT
                meta[h] = m + _G1
            else:
                c = m[_GPU]
                meta[h] = _add_gpu(m, 1)
            if c:
                return
            elsewhere = h in r[1] or h in r[2]
        else:
            refs = r[tier]
            c = refs.get(h, 0)
            refs[h] = c + 1
            if c:
                return
            om = gs.meta.get(h)
            elsewhere = (om is not None and _gpu(om) > 0) or h in r[3 - tier]
        if ck is not None:
            marks = self._marks[tier]
            v = marks.get(ck)
            # a key held by one slot shares the slot's bit object (no new int)
            if v is None:
                marks[ck] = gs.bit
            elif v & gs.bit:
                _dup(marks, ck, gs.bit)
            else:
                marks[ck] = v | gs.bit
        if elsewhere:
            return
        self._resident += 1
        if self._retired:
            self._retired.pop((w.wid, gs.group, h), None)
        if self._tracking:
            m = gs.meta.get(h)
            if tier:
                self._enter(gs, h, m)
            elif m is not None:  # (a GPU store: _store_described queues the event's blocks)
                p = _parent(m)
                if p is not None:
                    gs.kids[p] = gs.kids.get(p, 0) + 1
        if self._resident > self._watch:
            self._watch_hit()

    def _remove(self, w: _Worker, group: int, hashes: Iterable[Hash], tier: int) -> None:
        gs = w.groups.get(group)
        if gs is None:
            for h in hashes:
                self._remove_unknown(w, None, group, h, tier)
            return
        r = gs.refs
        refs = r[tier]
        marks = self._marks[tier]
        meta = gs.meta
        bit = gs.bit
        retired = self._retired
        wid = w.wid
        removed = 0
        for h in hashes:
            if tier == 0:
                m = meta.get(h)
                c = 0 if m is None else _gpu(m)
                if not c or m is None:
                    self._remove_unknown(w, gs, group, h, tier)
                    continue
                removed += 1
                meta[h] = _add_gpu(m, -1)
                if c > 1:
                    continue
                elsewhere = h in r[1] or h in r[2]
            else:
                cc = refs.get(h)
                if cc is None:
                    self._remove_unknown(w, gs, group, h, tier)
                    continue
                removed += 1
                if cc > 1:
                    refs[h] = cc - 1
                    continue
                del refs[h]
                m = meta.get(h)
                if type(m) is int:  # the packed record, inline
                    elsewhere = m >= _G1 or h in r[3 - tier]
                    if m & _HAS_CK:
                        ck = (m & _M64) - _OFF
                        v = marks.get(ck)
                        if marks.dups and _undup(marks, ck, bit):
                            pass  # another engine block of this slot has it
                        elif v is not None:
                            if v == bit:  # the only holder
                                del marks[ck]
                            else:
                                v &= ~bit
                                if v:
                                    marks[ck] = v
                                else:
                                    del marks[ck]
                    if not elsewhere:
                        self._resident -= 1
                        if gs.deferred:
                            gs.deferred.pop(h, None)
                        p = (m >> 105) & _M65
                        if p and gs.kids:
                            self._unkid(gs, p - 1)
                        retired[(wid, group, h)] = None
                        if len(retired) > self.gpu_metadata_retention:
                            self._trim_retired()
                    continue
                elsewhere = (m is not None and _gpu(m) > 0) or h in r[3 - tier]
            if m is not None:
                mck = _ck(m)
                if mck is not None:
                    _unmark(marks, mck, bit)
            if not elsewhere:
                self._resident -= 1
                if gs.deferred:
                    gs.deferred.pop(h, None)
                if m is not None:
                    mp = _parent(m)
                    if mp is not None:
                        self._unkid(gs, mp)
                    retired[(wid, group, h)] = None
                    if len(retired) > self.gpu_metadata_retention:
                        self._trim_retired()
        if removed:
            self.stats.removed[TIERS[tier]] += removed

    def _remove_unknown(
        self, w: _Worker, gs: _Group | None, group: int, h: Hash, tier: int
    ) -> None:
        if tier and w.wid in self._npending:
            p = self._pending.get((w.wid, group, h))
            if p is not None and p[tier] > 0:
                p[tier] -= 1
                self.stats.unjoined["removed_while_pending"] += 1
                if not (p[1] or p[2]):
                    del self._pending[(w.wid, group, h)]
                    self._unpend(w.wid)
                return
        if tier and gs is not None and h in gs.meta:
            # fan-out of a chunk's non-tail constituents (C§5.8): harmless
            self.stats.skipped["removed_non_tail"] += 1
            return
        self.stats.unknown_removals[TIERS[tier]] += 1

    @staticmethod
    def _held(gs: _Group, h: Hash) -> bool:
        """Whether any tier holds ``h`` in this group."""
        m = gs.meta.get(h)
        r = gs.refs
        return (m is not None and _gpu(m) > 0) or h in r[1] or h in r[2]

    def _retire(self, wid: WorkerId, gs: _Group, h: Hash) -> None:
        self._retired[(wid, gs.group, h)] = None
        if len(self._retired) > self.gpu_metadata_retention:
            self._trim_retired()

    def _trim_retired(self) -> None:
        retired = self._retired
        while len(retired) > self.gpu_metadata_retention:
            (owid, ogroup, oh), _ = retired.popitem(last=False)
            ow = self._workers.get(owid)
            ogs = ow.groups.get(ogroup) if ow is not None else None
            if ogs is None:
                continue
            m = ogs.meta.get(oh)
            if m is None:
                continue
            if type(m) is int:
                if m >= _G1:
                    continue
            elif _gpu(m) > 0:
                continue
            r = ogs.refs
            if oh in r[1] or oh in r[2]:
                continue
            del ogs.meta[oh]
            self.stats.metadata_evicted += 1

    def _rekey(self, gs: _Group, h: Hash, old: _Meta, new: _Meta) -> None:
        self._reparent(gs, h, old, new)
        old_ck, new_ck = _ck(old), _ck(new)
        for tier in range(3):
            if (_gpu(old) > 0) if tier == 0 else (h in gs.refs[tier]):
                marks = self._marks[tier]
                if old_ck is not None:
                    _unmark(marks, old_ck, gs.bit)
                if new_ck is not None:
                    _mark(marks, new_ck, gs.bit)

    # ------------------------------------------------------------------ the memory cap

    def _enter(self, gs: _Group, h: Hash, m: _Meta | None) -> None:
        """``h`` became resident through a CPU/STORAGE store: one more resident child for
        its parent, and its place in the eviction queue."""
        if m is not None:
            p = _parent(m)
            if p is not None:
                gs.kids[p] = gs.kids.get(p, 0) + 1
        self._qgroups.append(gs)
        self._qhashes.append(h)
        if len(self._qhashes) > self._qlimit:
            self._compact_queue()

    def _queue_store(self, gs: _Group, hashes: Any) -> None:
        """Queue a GPU store's blocks for eviction, leaf first (they became resident
        together, so each block goes before its parent), then enforce the cap (blocks
        of an event being applied are not queued yet, so the cap is checked again)."""
        self._storing = False
        if self._tracking:
            self._qhashes.extend(reversed(hashes))
            self._qgroups.extend(repeat(gs, len(hashes)))
            if len(self._qhashes) > self._qlimit:
                self._compact_queue()
        if self._resident > self._watch:
            self._watch_hit()

    def _watch_hit(self) -> None:
        """More entries are resident than ``_watch``: start the eviction bookkeeping
        (first time: more than half the cap) and evict if over the cap."""
        if not self._tracking:
            self._start_tracking()
        if self._resident > self.max_blocks:
            self._evict()

    def _start_tracking(self) -> None:
        """Build the children counts and the eviction queue from the index as it is (each
        group's resident entries in record order, groups in slot order); from now on the
        feeding code keeps them up to date."""
        self._tracking = True
        self._watch = self.max_blocks
        qg, qh = self._qgroups, self._qhashes
        for slot in sorted(self._slots):
            gs = self._slots[slot][1]
            kids = gs.kids
            r1, r2 = gs.refs[1], gs.refs[2]
            for h, m in gs.meta.items():
                if _gpu(m) > 0 or h in r1 or h in r2:
                    p = _parent(m)
                    if p is not None:
                        kids[p] = kids.get(p, 0) + 1
                    qg.append(gs)
                    qh.append(h)
            for h in [*r1, *(h for h in r2 if h not in r1)]:
                if h not in gs.meta:  # (held on CPU/STORAGE without a record)
                    qg.append(gs)
                    qh.append(h)
        self._qlimit = max(1 << 16, 4 * len(qh))

    def _unkid(self, gs: _Group, p: Hash) -> None:
        """A resident entry whose parent is ``p`` stopped being resident."""
        kids = gs.kids
        c = kids.get(p)
        if c is None:
            return
        if c > 1:
            kids[p] = c - 1
        else:
            del kids[p]
            if p in gs.deferred:
                self._ready.append((gs, p))

    def _reparent(self, gs: _Group, h: Hash, old: _Meta, new: _Meta) -> None:
        """``h``'s record is replaced (an orphan healed): if it is resident, it is now a
        child of the new record's parent."""
        if not self._tracking:
            return
        po, pn = _parent(old), _parent(new)
        if po != pn and self._held(gs, h):
            if po is not None:
                self._unkid(gs, po)
            if pn is not None:
                gs.kids[pn] = gs.kids.get(pn, 0) + 1

    def _live(self, gs: _Group) -> bool:
        t = self._slots.get(gs.slot)
        return t is not None and t[1] is gs

    def _evict(self) -> None:
        """Evict resident entries until at most ``max_blocks - max_blocks // 100`` remain
        (at least one below the cap, so that eviction runs in batches).

        Only resident entries are evicted (the entry, its metadata record and its tier
        refcounts go; counted in ``stats.evicted_by_cap``), and the order is a function of
        the event stream alone (never of queries, wall time or dict order of queries), so
        two indexes fed the same events evict the same entries:

        1. entries passed over earlier because they had resident children (see 2), as
           soon as their last resident child is gone: they are the oldest;
        2. the eviction queue: entries in the order they became resident (the blocks of
           one GPU store leaf first); an entry that still has resident children in its
           group (entries naming it as parent) is passed over (deferred) instead, so
           leaves go before their parents and a shared prefix outlives every chat built
           on it;
        3. if 1 and 2 have nothing left (a parent cycle, say), deferred entries in the
           order they were deferred, children or not: the cap always holds.  While a GPU
           store is being applied its blocks are not queued yet, so this step waits for
           the end of the event (the cap holds again once the event is applied).
        """
        goal = self.max_blocks - max(1, self.max_blocks // 100) + 1
        ready = self._ready
        qg, qh = self._qgroups, self._qhashes
        slots = self._slots
        head = self._qhead
        end = len(qh)
        try:
            while self._resident > goal:
                if ready:
                    gs, h = ready.popleft()
                    if h not in gs.deferred or gs.kids.get(h) or not self._live(gs):
                        continue
                    if not self._held(gs, h):
                        del gs.deferred[h]
                        continue
                    self._drop(gs, h, gs.meta.get(h))
                    continue
                if head < end:
                    gs = qg[head]
                    h = qh[head]
                    head += 1
                    t = slots.get(gs.slot)
                    if t is None or t[1] is not gs:
                        continue  # a removed worker's
                    m = gs.meta.get(h)
                    if type(m) is int:
                        if m < _G1 and h not in gs.refs[1] and h not in gs.refs[2]:
                            continue  # not resident any more
                    elif not self._held(gs, h):
                        continue
                    if gs.kids and h in gs.kids:
                        gs.deferred[h] = None
                        continue
                    if gs.deferred and h in gs.deferred:
                        continue
                    self._drop(gs, h, m)
                    continue
                if self._storing or not self._evict_deferred(goal):
                    break
        finally:
            self._qhead = head
            if head > 4096 and 2 * head > len(qh):
                del qg[:head]
                del qh[:head]
                self._qhead = 0

    def _evict_deferred(self, goal: int) -> bool:
        """Step 3 of :meth:`_evict`; False if there was nothing to evict."""
        evicted = False
        for slot in sorted(self._slots):
            _, gs = self._slots[slot]
            for h in list(gs.deferred):
                if self._resident <= goal:
                    return True
                del gs.deferred[h]
                if self._held(gs, h):
                    self._drop(gs, h, gs.meta.get(h))
                    evicted = True
        return evicted

    def _drop(self, gs: _Group, h: Hash, m: _Meta | None) -> None:
        """Evict the resident entry ``h`` of ``gs`` (``m`` is its record) whole."""
        p: Hash | None
        if type(m) is int:
            del gs.meta[h]
            ck = (m & _M64) - _OFF if m & _HAS_CK else None
            on_gpu = m >= _G1
            pf = (m >> 105) & _M65
            p = pf - 1 if pf else None
        elif m is not None:
            del gs.meta[h]
            ck, on_gpu, p = _ck(m), _gpu(m) > 0, _parent(m)
        else:
            ck, on_gpu, p = None, False, None
        bit = gs.bit
        r = gs.refs
        if ck is not None:
            if on_gpu:
                _unmark(self._marks[0], ck, bit)
            if r[1] and r[1].pop(h, None) is not None:
                _unmark(self._marks[1], ck, bit)
            if r[2] and r[2].pop(h, None) is not None:
                _unmark(self._marks[2], ck, bit)
        else:
            r[1].pop(h, None)
            r[2].pop(h, None)
        if gs.deferred:
            gs.deferred.pop(h, None)
        self._resident -= 1
        self.stats.evicted_by_cap += 1
        if p is not None:
            kids = gs.kids
            c = kids.get(p)
            if c is not None:
                if c > 1:
                    kids[p] = c - 1
                else:
                    del kids[p]
                    if p in gs.deferred:
                        self._ready.append((gs, p))

    def _compact_queue(self) -> None:
        """Rewrite the eviction queue without the items it would skip (entries no longer
        resident, deferred or of removed workers) and without repeats (an entry keeps its
        first place), so that it stays proportional to the resident entries."""
        seen: dict[int, set[Hash]] = {}  # by slot: hashes already kept
        ng: list[_Group] = []
        nh: list[Hash] = []
        qg, qh = self._qgroups, self._qhashes
        slots = self._slots
        last: _Group | None = None
        ok = False
        kept: set[Hash] = set()
        for i in range(self._qhead, len(qh)):
            gs = qg[i]
            if gs is not last:  # runs of one group are the common case
                last = gs
                t = slots.get(gs.slot)
                ok = t is not None and t[1] is gs
                meta, r1, r2, deferred = gs.meta, gs.refs[1], gs.refs[2], gs.deferred
                kept = seen.setdefault(gs.slot, set())
            if not ok:
                continue
            h = qh[i]
            m = meta.get(h)
            if type(m) is int:
                if m < _G1 and h not in r1 and h not in r2:
                    continue
            elif not ((m is not None and _gpu(m) > 0) or h in r1 or h in r2):
                continue
            if h in kept or h in deferred:
                continue
            kept.add(h)
            ng.append(gs)
            nh.append(h)
        self._qgroups, self._qhashes, self._qhead = ng, nh, 0
        self._qlimit = max(1 << 16, 4 * len(nh))

    # ------------------------------------------------------------------ learning

    def _set_kind(self, w: _Worker, gs: _Group, kind: str) -> None:
        gs.kind = kind
        gs.indexable_kind = kind in _KEYED_KINDS
        self._layout = None

    def _unkey_partials(self, gs: _Group, size: int) -> None:
        """The group's block size grew to ``size``: records of smaller blocks were partial
        tails (cache_partial_block) and lose their content key and marks."""
        for h, m in list(gs.meta.items()):
            if _size(m) < size and _ck(m) is not None:
                new = _unkeyed(m)
                self._rekey(gs, h, m, new)
                gs.meta[h] = new
                self.stats.skipped["partial_tail"] += 1

    def _observe_tail(self, w: _Worker, gs: _Group, m: _Meta) -> None:
        if w.bpc_fixed:
            return
        end = _end_tokens(m)
        size = gs.block_size or _size(m)
        if end is None or size <= 0 or end % size:
            return
        bpc = math.gcd(w.bpc, end // size)
        if bpc and bpc != w.bpc:
            w.bpc = bpc
            self._layout = None

    def blocks_per_chunk(self, worker: WorkerId) -> int | None:
        """The worker's blocks per chunk: configured, learned so far, or ``None``."""
        w = self._workers.get(worker)
        if w is None:
            return _bpc_lookup(self._bpc_config, worker) or None
        return w.bpc or None

    # ------------------------------------------------------------------ queries

    def block_info(self, worker: WorkerId, group: int, block_hash: Hash) -> BlockInfo | None:
        """What the index knows about ``block_hash`` in ``group`` of ``worker``, or None."""
        w = self._workers.get(worker)
        gs = w.groups.get(group) if w is not None else None
        m = gs.meta.get(block_hash) if gs is not None else None
        if w is None or gs is None or m is None:
            return None
        tiers = frozenset(
            TIERS[t] for t in range(3) if (_gpu(m) > 0 if t == 0 else block_hash in gs.refs[t])
        )
        chunk = None
        if w.bpc and (block_hash in gs.refs[1] or block_hash in gs.refs[2]):
            hashes: list[Hash] = [block_hash]
            cur = m
            while len(hashes) < w.bpc:
                up = _parent(cur)
                if up is None:
                    break
                hashes.append(up)
                nxt = gs.meta.get(up)
                if nxt is None:
                    break
                cur = nxt
            size = gs.block_size or _size(m)
            span = w.bpc * size
            end = _end_tokens(m)
            chunk = ChunkSpan(
                hashes=tuple(reversed(hashes)),
                start=end - span if end is not None else None,
                end=end,
                blocks_per_chunk=w.bpc,
                tokens=span,
            )
        end = _end_tokens(m)
        return BlockInfo(
            group=group,
            block_size=_size(m),
            start=end - _size(m) if end is not None else None,
            end=end,
            parent=_parent(m),
            lora_name=_field(m, _LORA),
            extra_keys=_field(m, _EXTRA),
            kind=gs.kind,
            tiers=tiers,
            indexed=_ck(m) is not None and self._slot_indexable(w, gs),
            token_ids=_field(m, _TOKENS),
            chunk=chunk,
        )

    def summary(self) -> dict[WorkerId, WorkerSummary]:
        """Per worker and tier: entries held (blocks on GPU, chunks elsewhere) and tokens."""
        out: dict[WorkerId, WorkerSummary] = {}
        for wid in sorted(self._workers):
            w = self._workers[wid]
            counts = [[0, 0], [0, 0], [0, 0]]
            retained = 0
            for gs in w.groups.values():
                retained += len(gs.meta)
                for m in gs.meta.values():
                    if _gpu(m):
                        counts[0][0] += 1
                        counts[0][1] += _size(m)
                for tier in (1, 2):
                    for h in gs.refs[tier]:
                        tm = gs.meta.get(h)
                        size = _size(tm) if tm is not None else 0
                        counts[tier][0] += 1
                        counts[tier][1] += size * (w.bpc or 1)
            out[wid] = WorkerSummary(
                worker=wid,
                groups=len(w.groups),
                blocks_per_chunk=w.bpc or None,
                tiers={TIERS[t]: TierSummary(counts[t][0], counts[t][1]) for t in range(3)},
                retained_metadata=retained,
            )
        return out

    @property
    def pending_count(self) -> int:
        """Placeholder (worker, group, hash) entries now waiting for their GPU store."""
        return len(self._pending)

    @property
    def resident_count(self) -> int:
        """Resident (worker, group, hash) entries (held on at least one tier)."""
        return self._resident

    @property
    def retained_count(self) -> int:
        """Metadata records kept for GPU-removed blocks no tier holds (for late joins)."""
        return len(self._retired)

    def gauges(self) -> dict[str, int]:
        """Current sizes, for metrics: ``resident_entries`` (``len(index)``),
        ``pending_joins`` (placeholder entries waiting for their GPU store) and
        ``retained_metadata`` (:attr:`retained_count`).  Reads only plain ints and
        ``len()``, so it may be called from another thread (a metrics scrape)."""
        return {
            "resident_entries": self._resident,
            "pending_joins": len(self._pending),
            "retained_metadata": len(self._retired),
        }

    def __len__(self) -> int:
        return self._resident

    # ------------------------------------------------------------------ for the router

    def _slot_indexable(self, w: _Worker, gs: _Group) -> bool:
        """Whether the group is full attention (a kind-less group only when alone)."""
        if gs.kind is None:
            return len(w.groups) == 1
        return gs.kind in PREFIX_INDEXABLE_SPEC_KINDS

    def _plan(self, w: _Worker) -> _Plan:
        unit = self.canonical_block_size
        blocked: str | None = None
        members: list[tuple[str, int, int, _Group]] = []
        for g in sorted(w.groups):
            gs = w.groups[g]
            kind = gs.kind
            if self._slot_indexable(w, gs):
                cls, window = "full", 0
            elif kind in _SW_KINDS or kind in _LOCAL_KINDS:
                cls = "sw" if kind in _SW_KINDS else "local"
                window = gs.window or 0
                if window <= 0:
                    blocked = blocked or "no_window"
            elif kind is None or kind in _IGNORED_KINDS:
                continue  # not consulted by vLLM's prefix lookup (or unknowable)
            else:
                blocked = blocked or "kind:" + kind
                continue
            if not gs.block_size or gs.block_size % unit:
                blocked = blocked or "block_size"
            members.append((cls, gs.block_size, window, gs))
        if not members:
            blocked = blocked or "no_group"
        spec: dict[tuple[str, int, int], list[int]] = {}
        for cls, size, window, gs in members:
            spec.setdefault((cls, size, window), []).append(gs.slot)
        order = sorted(spec.items(), key=lambda kv: kv[0][0] != "full")  # stable
        spec_groups = tuple(
            _SpecGroup(c, b, wdw, sum(1 << x for x in slots), tuple(slots))
            for (c, b, wdw), slots in order
        )
        sizes = [m[1] for m in members if m[1]]
        unitary = len(w.groups) == 1
        align = math.lcm(*sizes) if sizes else 1
        bpc = w.bpc
        chunk_groups: list[tuple[str, int, int, int]] = []
        for cls, size, window, gs in sorted(members, key=lambda m: m[0] != "full"):
            tpc = bpc * size
            wchunks = 0 if cls == "full" or not tpc else -(-window // tpc)
            chunk_groups.append((cls, size, wchunks, gs.bit))
        return _Plan(
            wid=w.wid,
            blocked=blocked,
            unitary=unitary,
            spec_groups=spec_groups,
            align=align,
            chunk_groups=tuple(chunk_groups),
            windowed=any(m[0] != "full" for m in members),
            bpc=bpc,
            lookahead=w.lookahead,
            eagle=w.eagle,
        )

    def layout(self) -> _Layout:
        """Slot classes for the router's walk and per-worker plans (cached until they change)."""
        if self._layout is not None:
            return self._layout
        unit = self.canonical_block_size
        gpu: dict[int, int] = {}
        chunk: dict[int, int] = {}
        slot_worker: dict[int, WorkerId] = {}
        plans: dict[WorkerId, _Plan] = {}
        complex_workers: list[WorkerId] = []
        cfull: dict[int, int] = {}
        for wid in sorted(self._workers):
            w = self._workers[wid]
            plan = plans[wid] = self._plan(w)
            simple = (
                plan.blocked is None
                and plan.unitary
                and plan.spec_groups[0].cls == "full"
                and not plan.lookahead
                and not plan.eagle
            )
            if not simple:
                if plan.blocked is None:  # (a blocked worker is never credited)
                    complex_workers.append(wid)
                    if not plan.lookahead:
                        for sg in plan.spec_groups:
                            if sg.cls == "full":
                                u = sg.block_size // unit
                                cfull[u] = cfull.get(u, 0) | sg.bits
                continue
            (gs,) = w.groups.values()
            slot_worker[gs.slot] = wid
            u = gs.block_size // unit
            gpu[u] = gpu.get(u, 0) | gs.bit
            if w.bpc:
                v = u * w.bpc
                chunk[v] = chunk.get(v, 0) | gs.bit
        nslots = max(slot_worker, default=-1) + 1
        pos_wids: list[WorkerId | None] = [None] * (nslots + 1)
        simple_mask = 0
        for slot, wid in slot_worker.items():
            pos_wids[slot + 1] = wid
            simple_mask |= 1 << slot
        self._layout = _Layout(
            canonical=unit,
            gpu_classes=sorted(gpu.items()),
            chunk_classes=sorted(chunk.items()),
            gpu_mask=_or_all(gpu.values()),
            chunk_mask=_or_all(chunk.values()),
            slot_worker=slot_worker,
            nslots=nslots,
            pos_wids=pos_wids,
            pos_bits=[0] + [1 << s for s in range(nslots)],
            simple_mask=simple_mask,
            plans=plans,
            complex_workers=tuple(complex_workers),
            complex_full_classes=sorted(cfull.items()),
            complex_full_mask=_or_all(cfull.values()),
        )
        return self._layout

    def marks(self, tier: int) -> dict[int, int]:
        """Content key → bitset of slots holding a block (GPU) or chunk ending there."""
        return self._marks[tier]


class _Marks(dict[int, int]):
    """Content key -> bitset of slots, with a count of extra references per (key, slot).

    Marks are counted: two engine blocks of one slot with the same content key (e.g. one
    LoRA name over two adapter paths) are two references, and removing one keeps the
    other.  ``dups`` holds the references beyond the first; it is almost always empty.
    """

    __slots__ = ("dups",)

    def __init__(self) -> None:
        super().__init__()
        self.dups: dict[tuple[int, int], int] = {}


def _dup(marks: _Marks, ck: int, bit: int) -> None:
    """One more reference of ``ck`` by the slot ``bit`` that already marks it."""
    d = marks.dups
    d[(ck, bit)] = d.get((ck, bit), 0) + 1


def _undup(marks: _Marks, ck: int, bit: int) -> bool:
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


def _mark(marks: _Marks, ck: int, bit: int) -> None:
    v = marks.get(ck)
    if v is None:
        marks[ck] = bit
    elif v & bit:
        _dup(marks, ck, bit)
    else:
        marks[ck] = v | bit


def _unmark(marks: _Marks, ck: int, bit: int) -> None:
    if marks.dups and _undup(marks, ck, bit):
        return
    v = marks.get(ck)
    if v is None:
        return
    v &= ~bit
    if v:
        marks[ck] = v
    else:
        del marks[ck]


def _or_all(values: Iterable[int]) -> int:
    out = 0
    for v in values:
        out |= v
    return out
