"""Router side: the subscriber SDK, the block index and the KV-aware router.

Never imports torch or :mod:`kvevents.publishers`.
"""

from kvevents.consumers.index import (
    TIERS,
    BlockIndex,
    BlockInfo,
    ChunkSpan,
    IndexStats,
    TierSummary,
    WorkerId,
    WorkerSummary,
)
from kvevents.consumers.router import Candidate, Match, Router, TierWeights

__all__ = [
    "TIERS",
    "BlockIndex",
    "BlockInfo",
    "Candidate",
    "ChunkSpan",
    "IndexStats",
    "Match",
    "Router",
    "TierSummary",
    "TierWeights",
    "WorkerId",
    "WorkerSummary",
]
