"""Building publishers from a :class:`KVEventsConfig`, with vLLM's DP endpoint offsets.

``create_publisher(config, data_parallel_rank)`` mirrors vLLM's
``EventPublisherFactory.create`` (C§2.4): a missing or disabled config, or
``publisher="null"``, gives a :class:`NullEventPublisher`; otherwise the registered
constructor for ``config.publisher`` is called as
``ctor(data_parallel_rank=rank, endpoint=…, replay_endpoint=…, buffer_steps=…, hwm=…,
max_queue_size=…, topic=…)``, plus the CURVE fields when they are set.  The ZMQ publisher offsets both endpoints by the rank
itself (:func:`offset_endpoint`), so every data-parallel rank gets its own sockets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvevents.engines import offset_endpoint
from kvevents.errors import ConfigError
from kvevents.publishers.base import EventPublisher, NullEventPublisher
from kvevents.publishers.config import KVEVENTS_ONLY_FIELDS, KVEventsConfig

__all__ = [
    "PublisherConstructor",
    "create_publisher",
    "offset_endpoint",
    "register_publisher",
    "registered_publishers",
]

PublisherConstructor = Callable[..., EventPublisher]
"""``ctor(data_parallel_rank=int, **config_fields_except_publisher_and_enable)``."""

_REGISTRY_LOCK = threading.Lock()
_REGISTRY: dict[str, PublisherConstructor] = {}


def _make_zmq(data_parallel_rank: int = 0, **kwargs: object) -> EventPublisher:
    # Imported lazily so that importing the factory does not open pyzmq.
    from kvevents.publishers.zmq_publisher import ZmqEventPublisher

    return ZmqEventPublisher(data_parallel_rank=data_parallel_rank, **kwargs)  # type: ignore[arg-type]


def register_publisher(name: str, ctor: PublisherConstructor) -> None:
    """Add a publisher kind usable as ``KVEventsConfig(publisher=name)``.

    ``ctor`` is called with ``data_parallel_rank`` and the config fields other than
    ``publisher`` and ``enable_kv_cache_events``, as keyword arguments.  Raises
    ``KeyError`` if ``name`` is already registered (as vLLM does) and
    :class:`ConfigError` if ``name`` is not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"publisher name must be a non-empty string, got {name!r}")
    with _REGISTRY_LOCK:
        if name in _REGISTRY:
            raise KeyError(f"publisher {name!r} is already registered")
        _REGISTRY[name] = ctor


def registered_publishers() -> tuple[str, ...]:
    """The registered publisher kinds, in registration order."""
    with _REGISTRY_LOCK:
        return tuple(_REGISTRY)


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
    with _REGISTRY_LOCK:
        ctor = _REGISTRY.get(config.publisher or "")
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


register_publisher("null", NullEventPublisher)
register_publisher("zmq", _make_zmq)
