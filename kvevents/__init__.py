"""kvevents: a vLLM-compatible bridge for LLM KV-cache events.

The core (this package's top level) is the wire contract: the event classes, the codec
and frame helpers, capture files, block hashing and the error hierarchy.  The engine
side lives in :mod:`kvevents.publishers`, the router side in :mod:`kvevents.consumers`.
"""

# First: picks the compiled core or the pure modules before any of them is imported.
import kvevents.compiled  # noqa: F401
from kvevents.capture import (
    CAPTURE_FORMAT_VERSION,
    CaptureReader,
    CaptureRecord,
    CaptureWriter,
    read_capture,
)
from kvevents.codec import (
    END_SEQ,
    BatchDecoder,
    DecodeStats,
    LiveMessage,
    ReplayReply,
    WireShape,
    decode_batch,
    describe_payload,
    encode_batch,
    pack_live,
    pack_replay_end,
    pack_replay_reply,
    pack_replay_request,
    pack_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    unpack_seq,
)
from kvevents.errors import (
    CaptureError,
    ConfigError,
    DecodeError,
    EncodeError,
    FrameError,
    KVEventsError,
    MetricsError,
    MissingDependencyError,
    OffloadError,
    PublisherClosedError,
)
from kvevents.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
)
from kvevents.request import MMFeature, RequestKey
from kvevents.version import __version__

__all__ = [
    "CAPTURE_FORMAT_VERSION",
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BatchDecoder",
    "BlockRemoved",
    "BlockStored",
    "CaptureError",
    "CaptureReader",
    "CaptureRecord",
    "CaptureWriter",
    "ConfigError",
    "DecodeError",
    "DecodeStats",
    "EncodeError",
    "EventBatch",
    "ExternalBlockHash",
    "FrameError",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "KVEventsError",
    "LiveMessage",
    "MMFeature",
    "MetricsError",
    "MissingDependencyError",
    "OffloadError",
    "PublisherClosedError",
    "ReplayReply",
    "RequestKey",
    "WireShape",
    "__version__",
    "decode_batch",
    "describe_payload",
    "encode_batch",
    "pack_live",
    "pack_replay_end",
    "pack_replay_reply",
    "pack_replay_request",
    "pack_seq",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "read_capture",
    "unpack_seq",
]
