"""Building publishers from a :class:`KVEventsConfig`, with vLLM's DP endpoint offsets.

``create_publisher(config, data_parallel_rank)`` mirrors vLLM's
``EventPublisherFactory.create``: a missing or disabled config, or
``publisher="null"``, gives a :class:`NullEventPublisher`; otherwise the registered
constructor for ``config.publisher`` is called as
``ctor(data_parallel_rank=rank, endpoint=…, replay_endpoint=…, buffer_steps=…, hwm=…,
max_queue_size=…, topic=…)``, plus the CURVE fields when they are set.  The ZMQ publisher offsets both endpoints by the rank
itself (:func:`offset_endpoint`), so every data-parallel rank gets its own sockets.

The kinds live in :mod:`kvevents.publishers.registry` (``register_publisher`` and
``registered_publishers`` are re-exported here); this module imports the config, the
registry and :mod:`kvevents.endpoints`, and nothing imports it back.
"""

from __future__ import annotations

from kvevents.endpoints import offset_endpoint
from kvevents.errors import ConfigError
from kvevents.publishers.base import EventPublisher, NullEventPublisher
from kvevents.publishers.config import KVEVENTS_ONLY_FIELDS, KVEventsConfig
from kvevents.publishers.registry import (
    PUBLISHERS,
    PublisherConstructor,
    register_publisher,
    registered_publishers,
)

__all__ = [
    "PublisherConstructor",
    "create_publisher",
    "offset_endpoint",
    "register_publisher",
    "registered_publishers",
]

# The registry's map and lock under the names this module had when it owned them.
_REGISTRY = PUBLISHERS.constructors
_REGISTRY_LOCK = PUBLISHERS.lock


def create_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
    """Build the publisher ``config`` asks for, for data-parallel rank ``data_parallel_rank``.

    Returns a :class:`NullEventPublisher` when ``config`` is ``None``, events are
    disabled, or ``config.publisher == "null"``.  Raises :class:`ConfigError` for an
    unknown kind or a rank that the endpoints cannot be offset for.
    """
    if isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, int):
        raise ConfigError(f"data_parallel_rank must be an int, got {data_parallel_rank!r}")
    if data_parallel_rank < 0:
        raise ConfigError(f"data_parallel_rank must be >= 0, got {data_parallel_rank}")
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher(data_parallel_rank=data_parallel_rank)
    ctor = PUBLISHERS.get(config.publisher or "")
    if ctor is None:
        raise ConfigError(
            f"unknown publisher {config.publisher!r}; registered: "
            f"{', '.join(repr(k) for k in registered_publishers())}"
        )
    kwargs = config.to_dict()
    del kwargs["publisher"], kwargs["enable_kv_cache_events"]
    # kvevents' own fields reach the constructor only when set, so a constructor with
    # vLLM's signature keeps working.
    for name in KVEVENTS_ONLY_FIELDS:
        if kwargs.get(name) is None:
            kwargs.pop(name, None)
    return ctor(data_parallel_rank=data_parallel_rank, **kwargs)
