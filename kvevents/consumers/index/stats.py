"""What the index reports: its counters and the answers of its queries.

One job: the public result types (:class:`IndexStats`, :class:`BlockInfo`,
:class:`ChunkSpan`, :class:`TierSummary`, :class:`WorkerSummary`).  Imports only
:mod:`.records` and :mod:`.workers` (for type names).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvevents.consumers.index.records import Hash
from kvevents.consumers.index.workers import WorkerId

__all__ = ["BlockInfo", "ChunkSpan", "IndexStats", "TierSummary", "WorkerSummary"]


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
    """The chunk a CPU/STORAGE tail hash stands for (vLLM's ``make_offload_key`` keys a
    chunk by its last hash)."""

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
