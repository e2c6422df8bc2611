"""Router side: the subscriber SDK, the block index and the KV-aware router.

Never imports torch or :mod:`kvevents.publishers`.
"""

from kvevents.consumers.aio import AsyncSubscriber
from kvevents.consumers.capture_source import CaptureSource
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
from kvevents.consumers.router import (
    Candidate,
    Match,
    PendingOverlay,
    PendingStats,
    Router,
    TierWeights,
)
from kvevents.consumers.source_protocol import Source, SourceMessage
from kvevents.consumers.subscriber import (
    ANOMALY_KINDS,
    Anomaly,
    ReceivedBatch,
    Subscriber,
    SubscriberItem,
    SubscriberOptions,
    SubscriberStats,
)
from kvevents.consumers.zmq_source import ZmqSource
from kvevents.seqtrack import StreamTracker

__all__ = [
    "ANOMALY_KINDS",
    "TIERS",
    "Anomaly",
    "AsyncSubscriber",
    "BlockIndex",
    "BlockInfo",
    "Candidate",
    "CaptureSource",
    "ChunkSpan",
    "IndexStats",
    "Match",
    "PendingOverlay",
    "PendingStats",
    "ReceivedBatch",
    "Router",
    "Source",
    "SourceMessage",
    "StreamTracker",
    "Subscriber",
    "SubscriberItem",
    "SubscriberOptions",
    "SubscriberStats",
    "TierSummary",
    "TierWeights",
    "WorkerId",
    "WorkerSummary",
    "ZmqSource",
]
