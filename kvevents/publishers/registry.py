"""The publisher kinds ``KVEventsConfig(publisher=...)`` may name, and their constructors.

One job: a thread-safe map from kind to constructor, holding the built-in kinds
(``"null"`` and ``"zmq"``) from import on.  Imports the publishers it registers
(:mod:`~kvevents.publishers.base`, :mod:`~kvevents.publishers.zmq_publisher`) and
nothing that imports it back: the config imports this module to check a kind, the
factory to build one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvevents.errors import ConfigError, DuplicateNameError
from kvevents.publishers.base import EventPublisher, NullEventPublisher
from kvevents.publishers.zmq_publisher import ZmqEventPublisher

__all__ = [
    "PUBLISHERS",
    "PublisherConstructor",
    "PublisherRegistry",
    "register_publisher",
    "registered_publishers",
]

PublisherConstructor = Callable[..., EventPublisher]
"""``ctor(data_parallel_rank=int, **config_fields_except_publisher_and_enable)``."""


class PublisherRegistry:
    """Publisher kinds and their constructors, in registration order; thread-safe.

    ``lock`` guards ``constructors``; hold it to read or change the map directly.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.constructors: dict[str, PublisherConstructor] = {}

    def register(self, name: str, ctor: PublisherConstructor) -> None:
        """Add kind ``name``; see :func:`register_publisher` for the errors."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"publisher name must be a non-empty string, got {name!r}")
        with self.lock:
            if name in self.constructors:
                raise DuplicateNameError(f"publisher {name!r} is already registered")
            self.constructors[name] = ctor

    def kinds(self) -> tuple[str, ...]:
        """The registered kinds, in registration order."""
        with self.lock:
            return tuple(self.constructors)

    def get(self, name: str) -> PublisherConstructor | None:
        """The constructor of kind ``name``, or ``None`` when it is not registered."""
        with self.lock:
            return self.constructors.get(name)


PUBLISHERS = PublisherRegistry()
"""The process-wide registry that configs and :func:`create_publisher` consult."""


def register_publisher(name: str, ctor: PublisherConstructor) -> None:
    """Add a publisher kind usable as ``KVEventsConfig(publisher=name)``.

    ``ctor`` is called with ``data_parallel_rank`` and the config fields other than
    ``publisher`` and ``enable_kv_cache_events``, as keyword arguments.  Raises
    :class:`~kvevents.errors.DuplicateNameError` (a ``KeyError``, as vLLM raises) if
    ``name`` is already registered and :class:`ConfigError` if ``name`` is not a
    non-empty string.
    """
    PUBLISHERS.register(name, ctor)


def registered_publishers() -> tuple[str, ...]:
    """The registered publisher kinds, in registration order."""
    return PUBLISHERS.kinds()


register_publisher("null", NullEventPublisher)
register_publisher("zmq", ZmqEventPublisher)
