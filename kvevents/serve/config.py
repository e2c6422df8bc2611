"""Configuration of ``kvevents serve``: the engines and the service options.

An engine is named on the command line as
``NAME=HTTP_URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT][;dp=N][;rank=R][;topic=T][;role=ROLE]``
(repeatable), in a TOML file (``[[engine]]`` tables with ``name``, ``url``, ``events``,
``replay``, ``dp``, ``rank``, ``topic``, ``role``; service options at the top level or under ``[serve]``), and overridden by the
environment (``KVEVENTS_SERVE_HOST``, ``KVEVENTS_SERVE_PORT``, ``KVEVENTS_SERVE_POLICY``,
``KVEVENTS_SERVE_ENGINES``: engine specs separated by whitespace).

The engine spec type and its parser are :mod:`kvevents.engines`' (one for every
command); :class:`EngineSpec` and :func:`parse_engine_spec` are re-exported here.  ``dp=N``
and ``rank=R`` make one entry stand for global data-parallel ranks ``R..R+N-1`` behind one
HTTP front (see :mod:`kvevents.engines` for what to give in each of vLLM's modes).

Nothing here needs the ``serve`` extra.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvevents.consumers.router.pending import DEFAULT_PENDING_WEIGHT
from kvevents.engines import EngineSpec, parse_engine_spec
from kvevents.errors import ConfigError

__all__ = [
    "POLICIES",
    "EngineSpec",
    "ServeConfig",
    "load_config",
    "parse_engine_spec",
]

POLICIES: tuple[str, ...] = ("kv-aware", "kv-aware-gpu", "round-robin", "random")
"""Routing policies: KV-aware over every tier, KV-aware on the GPU tier only, and two
baselines that ignore the cache."""


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``kvevents serve`` runs with.

    * ``policy``: one of :data:`POLICIES`.
    * ``tokenizer``: a local tokenizer file used instead of the engines' ``/tokenize``.
    * ``blocks_per_chunk``: GPU blocks per CPU chunk of the engines (None: learned).
    * ``load_tokens``: what one request already in flight on an engine costs a new one,
      in prompt tokens (the router trades reuse against this).
    * ``scrape_interval_s``: how often engines' ``/metrics`` are read.
    * ``scrape_timeout_s``: how long one ``/metrics`` read may take (connect and answer).
    * ``scrape_failures``: consecutive failed scrapes that mark an engine down (a failed
      request marks it down at once); an engine that is gone is so marked within about
      ``scrape_failures`` x ``scrape_interval_s`` seconds (plus ``scrape_timeout_s`` per
      scrape when it stops answering rather than refusing).
    * ``request_timeout_s``: upstream timeout; ``connect_timeout_s`` the connect part.
    * ``retry_after_s``: how long an engine marked down is skipped before it is tried again.
    * ``stale_after_s``: an engine rank whose stream brings no event and whose replay
      endpoint does not answer a probe for this long is untrusted (routed by load alone)
      until its events return.
    * ``bootstrap_from``: a running service's URL; its ``/snapshot`` (index and resume
      points) is restored at start, and each stream caught up from its point.
    * ``admin_token``: the bearer token ``/snapshot`` requires (without one, only a
      service listening on loopback answers it).
    * ``ready_when_incomplete``: ``/readyz`` does not wait for every engine's index to be
      complete.
    * ``pd_min_uncached_tokens``: in a fleet with ``prefill`` and ``decode`` engines, a
      request is disaggregated only when the best prefill engine would compute at least
      this many prompt tokens; shorter work is served whole by a decode-capable engine.
    """

    engines: tuple[EngineSpec, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "kv-aware"
    tokenizer: str | None = None
    blocks_per_chunk: int | None = None
    load_tokens: float = 64.0
    scrape_interval_s: float = 1.0
    scrape_timeout_s: float = 2.0
    scrape_failures: int = 3
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    retry_after_s: float = 2.0
    replay_timeout_s: float = 5.0
    seed: int = 0
    nats_url: str | None = None
    """Read the engines' events from this NATS JetStream server (written there by
    ``kvevents relay``) instead of their ZMQ sockets; engines are then ``NAME=HTTP_URL``
    with NAME as the relay names them."""
    nats_stream: str = "KV_EVENTS"
    stale_after_s: float = 30.0
    bootstrap_from: str | None = None
    admin_token: str | None = None
    ready_when_incomplete: bool = False
    pending_weight: float = DEFAULT_PENDING_WEIGHT
    """What a token the service just routed to a rank (pending, not yet confirmed by its
    events) is worth against a reused one; 0 turns the pending overlay off."""
    pending_ttl_s: float = 10.0
    """How long a reservation lives at most."""
    pending_max_bytes: int = 32 << 20
    """Memory bound of the pending overlay (estimated bytes; 4096 reservations at most)."""
    pending_nats: str | None = None
    """NATS server the replicas exchange reservations on (default: ``nats_url``; none:
    this service sees only its own)."""
    replica: str | None = None
    """This replica's name on the exchange (default: host:port and a random suffix)."""
    pd_min_uncached_tokens: int = 256

    def validate(self) -> None:
        """Raise :class:`ConfigError` for an unusable configuration."""
        if not self.engines:
            raise ConfigError("no engines: give --engine NAME=HTTP_URL,EVENTS[,REPLAY] or --config")
        if self.nats_url is None:
            for e in self.engines:
                if e.events_endpoint is None:
                    raise ConfigError(
                        f"engine {e.name}: no events endpoint (NAME=HTTP_URL,EVENTS[,REPLAY]), "
                        "and no --nats stream to read its events from"
                    )
        for e in self.engines:
            if e.http_url is None:
                raise ConfigError(f"engine {e.name}: missing the HTTP URL (http://HOST:PORT)")
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ConfigError(f"engine names must be unique: {names}")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}: one of {', '.join(POLICIES)}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} out of range")
        if self.load_tokens < 0 or self.scrape_interval_s <= 0 or self.retry_after_s < 0:
            raise ConfigError("load_tokens, retry_after_s must be >= 0; scrape_interval_s > 0")
        if not self.scrape_timeout_s > 0 or self.scrape_failures < 1:
            raise ConfigError("scrape_timeout_s must be > 0 and scrape_failures >= 1")
        if self.blocks_per_chunk is not None and self.blocks_per_chunk < 1:
            raise ConfigError("blocks_per_chunk must be >= 1")
        if not self.stale_after_s > 0:
            raise ConfigError(f"stale_after_s must be > 0, not {self.stale_after_s}")
        if self.bootstrap_from is not None and self.nats_url is not None:
            raise ConfigError("--bootstrap-from follows ZMQ streams: not with --nats")
        if not (0 <= self.pending_weight < float("inf")) or not self.pending_ttl_s > 0:
            raise ConfigError("pending_weight must be >= 0 and finite, pending_ttl_s > 0")
        if self.pd_min_uncached_tokens < 0:
            raise ConfigError("pd_min_uncached_tokens must be >= 0")
        if self.pending_max_bytes < 1 << 16:
            raise ConfigError("pending_max_bytes must be >= 65536")


_OPTION_TYPES: dict[str, type] = {
    "host": str,
    "port": int,
    "policy": str,
    "tokenizer": str,
    "blocks_per_chunk": int,
    "load_tokens": float,
    "scrape_interval_s": float,
    "scrape_timeout_s": float,
    "scrape_failures": int,
    "request_timeout_s": float,
    "connect_timeout_s": float,
    "retry_after_s": float,
    "replay_timeout_s": float,
    "seed": int,
    "nats_url": str,
    "nats_stream": str,
    "stale_after_s": float,
    "bootstrap_from": str,
    "admin_token": str,
    "ready_when_incomplete": bool,
    "pending_weight": float,
    "pending_ttl_s": float,
    "pending_max_bytes": int,
    "pending_nats": str,
    "replica": str,
    "pd_min_uncached_tokens": int,
}

_ENV = {
    "KVEVENTS_SERVE_HOST": "host",
    "KVEVENTS_SERVE_PORT": "port",
    "KVEVENTS_SERVE_POLICY": "policy",
    "KVEVENTS_SERVE_TOKENIZER": "tokenizer",
    "KVEVENTS_SERVE_LOAD_TOKENS": "load_tokens",
    "KVEVENTS_SERVE_ADMIN_TOKEN": "admin_token",
    "KVEVENTS_SERVE_PENDING_WEIGHT": "pending_weight",
}


def _read_toml(path: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError as exc:
            raise ConfigError("reading a TOML config on Python 3.10 needs 'tomli'") from exc
    try:
        with open(path, "rb") as f:
            data: dict[str, Any] = tomllib.load(f)
            return data
    except OSError as exc:
        raise ConfigError(f"cannot read config {path!r}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path!r} is not valid TOML: {exc}") from exc


_KIND_NAMES = {int: "a whole number", float: "a number", str: "a string"}


def _coerce(key: str, value: Any, where: str) -> Any:
    kind = _OPTION_TYPES[key]
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return text in ("1", "true", "yes", "on")
        raise ConfigError(f"{where}: {key} = {value!r} is not a boolean")
    try:
        if kind is int and isinstance(value, bool):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {key} = {value!r} is not {_KIND_NAMES[kind]}") from None


def _engine_from_table(t: Any, where: str) -> EngineSpec:
    if not isinstance(t, Mapping):
        raise ConfigError(f"{where}: each [[engine]] must be a table")
    unknown = set(t) - {"name", "url", "events", "replay", "dp", "rank", "topic", "role"}
    if unknown or not {"name", "url", "events"} <= set(t):
        raise ConfigError(
            f"{where}: [[engine]] needs name, url, events (optional replay, dp, rank, topic, "
            f"role); unknown keys: {sorted(unknown)}"
        )
    for key in ("dp", "rank"):
        value = t.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigError(f"{where}: [[engine]] {key} = {value!r} is not an integer")
    try:
        return EngineSpec(
            str(t["name"]),
            str(t["url"]),
            str(t["events"]),
            str(t["replay"]) if t.get("replay") else None,
            int(t.get("dp", 1)),
            str(t.get("topic", "")),
            str(t.get("role", "both")),
            int(t.get("rank", 0)),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise ConfigError(f"{where}: {exc}") from None
        raise ConfigError(f"{where}: bad [[engine]] entry {dict(t)!r}: {exc}") from None


def load_config(
    *,
    config_file: str | None = None,
    engines: Sequence[str] = (),
    options: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServeConfig:
    """Build a :class:`ServeConfig`: the TOML file first, then the environment, then the
    command line (``engines`` specs and ``options`` whose value is not None) on top.

    Engines from the command line or ``KVEVENTS_SERVE_ENGINES`` replace the file's.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    specs: list[EngineSpec] = []
    if config_file:
        data = _read_toml(config_file)
        top = dict(data.get("serve", {}))
        top.update({k: v for k, v in data.items() if k not in ("serve", "engine")})
        for key, value in top.items():
            if key not in _OPTION_TYPES:
                raise ConfigError(f"{config_file}: unknown option {key!r}")
            values[key] = _coerce(key, value, config_file)
        tables = data.get("engine", [])
        if not isinstance(tables, list):
            raise ConfigError(f"{config_file}: engines are [[engine]] tables")
        specs = [_engine_from_table(t, config_file) for t in tables]
    for var, key in _ENV.items():
        if env.get(var):
            values[key] = _coerce(key, env[var], var)
    if env.get("KVEVENTS_SERVE_ENGINES"):
        specs = [
            parse_engine_spec(s, require_http=True) for s in env["KVEVENTS_SERVE_ENGINES"].split()
        ]
    if engines:
        specs = [parse_engine_spec(s, require_http=True) for s in engines]
    for key, value in (options or {}).items():
        if value is not None:
            if key not in _OPTION_TYPES:
                raise ConfigError(f"unknown option {key!r}")
            values[key] = _coerce(key, value, "command line")
    config = replace(ServeConfig(), engines=tuple(specs), **values)
    config.validate()
    return config
