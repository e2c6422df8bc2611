"""The kvevents error hierarchy.

Every exception that kvevents raises on purpose derives from :class:`KVEventsError`,
so a caller can catch the whole family with one ``except`` clause.  Classes that also
derive from a builtin (``ValueError``, ``TypeError``, ``RuntimeError``) do so where
Python code conventionally expects that builtin, so ``except ValueError`` written against
an older kvevents keeps working.
"""

from __future__ import annotations

__all__ = [
    "CaptureError",
    "ConfigError",
    "DecodeError",
    "DuplicateNameError",
    "EncodeError",
    "FrameError",
    "KVEventsError",
    "MetricsError",
    "MissingDependencyError",
    "OffloadError",
    "PublisherClosedError",
]


class KVEventsError(Exception):
    """Root of every error kvevents raises deliberately."""


class DecodeError(KVEventsError, ValueError):
    """A payload is not a KV event batch in any shape kvevents accepts.

    The message says what is wrong and where (a JSON-path-like location such as
    ``$[1][0].block_size``).
    """


class FrameError(DecodeError):
    """A ZMQ multipart message does not have the frame layout of vLLM's publisher.

    A live message is ``(topic, seq, payload)`` (as vLLM's
    ``ZmqEventPublisher._publisher_thread`` sends it); a replay reply is ``(seq, payload)``,
    the last one ``(END_SEQ, b"")`` (``ZmqEventPublisher._service_replay``).
    """


class ConfigError(KVEventsError, ValueError):
    """A configuration value is invalid (unknown kind, malformed endpoint, ...)."""


class PublisherClosedError(KVEventsError, RuntimeError):
    """``publish()`` was called after ``shutdown()``."""


class CaptureError(KVEventsError):
    """A capture file cannot be read or written (bad header, corrupt record)."""


class OffloadError(KVEventsError):
    """Misuse of the offloading manager or a cache policy (unknown policy, bad key)."""


class EncodeError(KVEventsError, TypeError):
    """An object cannot be encoded as a KV event batch."""


class MetricsError(KVEventsError, TypeError):
    """An object cannot be exposed as metrics: it has no dataclass ``.stats``."""


class MissingDependencyError(KVEventsError, ImportError):
    """An optional dependency is not installed; the message names the extra to install
    (for example ``pip install 'kvevents[offload]'`` for torch)."""


def require_module(module: str, extra: str, what: str) -> None:
    """Raise :class:`MissingDependencyError` if ``module`` cannot be imported.

    ``what`` says what needs it ("the byte transfers"); ``extra`` is the
    ``kvevents[extra]`` that installs it.
    """
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a stub module
        found = False
    if not found:
        raise MissingDependencyError(
            f"{what} needs {module}, which is not installed: pip install 'kvevents[{extra}]'"
        )


class DuplicateNameError(KVEventsError, KeyError):
    """A publisher kind is registered twice.

    Also a ``KeyError``, which is what vLLM raises for a duplicate registration."""
