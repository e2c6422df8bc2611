"""Engine specifications as the command line and config files name them.

One job: the one :class:`EngineSpec` type and its one parser, shared by ``kvevents
serve`` (:mod:`kvevents.serve.config`), ``kvevents relay`` and the JetStream CLI.  It
imports only :mod:`kvevents.errors` and :mod:`kvevents.endpoints` (whose
:func:`offset_endpoint` it re-exports).

One engine is one HTTP front of vLLM (one API server) and the KV-event publishers of the
data-parallel ranks behind it, written
``NAME=HTTP_URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT][;dp=N][;rank=R][;topic=T][;role=ROLE]``:

* ``NAME`` matches ``[A-Za-z0-9_-]+`` (it is also a NATS subject token);
* ``HTTP_URL`` (``http://`` or ``https://``) is where its OpenAI server answers; commands
  that only follow events accept the spec without it (``NAME=EVENTS[,REPLAY]``), told
  apart by scheme, and commands that only forward HTTP accept ``NAME=HTTP_URL`` alone
  (``kvevents serve --nats``: the events come from JetStream);
* ``EVENTS_ENDPOINT`` / ``REPLAY_ENDPOINT`` are the ZMQ endpoints of its publisher
  (``tcp://``, ``ipc://`` or ``inproc://``) as vLLM's ``kv_events_config`` names them,
  before vLLM moves them for a data-parallel rank;
* ``;dp=N`` says the front serves ``N`` data-parallel ranks, ``;rank=R`` that the first of
  them is global rank ``R`` (default 0): its ranks are ``R..R+N-1`` (:attr:`EngineSpec.ranks`).
  Global rank ``r`` publishes on the endpoints offset by ``r``, vLLM's rule
  (:func:`~kvevents.endpoints.offset_endpoint`: tcp port + r), and tags its batches
  ``data_parallel_rank = r``; a request for it goes to the HTTP URL with the
  ``X-data-parallel-rank: r - R`` header (:meth:`EngineSpec.http_rank`);
* ``;topic=T`` subscribes to topic ``T`` only (several engines behind one proxy);
* ``;role=ROLE`` is what ``kvevents serve`` sends it in a prefill/decode disaggregated fleet:
  ``prefill`` (the first step of a disaggregated request), ``decode`` (the second, fed the
  prefill engine's KV through vLLM's KV connector) or ``both`` (the default: whole
  requests; see :data:`ROLES`).

Why these rules (vLLM's code): every engine core process is started by
``CoreEngineProcManager`` with ``dp_rank = start_index + i``, ``start_index`` being the
front's ``parallel_config.data_parallel_rank``; ``EngineCoreProc.run_engine_core`` sets
``parallel_config.data_parallel_index = dp_rank`` (kept when a dense model's ranks are
made independent), and the scheduler creates its publisher with
``EventPublisherFactory.create(kv_events_config, parallel_config.data_parallel_index)``.
``ZmqEventPublisher`` both offsets its endpoints by that rank
(``ZmqEventPublisher.offset_endpoint_port``) and writes it into each batch's
``data_parallel_rank``: one global rank for both.  The HTTP front's client routes a
request's ``data_parallel_rank`` as an index into the engines it manages
(``DPLBAsyncMPClient.get_core_engine_for_request``; ``InputProcessor.process_inputs``
refuses one outside ``[0, data_parallel_size_local)`` with external or hybrid load
balancing, ``ParallelConfig.local_engines_only``).  So, per vLLM mode:

* internal load balancing (``vllm serve --data-parallel-size N``, one front for all
  ranks on one node): ``;dp=N``;
* external load balancing (``--data-parallel-rank R``, or ``--data-parallel-external-lb``;
  one front per rank, ``EngineArgs.create_engine_config`` sets its local size to 1): one
  spec per front, ``;rank=R`` (``;dp=1``), with the ``kv_events_config`` endpoint given
  to vLLM (it publishes on port + R);
* hybrid load balancing (``--data-parallel-hybrid-lb --data-parallel-start-rank S
  --data-parallel-size-local L``, one front per node): one spec per node, ``;rank=S;dp=L``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvevents.endpoints import offset_endpoint
from kvevents.errors import ConfigError

__all__ = ["ENGINE_NAME_RE", "ROLES", "EngineSpec", "offset_endpoint", "parse_engine_spec"]

ENGINE_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+\Z")
"""What an engine name may contain."""

_DIGITS = re.compile(r"^[0-9]+\Z")

HTTP_SCHEMES = ("http://", "https://")
"""The schemes an engine's HTTP URL may have."""

ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
"""The ZMQ transports an events or replay endpoint may use."""

ROLES: tuple[str, ...] = ("both", "prefill", "decode")
"""An engine's role in a prefill/decode disaggregated fleet (``both``: whole requests)."""

USAGE = (
    "expected NAME=HTTP_URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT][;dp=N][;rank=R][;topic=T][;role=ROLE]"
)
"""The one-line form of an engine spec, quoted by every parse error."""


@dataclass(frozen=True, init=False)
class EngineSpec:
    """One engine: its name, HTTP front, event endpoints, DP ranks, topic and role.

    * ``name``: matches :data:`ENGINE_NAME_RE`;
    * ``http_url``: its OpenAI server's base URL, ``http(s)://``, stored without a
      trailing slash (None: this spec only follows events);
    * ``events_endpoint``: its KV-event PUB endpoint (None: events come from elsewhere,
      e.g. JetStream); ``replay_endpoint``: its replay ROUTER endpoint (None: no replay;
      needs an events endpoint);
    * ``dp_size``: how many data-parallel ranks its HTTP front serves, each publishing at
      its offset endpoints (≥ 1);
    * ``topic``: the topic prefix subscribed to (``""``: all);
    * ``role``: one of :data:`ROLES` (``both`` by default);
    * ``first_rank``: the global data-parallel rank of the first of them (``;rank=R``,
      ≥ 0, default 0): the spec's ranks are :attr:`ranks`.

    Every check raises :class:`ConfigError` (a ``ValueError``).  An empty endpoint or
    URL string means "not given".
    """

    name: str
    http_url: str | None
    events_endpoint: str | None
    replay_endpoint: str | None
    dp_size: int
    topic: str
    role: str
    first_rank: int

    def __init__(
        self,
        name: str,
        http_url: str | None = None,
        events_endpoint: str | None = None,
        replay_endpoint: str | None = None,
        dp_size: int = 1,
        topic: str = "",
        role: str = "both",
        first_rank: int = 0,
    ) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "http_url", http_url.rstrip("/") if http_url else None)
        object.__setattr__(self, "events_endpoint", events_endpoint or None)
        object.__setattr__(self, "replay_endpoint", replay_endpoint or None)
        object.__setattr__(self, "dp_size", dp_size)
        object.__setattr__(self, "topic", topic)
        object.__setattr__(self, "role", role)
        object.__setattr__(self, "first_rank", first_rank)
        self._check()

    def _check(self) -> None:
        if not ENGINE_NAME_RE.match(self.name):
            raise ConfigError(
                f"engine name {self.name!r} may contain only letters, digits, '_' and '-'"
            )
        if self.http_url is not None and not self.http_url.startswith(HTTP_SCHEMES):
            raise ConfigError(
                f"engine {self.name}: HTTP URL {self.http_url!r} must start with http:// "
                "or https://"
            )
        for what, ep in (("events", self.events_endpoint), ("replay", self.replay_endpoint)):
            if ep is not None and not ep.startswith(ZMQ_SCHEMES):
                raise ConfigError(
                    f"engine {self.name}: {what} endpoint {ep!r} is not a ZMQ endpoint "
                    "(tcp://, ipc://, inproc://)"
                )
        if isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int):
            raise ConfigError(f"engine {self.name}: dp must be an integer, not {self.dp_size!r}")
        if self.dp_size < 1:
            raise ConfigError(f"engine {self.name}: dp must be >= 1, not {self.dp_size}")
        if isinstance(self.first_rank, bool) or not isinstance(self.first_rank, int):
            raise ConfigError(
                f"engine {self.name}: rank must be an integer, not {self.first_rank!r}"
            )
        if self.first_rank < 0:
            raise ConfigError(f"engine {self.name}: rank must be >= 0, not {self.first_rank}")
        if self.role not in ROLES:
            raise ConfigError(
                f"engine {self.name}: role must be one of {', '.join(ROLES)}, not {self.role!r}"
            )
        if self.replay_endpoint is not None and self.events_endpoint is None:
            raise ConfigError(f"engine {self.name}: a replay endpoint needs an events endpoint")
        last = self.first_rank + self.dp_size - 1
        for ep in (self.events_endpoint, self.replay_endpoint):
            try:
                offset_endpoint(ep, last)
            except ConfigError as exc:
                raise ConfigError(f"engine {self.name}: {exc}") from None

    @property
    def ranks(self) -> range:
        """The global data-parallel ranks of this spec: ``first_rank .. first_rank +
        dp_size - 1``, as vLLM numbers them (each batch's ``data_parallel_rank``)."""
        return range(self.first_rank, self.first_rank + self.dp_size)

    def http_rank(self, rank: int) -> int:
        """The ``X-data-parallel-rank`` header value that sends a request to global rank
        ``rank`` through this spec's HTTP front: its index among the front's ranks,
        ``rank - first_rank`` (vLLM's front indexes the engines it manages); ValueError
        for a rank not in :attr:`ranks`."""
        if rank not in self.ranks:
            raise ValueError(f"engine {self.name} has no data-parallel rank {rank}")
        return rank - self.first_rank

    def http_base(self) -> str:
        """:attr:`http_url`, for callers that need one; :class:`ConfigError` if there is
        none (``kvevents serve`` refuses such a spec when it loads its config)."""
        if self.http_url is None:
            raise ConfigError(f"engine {self.name}: missing the HTTP URL (http://HOST:PORT)")
        return self.http_url

    def endpoints_for_rank(self, rank: int) -> tuple[str, str | None]:
        """``(events_endpoint, replay_endpoint)`` of global data-parallel rank ``rank``, by
        vLLM's offsets (port + ``rank``); :class:`ConfigError` if this spec has no events
        endpoint."""
        if self.events_endpoint is None:
            raise ConfigError(f"engine {self.name} has no events endpoint")
        events = offset_endpoint(self.events_endpoint, rank)
        assert events is not None
        return events, offset_endpoint(self.replay_endpoint, rank)

    def rank_endpoints(self) -> list[tuple[int, str, str | None]]:
        """``(rank, events_endpoint, replay_endpoint)`` of every global DP rank of
        :attr:`ranks`, by vLLM's offsets."""
        return [(r, *self.endpoints_for_rank(r)) for r in self.ranks]

    def spec(self) -> str:
        """This engine written back as an ``--engine`` value; parses to an equal spec."""
        parts = [p for p in (self.http_url, self.events_endpoint, self.replay_endpoint) if p]
        out = f"{self.name}={','.join(parts)}"
        if self.dp_size != 1:
            out += f";dp={self.dp_size}"
        if self.first_rank != 0:
            out += f";rank={self.first_rank}"
        if self.topic:
            out += f";topic={self.topic}"
        if self.role != "both":
            out += f";role={self.role}"
        return out


def parse_engine_spec(
    text: str, *, require_http: bool = False, require_events: bool = False
) -> EngineSpec:
    """Parse ``NAME=HTTP_URL,EVENTS[,REPLAY][;dp=N][;rank=R][;topic=T][;role=ROLE]`` (see the
    module docstring).

    ``require_http`` / ``require_events`` make the HTTP URL / events endpoint mandatory.
    Raises :class:`ConfigError` with one line saying what is wrong.
    """
    name, sep, rest = text.strip().partition("=")
    name = name.strip()
    if not sep or not name:
        raise ConfigError(f"engine {text!r}: {USAGE}")
    main, *options = rest.split(";")
    dp, first_rank, topic, role = 1, 0, "", "both"
    for opt in options:
        key, eq, value = opt.partition("=")
        key = key.strip()
        if key == "dp" and eq:
            if not _DIGITS.match(value.strip()):
                raise ConfigError(f"engine {name}: dp must be a positive integer, not {value!r}")
            dp = int(value)
        elif key == "rank" and eq:
            if not _DIGITS.match(value.strip()):
                raise ConfigError(
                    f"engine {name}: rank must be a non-negative integer (the first global "
                    f"data-parallel rank its HTTP front serves), not {value!r}"
                )
            first_rank = int(value)
        elif key == "topic" and eq:
            topic = value
        elif key == "role" and eq:
            role = value.strip()
        else:
            raise ConfigError(
                f"engine {name}: unknown option {opt!r} (known: dp=N, rank=R, topic=T, role=ROLE)"
            )
    parts = [p.strip() for p in main.split(",") if p.strip()]
    http: str | None = None
    if parts and parts[0].startswith(HTTP_SCHEMES):
        http = parts.pop(0)
    for p in parts:
        if not p.startswith(ZMQ_SCHEMES):
            raise ConfigError(
                f"engine {name}: {p!r} is not a ZMQ endpoint (tcp://, ipc://, inproc://); {USAGE}"
            )
    if len(parts) > 2:
        raise ConfigError(f"engine {name}: too many endpoints; {USAGE}")
    events = parts[0] if parts else None
    replay = parts[1] if len(parts) > 1 else None
    if require_http and http is None:
        raise ConfigError(f"engine {name}: missing the HTTP URL (http://HOST:PORT); {USAGE}")
    if require_events and events is None:
        raise ConfigError(f"engine {name}: missing the events endpoint (tcp://HOST:PORT); {USAGE}")
    if http is None and events is None:
        raise ConfigError(f"engine {text!r}: {USAGE}")
    return EngineSpec(name, http, events, replay, dp, topic, role, first_rank)
