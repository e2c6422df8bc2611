"""kvevents: a vLLM-compatible bridge for LLM KV-cache events.

The top level exports what an application needs of the core: the event classes, the
codec (:func:`encode_batch`, :func:`decode_batch`, :class:`BatchDecoder`), capture files,
the request key and the error hierarchy.  The ZMQ frame helpers live in
:mod:`kvevents.codec`, block hashing in :mod:`kvevents.hashing`.  The engine side lives
in :mod:`kvevents.publishers`, the router side in :mod:`kvevents.consumers`.
"""

from kvevents.capture import (
    CAPTURE_FORMAT_VERSION,
    CaptureReader,
    CaptureRecord,
    CaptureWriter,
    read_capture,
)
from kvevents.codec import (
    BatchDecoder,
    DecodeStats,
    WireShape,
    decode_batch,
    describe_payload,
    encode_batch,
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
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
)
from kvevents.request import MMFeature, RequestKey
from kvevents.version import __version__

__all__ = [
    "CAPTURE_FORMAT_VERSION",
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
    "ExternalBlockHash",
    "FrameError",
    "KVEvent",
    "KVEventBatch",
    "KVEventsError",
    "MMFeature",
    "MetricsError",
    "MissingDependencyError",
    "OffloadError",
    "PublisherClosedError",
    "RequestKey",
    "WireShape",
    "__version__",
    "decode_batch",
    "describe_payload",
    "encode_batch",
    "read_capture",
]
