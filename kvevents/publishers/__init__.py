"""Engine side: event publishers (vLLM's ``EventPublisher`` and ``ZmqEventPublisher``).

``create_publisher(KVEventsConfig(...), data_parallel_rank)`` gives an
:class:`EventPublisher`; call ``publish(batch)`` once per engine step with events and
``shutdown()`` at exit.  The CPU offloading manager lives in
``kvevents.publishers.offload`` (imported separately; it is not loaded here).
"""

from kvevents.publishers.base import EventPublisher, NullEventPublisher, NullPublisherStats
from kvevents.publishers.config import CLI_FLAG, ZMQ_TRANSPORTS, KVEventsConfig, validate_endpoint
from kvevents.publishers.factory import (
    PublisherConstructor,
    create_publisher,
    offset_endpoint,
    register_publisher,
    registered_publishers,
)
from kvevents.publishers.zmq_publisher import PublisherStats, ZmqEventPublisher, is_bind_endpoint

__all__ = [
    "CLI_FLAG",
    "ZMQ_TRANSPORTS",
    "EventPublisher",
    "KVEventsConfig",
    "NullEventPublisher",
    "NullPublisherStats",
    "PublisherConstructor",
    "PublisherStats",
    "ZmqEventPublisher",
    "create_publisher",
    "is_bind_endpoint",
    "offset_endpoint",
    "register_publisher",
    "registered_publishers",
    "validate_endpoint",
]
