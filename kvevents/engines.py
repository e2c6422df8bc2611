"""Engine specifications as the command line and config files name them.

One engine is one publisher of KV events (one vLLM API server), written
``NAME=HTTP_URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT][;dp=N][;topic=T]``:

* ``NAME`` matches ``[A-Za-z0-9_-]+`` (it is also a NATS subject token);
* ``HTTP_URL`` (``http://`` or ``https://``) is where its OpenAI server answers; commands
  that only follow events accept the spec without it (``NAME=EVENTS[,REPLAY]``), told
  apart by scheme, and commands that only forward HTTP accept ``NAME=HTTP_URL`` alone;
* ``EVENTS_ENDPOINT`` / ``REPLAY_ENDPOINT`` are the ZMQ endpoints of its publisher;
* ``;dp=N`` says the engine runs ``N`` data-parallel ranks; rank ``r`` publishes on the
  endpoints offset by vLLM's rule (:func:`~kvevents.endpoints.offset_endpoint`, re-exported here: tcp port + r);
* ``;topic=T`` subscribes to topic ``T`` only (several engines behind one proxy).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvevents.endpoints import offset_endpoint
from kvevents.errors import ConfigError

__all__ = ["ENGINE_NAME_RE", "EngineSpec", "offset_endpoint", "parse_engine_spec"]

ENGINE_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
"""What an engine name may contain."""

_HTTP = ("http://", "https://")
_ZMQ = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its name, HTTP front, event endpoints, DP ranks and topic."""

    name: str
    http_url: str | None = None
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    dp_size: int = 1
    topic: str = ""

    def __post_init__(self) -> None:
        if not ENGINE_NAME_RE.match(self.name):
            raise ConfigError(
                f"engine name {self.name!r} may contain only letters, digits, '_' and '-'"
            )
        if self.dp_size < 1:
            raise ConfigError(f"engine {self.name}: dp must be >= 1, not {self.dp_size}")
        if self.replay_endpoint is not None and self.events_endpoint is None:
            raise ConfigError(f"engine {self.name}: a replay endpoint needs an events endpoint")

    def rank_endpoints(self) -> list[tuple[int, str, str | None]]:
        """``(rank, events_endpoint, replay_endpoint)`` of every DP rank, by vLLM's offsets."""
        if self.events_endpoint is None:
            raise ConfigError(f"engine {self.name} has no events endpoint")
        out: list[tuple[int, str, str | None]] = []
        for r in range(self.dp_size):
            ev = offset_endpoint(self.events_endpoint, r)
            assert ev is not None
            out.append((r, ev, offset_endpoint(self.replay_endpoint, r)))
        return out


def parse_engine_spec(
    text: str, *, require_http: bool = False, require_events: bool = False
) -> EngineSpec:
    """Parse ``NAME=HTTP_URL,EVENTS[,REPLAY][;dp=N][;topic=T]`` (see the module docstring).

    ``require_http`` / ``require_events`` make the HTTP URL / events endpoint mandatory.
    Raises :class:`ConfigError` with one line saying what is wrong.
    """
    usage = "expected NAME=HTTP_URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT][;dp=N][;topic=T]"
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ConfigError(f"engine {text!r}: {usage}")
    main, *options = rest.split(";")
    dp, topic = 1, ""
    for opt in options:
        key, eq, value = opt.partition("=")
        key = key.strip()
        if key == "dp" and eq:
            if not value.strip().isdigit():
                raise ConfigError(f"engine {name}: dp must be a positive integer, not {value!r}")
            dp = int(value)
        elif key == "topic" and eq:
            topic = value
        else:
            raise ConfigError(f"engine {name}: unknown option {opt!r} (known: dp=N, topic=T)")
    parts = [p.strip() for p in main.split(",") if p.strip()]
    http: str | None = None
    if parts and parts[0].startswith(_HTTP):
        http = parts.pop(0)
    for p in parts:
        if not p.startswith(_ZMQ):
            raise ConfigError(
                f"engine {name}: {p!r} is not a ZMQ endpoint (tcp://, ipc://, inproc://); {usage}"
            )
    if len(parts) > 2:
        raise ConfigError(f"engine {name}: too many endpoints; {usage}")
    events = parts[0] if parts else None
    replay = parts[1] if len(parts) > 1 else None
    if require_http and http is None:
        raise ConfigError(f"engine {name}: missing the HTTP URL (http://HOST:PORT); {usage}")
    if require_events and events is None:
        raise ConfigError(f"engine {name}: missing the events endpoint (tcp://HOST:PORT); {usage}")
    if http is None and events is None:
        raise ConfigError(f"engine {text!r}: {usage}")
    return EngineSpec(name, http, events, replay, dp, topic)
