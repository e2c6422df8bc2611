"""The :class:`BlockIndex` facade: which worker holds which prefix on which tier.

The index consumes KV event batches from many engines and answers one question fast:
for a prompt, how many of its leading tokens does each worker hold on GPU, CPU and
STORAGE?  Its heart is the *join*: a CPU/STORAGE placeholder ``BlockStored([H],
block_size=0, token_ids=[], group_idx=g)`` says nothing about size or tokens, so the
index recovers both from the GPU ``BlockStored`` of the same worker, group and hash.

Model
-----
* A *worker* is ``(source, dp_rank)``.  Per worker and KV-cache group the index keeps
  GPU metadata per engine hash: block size, parent hash, token span, LoRA name, extra
  keys (and, with ``keep_token_ids``, the token ids), plus the block's content key
  (:mod:`.records`).
* The GPU tier is refcounted per (worker, group, hash); the CPU and STORAGE tiers are
  refcounted per (worker, group, *chunk-tail* hash) (:mod:`.refs`).  A chunk is the
  tail block and its ``blocks_per_chunk - 1`` parents.  Duplicate stores are normal; a
  removal of a hash the tier never announced is counted and harmless.
* Metadata outlives the GPU block (bounded by ``gpu_metadata_retention``), because the CPU
  store may arrive after the GPU removal.  A placeholder whose GPU store has not arrived
  yet waits in a bounded pending table and joins when it does; one that is pushed out,
  cleared or reset before it joins is counted as unjoined, never guessed (:mod:`.join`).
* Matching is by *content*: every engine block ends at a canonical unit boundary
  (``canonical_block_size`` tokens) whose chained key over tokens, LoRA name and extra
  keys is independent of the engine's hash algorithm and seed
  (:mod:`kvevents.consumers.content`).  A content-key -> worker bitset map per tier
  (:mod:`.marks`) lets the router walk a prompt's keys once for all workers (see
  :mod:`kvevents.consumers.router` and :mod:`.layout`).  Marks are counted: two engine
  blocks of one group with the same content key are two references.
* Groups keep their kind and window (``kv_cache_spec_kind``,
  ``kv_cache_spec_sliding_window``) for the router's hybrid lookup, and their block size
  is the largest GPU block size seen: a smaller store is a partial tail, kept but never
  matched (:mod:`.stores`).
* Memory is bounded: at most ``max_blocks`` resident (worker, group, hash) entries (see
  :meth:`.Eviction.evict` for the order: oldest first, leaves before their parents,
  decided by the stream alone), at most ``gpu_metadata_retention`` metadata records no
  tier holds, and at most ``max_pending`` waiting placeholders.  The bookkeeping the
  eviction order needs starts when more than half of ``max_blocks`` is first resident
  (:mod:`.eviction`).

Caveat: stores are refcounted, so a GPU re-announcement of prefix hits
(``kv_cache_report_mode="full"``) followed by the block's single removal leaves the
block counted until a later removal, ``AllBlocksCleared`` or a reset.

Not thread-safe: feed it from one thread (the subscriber's) and query from the same one,
or guard it with a lock.

This module is the facade only: it validates the configuration, composes the feeding
rooms (:class:`~.apply.Feeder`) and answers queries.  Imports every other module of the
package; none imports it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from kvevents.consumers.index.apply import Feeder
from kvevents.consumers.index.bulk import PayloadStats, apply_payload, payload_stats
from kvevents.consumers.index.eviction import QueueItem
from kvevents.consumers.index.join import EntryKey, RetainedOrder, adopt_retained
from kvevents.consumers.index.layout import IndexLayout, build_layout
from kvevents.consumers.index.marks import Marks, TierMarks, adopt, as_tier_marks
from kvevents.consumers.index.queries import block_info, held_content_keys, summary
from kvevents.consumers.index.records import Hash, adopt_records
from kvevents.consumers.index.snapshot import restore_index, snapshot_index
from kvevents.consumers.index.stats import BlockInfo, IndexStats, WorkerSummary
from kvevents.consumers.index.workers import WorkerId, WorkerState, bpc_lookup
from kvevents.errors import ConfigError
from kvevents.events import KVEvent, KVEventBatch
from kvevents.native import NATIVE

__all__ = ["BlockIndex"]

_SNAPSHOT_FORMS: dict[type, Any] = (
    {}
    if NATIVE is None
    else {
        NATIVE.SlotMarks: as_tier_marks,
        NATIVE.RecordTable: lambda t: dict(t.items()),
        NATIVE.RetainedQueue: lambda q: OrderedDict(q.items()),
    }
)
"""The compiled core's tables, written as the Python tables they equal."""


class BlockIndex:
    """Joins GPU, CPU and STORAGE KV events per worker into a content-keyed prefix index.

    Parameters
    ----------
    blocks_per_chunk:
        GPU blocks per CPU chunk (the offloading connector's ``blocks_per_chunk``).  An int
        for every engine, a mapping keyed by :data:`WorkerId` or by source (``"*"`` for
        the rest), or ``None`` to learn it per worker as the gcd of the block counts at
        which chunk tails fall.  A learned value
        is an upper bound that converges down as tails arrive; configure it when known.
    canonical_block_size:
        Tokens per content-key unit.  Engine block sizes must be multiples of it for their
        blocks to take part in matching (others are joined but skipped, counted).
    max_blocks:
        Cap on resident (worker, group, hash) entries: ``len(index)`` never exceeds it
        after an event is applied.  Beyond it entries are evicted oldest first, leaves
        before their parents (see :meth:`.Eviction.evict`), and counted.
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
        self._feed = Feeder(
            canonical_block_size=canonical_block_size,
            max_blocks=max_blocks,
            gpu_metadata_retention=gpu_metadata_retention,
            max_pending=max_pending,
            keep_token_ids=keep_token_ids,
            bpc_config=blocks_per_chunk,
            lookahead_config=lookahead_tokens,
            eagle_config=eagle_drop,
        )
        self.stats: IndexStats = self._feed.stats
        # (the router asks for these on every query: one attribute each)
        self._table = self._feed.table
        self._tier_marks = self._feed.marks
        self._layout: IndexLayout | None = None
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
        self._feed.apply(source, dp_rank, batch)

    def apply_payload(
        self, source: str, dp_rank: int, payload: bytes | bytearray | memoryview
    ) -> None:
        """Apply one raw payload frame (vLLM's msgpack ``KVEventBatch``, every shape
        :class:`~kvevents.codec.BatchDecoder` reads) from worker ``(source, dp_rank)``:
        the same as ``apply(source, dp_rank, BatchDecoder().decode(payload))``, state and
        counters alike.  With the compiled core the payload is read natively (no
        event object per GPU removal, token ids never turned into Python ints, content
        keys chained natively); a shape it does not read goes through the Python
        decoder, counted in :attr:`payload_stats`.  Raises
        :class:`~kvevents.errors.DecodeError` for a malformed payload, having applied
        nothing of it."""
        apply_payload(self._feed, source, dp_rank, payload)

    @property
    def payload_stats(self) -> PayloadStats:
        """How :meth:`apply_payload` read its payloads (natively, by the Python decoder,
        fallbacks) and the Python decoder's counters.  Not part of snapshots."""
        return payload_stats(self._feed)

    def apply_event(self, worker: WorkerId, event: KVEvent) -> None:
        """Apply one event from ``worker``."""
        self._feed.apply_event(self._feed.worker(worker), event)

    def reset_worker(self, worker: WorkerId) -> None:
        """Forget everything a worker holds, metadata included (publisher restart, loss)."""
        w = self._feed.workers.get(worker)
        if w is None:
            return
        self.stats.resets += 1
        self._feed.clear_tiers(w, keep_metadata=False)

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget a worker entirely and free its slots (a stale mark included: a worker
        that comes back under the same id starts live)."""
        self._stale.discard(worker)
        w = self._feed.workers.get(worker)
        if w is None:
            return
        self.stats.resets += 1
        self._feed.clear_tiers(w, keep_metadata=False)
        self._feed.table.remove(worker)

    # ------------------------------------------------------------------ snapshots

    def snapshot(self) -> bytes:
        """This index's whole state as bytes (versioned msgpack): :meth:`restore` gives
        an index that answers and applies exactly as this one would from here on."""
        return snapshot_index(self, _SNAPSHOT_FORMS)

    @classmethod
    def restore(cls, data: bytes) -> BlockIndex:
        """An index from :meth:`snapshot` bytes; :class:`ConfigError` if they are not a
        snapshot this kvevents can read."""
        index = restore_index(data)
        if not isinstance(index, cls):
            raise ConfigError(f"the snapshot holds a {type(index).__name__}, not a BlockIndex")
        index._layout = None  # derived from the rest; rebuilt by the next query
        index._adopt_tables()
        index._table.layout_changed = True
        return index

    def _adopt_tables(self) -> None:
        # a snapshot holds TierMarks and dicts: the core that runs now keeps its own kinds
        feed = self._feed
        feed.retention.records = adopt_retained(feed.retention.records)
        for w in feed.workers.values():
            for gs in w.groups.values():
                gs.meta = adopt_records(gs.meta)
                gs.refs = (gs.refs[0], adopt_records(gs.refs[1]), adopt_records(gs.refs[2]))
        marks = feed.marks
        if all(type(m) is TierMarks for m in marks):
            feed.marks = feed.cap.marks = self._tier_marks = (
                adopt(marks[0]),  # type: ignore[arg-type]
                adopt(marks[1]),  # type: ignore[arg-type]
                adopt(marks[2]),  # type: ignore[arg-type]
            )

    # ------------------------------------------------------------------ queries

    def workers(self) -> list[WorkerId]:
        """Every worker the index has seen (and not removed), sorted."""
        return sorted(self._feed.workers)

    def num_workers(self) -> int:
        """How many workers :meth:`workers` would list."""
        return len(self._feed.workers)

    def blocks_per_chunk(self, worker: WorkerId) -> int | None:
        """The worker's blocks per chunk: configured, learned so far, or ``None``."""
        w = self._feed.workers.get(worker)
        if w is None:
            return bpc_lookup(self._feed.bpc_config, worker) or None
        return w.bpc or None

    def block_info(self, worker: WorkerId, group: int, block_hash: Hash) -> BlockInfo | None:
        """What the index knows about ``block_hash`` in ``group`` of ``worker``, or None."""
        return block_info(self._feed.workers, worker, group, block_hash)

    def summary(self) -> dict[WorkerId, WorkerSummary]:
        """Per worker and tier: entries held (blocks on GPU, chunks elsewhere) and tokens."""
        return summary(self._feed.workers)

    def held_keys(self, worker: WorkerId, tier: int = 0) -> set[int]:
        """Content keys of the blocks (``tier`` 0, GPU) or chunk tails (1 CPU, 2 STORAGE)
        ``worker`` holds, over all its groups (empty for an unknown worker).  For checks
        and benchmarks: the router reads :meth:`marks` instead."""
        w = self._feed.workers.get(worker)
        return held_content_keys(w, tier) if w is not None else set()

    @property
    def pending_count(self) -> int:
        """Placeholder (worker, group, hash) entries now waiting for their GPU store."""
        return len(self._feed.pending.entries)

    @property
    def resident_count(self) -> int:
        """Resident (worker, group, hash) entries (held on at least one tier)."""
        return self._feed.cap.resident

    @property
    def retained_count(self) -> int:
        """Metadata records kept for GPU-removed blocks no tier holds (for late joins)."""
        return len(self._feed.retention.records)

    @property
    def native_nbytes(self) -> int:
        """Bytes the compiled core's tables hold for this index (its marks, records,
        refcounts and retained order; 0 when pure Python runs).  Not Python allocations:
        ``tracemalloc`` misses them."""
        feed = self._feed
        n = sum(getattr(m, "nbytes", 0) for m in feed.marks)
        n += getattr(feed.retention.records, "nbytes", 0)
        for w in feed.workers.values():
            for gs in w.groups.values():
                n += sum(getattr(t, "nbytes", 0) for t in (gs.meta, *gs.refs))
        return n

    def gauges(self) -> dict[str, int]:
        """Current sizes, for metrics: ``resident_entries`` (``len(index)``),
        ``pending_joins`` (placeholder entries waiting for their GPU store) and
        ``retained_metadata`` (:attr:`retained_count`).  Reads only plain ints and
        ``len()``, so it may be called from another thread (a metrics scrape)."""
        feed = self._feed
        return {
            "resident_entries": feed.cap.resident,
            "pending_joins": len(feed.pending.entries),
            "retained_metadata": len(feed.retention.records),
        }

    def __len__(self) -> int:
        return self._feed.cap.resident

    # ------------------------------------------------------------------ for the router

    def layout(self) -> IndexLayout:
        """Slot classes for the router's walk and per-worker lookup plans (cached until
        a worker, group, kind, block size, window, blocks per chunk or lookahead
        changes)."""
        lay = self._layout
        table = self._table
        if lay is None or table.layout_changed:
            table.layout_changed = False
            lay = self._layout = build_layout(table.workers, self.canonical_block_size)
        return lay

    def marks(self, tier: int) -> Marks:
        """Content key -> bitset of slots holding a block (GPU) or chunk ending there
        (slot bits as in :meth:`layout`).  The live table: read it, never write it."""
        return self._tier_marks[tier]

    # ------------------------------------------------------------------ for tests

    # The property tests check the rooms' tables against a recount; these read-only
    # views keep them independent of the room layout.

    @property
    def _workers(self) -> dict[WorkerId, WorkerState]:
        return self._feed.workers

    @property
    def _retired(self) -> RetainedOrder:
        return self._feed.retention.records

    @property
    def _pending(self) -> dict[EntryKey, list[int]]:
        return self._feed.pending.entries

    @property
    def _npending(self) -> dict[WorkerId, int]:
        return self._feed.pending.per_worker

    @property
    def _tracking(self) -> bool:
        return self._feed.cap.tracking

    @property
    def _qhashes(self) -> list[QueueItem]:
        return self._feed.cap.qhashes

    @property
    def _marks(self) -> tuple[Marks, ...]:
        return self._feed.marks
