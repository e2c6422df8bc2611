"""The rules publisher settings obey, shared by ``KVEventsConfig`` and ``ZmqEventPublisher``.

One job: check setting values and raise :class:`~kvevents.errors.ConfigError` with a
message naming the setting and the rule, so that a value is judged the same whether it
comes through a config (``--kv-events-config``) or a constructor call.  Imports only
:mod:`kvevents.errors` and :mod:`kvevents.endpoints`; nothing in ``publishers`` (so both
the config and the publisher can import it without a cycle).
"""

from __future__ import annotations

from kvevents.endpoints import validate_endpoint
from kvevents.errors import ConfigError

__all__ = [
    "check_count",
    "check_int",
    "check_seconds",
    "validate_publisher_fields",
    "validate_zmq_tuning",
]


def check_int(name: str, value: object, minimum: int) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an ``int`` (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


def check_count(name: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an ``int`` (not a bool) ``>= 1``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")


def check_seconds(name: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a number of seconds ``>= 0``."""
    if not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")


def validate_publisher_fields(
    *,
    endpoint: object,
    replay_endpoint: object,
    buffer_steps: object,
    hwm: object,
    max_queue_size: object,
    topic: object,
    curve_secret_key_file: object,
    curve_authorized_keys_dir: object,
) -> None:
    """Check the socket fields of ``KVEventsConfig`` (all but the switch and the kind).

    Rules, in this order: ``endpoint`` and ``replay_endpoint`` (unless ``None``) are ZMQ
    endpoints (:func:`~kvevents.endpoints.validate_endpoint`); ``buffer_steps`` (batches)
    and ``hwm`` (messages) are ints ``>= 0``; ``max_queue_size`` (batches) an int
    ``>= 1``; ``topic`` a string; each CURVE field ``None`` or a non-empty path string,
    and ``curve_authorized_keys_dir`` only with ``curve_secret_key_file``.  Raises
    :class:`ConfigError` on the first value that breaks a rule.
    """
    validate_endpoint(endpoint, "endpoint")
    if replay_endpoint is not None:
        validate_endpoint(replay_endpoint, "replay_endpoint")
    check_int("buffer_steps", buffer_steps, 0)
    check_int("hwm", hwm, 0)
    check_int("max_queue_size", max_queue_size, 1)
    if not isinstance(topic, str):
        raise ConfigError(f"topic must be a string, got {type(topic).__name__} {topic!r}")
    for name, value in (
        ("curve_secret_key_file", curve_secret_key_file),
        ("curve_authorized_keys_dir", curve_authorized_keys_dir),
    ):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{name} must be a non-empty path string or null, got {value!r}")
    if curve_authorized_keys_dir is not None and curve_secret_key_file is None:
        raise ConfigError(
            "curve_authorized_keys_dir needs curve_secret_key_file (the publisher's "
            ".key_secret file) as well"
        )


def validate_zmq_tuning(
    topic: str,
    *,
    counts: dict[str, object],
    seconds: dict[str, object],
) -> None:
    """Check ``ZmqEventPublisher``'s keyword-only tuning (not part of vLLM's config).

    ``counts`` maps each count or size setting (``track_every``, ``replay_slice``,
    ``replay_max_reply_bytes`` …) to its value, which must be an int ``>= 1``;
    ``replay_max_message_bytes`` (when given) must be ``>= 64`` (a request is 8 bytes
    plus framing) and ``max_subscription_bytes`` (when given) must exceed the UTF-8
    length of ``topic`` (a subscription is the topic prefix plus one byte).
    ``seconds`` maps each duration setting to its value, a number ``>= 0``.  Raises
    :class:`ConfigError` on the first value that breaks a rule.
    """
    for name, value in counts.items():
        check_count(name, value)
    message_bytes = counts.get("replay_max_message_bytes")
    if isinstance(message_bytes, int) and message_bytes < 64:
        raise ConfigError(
            f"replay_max_message_bytes must be >= 64 (a request is 8 bytes plus "
            f"framing), got {message_bytes}"
        )
    subscription_bytes = counts.get("max_subscription_bytes")
    if isinstance(subscription_bytes, int) and subscription_bytes <= len(topic.encode("utf-8")):
        raise ConfigError(
            f"max_subscription_bytes must exceed the topic's length (a subscription "
            f"is the topic prefix plus one byte), got {subscription_bytes}"
        )
    for name, value in seconds.items():
        check_seconds(name, value)
