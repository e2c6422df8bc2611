"""The block index: which worker holds which prefix on which tier, as rooms.

=================  ================================================================
``block_index``    :class:`BlockIndex`, the facade: configuration, queries, snapshots
``apply``          the batch apply loop: each event to the rule of its kind
``stores``         ``BlockStored``: metadata records, the GPU/CPU join, learning
``refs``           tier refcounts in and out, residency, clears
``legacy``         vLLM <= 0.23 offload events (bytes hashes, no group)
``marks``          content key -> slot bitsets per tier, counted
``join``           the pending table and the retention of GPU-removed metadata
``eviction``       the memory cap: resident count, eviction order and eviction
``layout``         what the router walks: :class:`IndexLayout`, :class:`LookupPlan`
``records``        the packed metadata record encoding
``workers``        per-worker / per-group state, slots, tier and kind vocabulary
``stats``          counters and query result types
``queries``        ``block_info`` / ``summary``
``snapshot``       the versioned snapshot format
=================  ================================================================

Imports point down this table's dependency order (``records``, ``marks``, ``workers``,
``stats`` at the bottom; ``block_index`` at the top); no room reads another's private
names.  Everything public is re-exported here.
"""

from kvevents.consumers.index.block_index import BlockIndex
from kvevents.consumers.index.layout import IndexLayout, LookupPlan, SpecGroup
from kvevents.consumers.index.records import Hash
from kvevents.consumers.index.stats import (
    BlockInfo,
    ChunkSpan,
    IndexStats,
    TierSummary,
    WorkerSummary,
)
from kvevents.consumers.index.workers import TIERS, WorkerId

__all__ = [
    "TIERS",
    "BlockIndex",
    "BlockInfo",
    "ChunkSpan",
    "Hash",
    "IndexLayout",
    "IndexStats",
    "LookupPlan",
    "SpecGroup",
    "TierSummary",
    "WorkerId",
    "WorkerSummary",
]
