"""``KVEventsConfig``: vLLM's KV-event publisher settings, field for field.

The field names and defaults are vLLM's, so a ``--kv-events-config '{json}'`` value
written for vLLM configures kvevents unchanged.  Unlike vLLM's pydantic dataclass, values
are checked strictly (no ``"true"`` for ``True``) and every error is a
:class:`~kvevents.errors.ConfigError` (a ``ValueError``) naming the field and the rule.

Imports the registry (to check the kind), the shared setting rules and the endpoint
rules (:func:`validate_endpoint` and :data:`ZMQ_TRANSPORTS` are re-exported from
:mod:`kvevents.endpoints`); never the factory or a publisher.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvevents.endpoints import ZMQ_TRANSPORTS, validate_endpoint
from kvevents.errors import ConfigError
from kvevents.publishers.registry import registered_publishers
from kvevents.publishers.settings import validate_publisher_fields

__all__ = [
    "CLI_FLAG",
    "KVEVENTS_ONLY_FIELDS",
    "ZMQ_TRANSPORTS",
    "KVEventsConfig",
    "validate_endpoint",
]

CLI_FLAG = "--kv-events-config"
"""vLLM's command-line flag carrying a JSON object of :class:`KVEventsConfig` fields."""

KVEVENTS_ONLY_FIELDS: tuple[str, ...] = ("curve_secret_key_file", "curve_authorized_keys_dir")
"""Config fields vLLM does not have; the factory passes them only when they are set."""


@dataclass
class KVEventsConfig:
    """Settings of the KV-event publisher, named and defaulted exactly as vLLM's.

    * ``enable_kv_cache_events``: master switch; when false the factory returns a
      :class:`~kvevents.publishers.base.NullEventPublisher`.
    * ``publisher``: the publisher kind (``"zmq"``, ``"null"`` or a kind added with
      :func:`~kvevents.publishers.registry.register_publisher`).  ``None`` becomes
      ``"zmq"`` when enabled, else ``"null"``.
    * ``endpoint``: the PUB endpoint.  It binds when it contains ``*`` or ``::`` or is
      ``ipc://`` / ``inproc://``, otherwise it connects (e.g. to a central XSUB).
    * ``replay_endpoint``: the ROUTER replay endpoint (always bound); ``None``: no replay.
    * ``buffer_steps``: how many recent batches the replay buffer keeps (batches, >= 0).
    * ``hwm``: the PUB socket's high-water mark (messages; 0 means no limit).
    * ``max_queue_size``: the in-process queue between ``publish()`` and the sender
      thread (batches, >= 1).  When it is full, ``publish()`` drops the batch.
    * ``topic``: the first frame of every message; SUB sockets filter on its prefix.

    Two fields are kvevents' own (vLLM has no socket security); both default to ``None``,
    which keeps vLLM's behaviour:

    * ``curve_secret_key_file``: the publisher's CURVE secret-key file (the
      ``.key_secret`` that ``zmq.auth.create_certificates`` writes).  When set, the PUB
      and ROUTER sockets require CURVE: only clients that know the matching public key
      can connect, and the traffic is encrypted.
    * ``curve_authorized_keys_dir``: a directory of client public-key files (``*.key``);
      when set, only those clients may connect.  Needs ``curve_secret_key_file``.

    Raises :class:`~kvevents.errors.ConfigError` on any invalid value.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    curve_secret_key_file: str | None = None
    curve_authorized_keys_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError(
                "enable_kv_cache_events must be a bool, got "
                f"{type(self.enable_kv_cache_events).__name__} {self.enable_kv_cache_events!r}"
            )
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if not isinstance(self.publisher, str):
            raise ConfigError(
                f"publisher must be a string, got {type(self.publisher).__name__} "
                f"{self.publisher!r}"
            )
        kinds = registered_publishers()
        if self.publisher not in kinds:
            raise ConfigError(
                f"unknown publisher {self.publisher!r}; expected one of "
                f"{', '.join(repr(k) for k in kinds)} (or register one with register_publisher)"
            )
        validate_publisher_fields(
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            buffer_steps=self.buffer_steps,
            hwm=self.hwm,
            max_queue_size=self.max_queue_size,
            topic=self.topic,
            curve_secret_key_file=self.curve_secret_key_file,
            curve_authorized_keys_dir=self.curve_authorized_keys_dir,
        )

    # --- (de)serialisation ---------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The accepted keys, in declaration order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVEventsConfig:
        """Build a config from a mapping of field names; unknown keys are rejected."""
        if not isinstance(values, dict):
            raise ConfigError(
                f"KV events config must be a JSON object, got {type(values).__name__}"
            )
        known = cls.field_names()
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            raise ConfigError(
                f"unknown KV events config key(s) {', '.join(repr(k) for k in unknown)}; "
                f"valid keys are {', '.join(known)}"
            )
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | bytes) -> KVEventsConfig:
        """Parse the JSON object of ``--kv-events-config '{json}'`` (unknown keys rejected)."""
        try:
            values = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise ConfigError(f"KV events config is not valid JSON: {exc}") from exc
        return cls.from_dict(values)

    @classmethod
    def from_cli(cls, argv: Sequence[str]) -> KVEventsConfig | None:
        """Find ``--kv-events-config JSON`` (or ``--kv-events-config=JSON``) in ``argv``.

        Returns the parsed config, or ``None`` when the flag is absent.  When the flag
        is given more than once the last one wins, as with argparse.  A flag without a
        value raises :class:`ConfigError`.
        """
        found: str | None = None
        i = 0
        while i < len(argv):
            arg = argv[i]
            if arg == CLI_FLAG:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{CLI_FLAG} needs a JSON object value")
                found = argv[i + 1]
                i += 2
                continue
            if arg.startswith(CLI_FLAG + "="):
                found = arg[len(CLI_FLAG) + 1 :]
            i += 1
        return None if found is None else cls.from_json(found)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what vLLM's ``asdict`` gives)."""
        return asdict(self)

    def to_json(self) -> str:
        """The config as the JSON object ``--kv-events-config`` accepts."""
        return json.dumps(self.to_dict())
