"""A subscriber's settings and inputs: :class:`SubscriberOptions` (validated, with units
in every duration and size name) and :func:`open_sources` (endpoint strings to
:class:`~kvevents.consumers.source_protocol.Source` objects).

One job: turn what a user passes into checked settings and open sources.  May import :mod:`kvevents.consumers.zmq_source`, :mod:`kvevents.consumers.capture_source`,
:mod:`kvevents.security` and :mod:`kvevents.errors`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import zmq

from kvevents.consumers.capture_source import CaptureSource
from kvevents.consumers.source_protocol import Source
from kvevents.consumers.subscriber.items import DEFAULT_STALE_AFTER_S
from kvevents.consumers.zmq_source import DEFAULT_MAX_MESSAGE_SIZE_BYTES, ZmqSource
from kvevents.errors import ConfigError
from kvevents.security import CurveClientConfig

__all__ = [
    "EndpointSpec",
    "ReplaySpec",
    "SubscriberOptions",
    "open_sources",
    "zmq_links",
]

EndpointSpec = Union[str, Source]
"""An endpoint string (``tcp://...``, a ``.kvcap`` path, ``capture:<path>``) or a source."""

ReplaySpec = Union[Sequence[Union[str, None]], Mapping[str, str], None]
"""Replay endpoints: aligned with the endpoints, or keyed by endpoint / ``endpoint#topic``."""


@dataclass(frozen=True)
class SubscriberOptions:
    """Every setting of a subscriber, in one place: its name, default, unit and meaning
    (durations are seconds, sizes bytes, the other bounds counts).  Checked on
    construction: a bad value raises :class:`~kvevents.errors.ConfigError`, an unknown
    name :class:`TypeError`.  Pass one as ``options=`` to
    :class:`~kvevents.consumers.subscriber.Subscriber` or
    :class:`~kvevents.consumers.aio.AsyncSubscriber`; the rooms are built from it, so it
    is read-only."""

    catch_up: bool = True
    """Replay every new stream from the oldest seq its publisher holds, and ask each
    replay endpoint for its whole ring when the subscriber starts (or, for a source that
    reports connections, when its live socket connects)."""
    replay_timeout_s: float = 5.0
    """How long a worker's stream may wait on a replay that makes no progress: to start
    (queueing included) and between two replies.  > 0."""
    max_concurrent_replays: int = 4
    """Replay requests in flight at once, over all sources.  >= 1."""
    replay_cooldown_s: float = 10.0
    """How long a replay endpoint that timed out is not asked again.  >= 0."""
    stale_after_s: float | None = DEFAULT_STALE_AFTER_S
    """The liveness bound: a worker with a replay endpoint that sent neither a batch nor a
    replay answer for this long is reported stale (None: never).  > 0."""
    history: int = 4096
    """Batches of each stream whose fingerprints are kept to tell a duplicate from a
    restart (:class:`~kvevents.seqtrack.StreamTracker`'s ``history``)."""
    max_pending: int = 100_000
    """Batches a stream may hold back behind a gap being replayed
    (:class:`~kvevents.seqtrack.StreamTracker`'s ``max_pending``)."""
    rcvhwm: int = 100_000
    """The SUB socket's receive high-water mark (messages; 0: unlimited)."""
    max_message_size_bytes: int | None = DEFAULT_MAX_MESSAGE_SIZE_BYTES
    """``ZMQ_MAXMSGSIZE`` of every socket (default 64 MiB; None: unlimited): ZMQ drops a
    connection that sends a larger frame, which is counted and redialled."""
    max_replay_batches: int = 1_000_000
    """Replies one replay may bring: a reply stream that never ends is abandoned and its
    holes reported."""
    receive_batch: int = 128
    """The most messages read from one source per wake-up (a read of a ZMQ source also
    stops after 64 KiB of payloads).  Once a wake-up's read has yielded an item, its
    later reads are held raw and decoded when the items before them are taken."""
    inband_window: int = 1024
    """Live records of a capture that may follow a gap before the recorded replay
    answering it is given up (the gap is then reported lost)."""

    def __post_init__(self) -> None:
        if self.replay_timeout_s <= 0 or self.max_concurrent_replays < 1:
            raise ConfigError(
                "replay_timeout_s must be > 0, max_concurrent_replays >= 1, replay_cooldown_s >= 0"
            )
        if self.replay_cooldown_s < 0:
            raise ConfigError("replay_cooldown_s must be >= 0")
        if self.stale_after_s is not None and self.stale_after_s <= 0:
            raise ConfigError(f"stale_after_s must be > 0 or None, got {self.stale_after_s}")


def open_sources(
    endpoints: EndpointSpec | Sequence[EndpointSpec],
    topic: bytes,
    replay_endpoints: ReplaySpec,
    options: SubscriberOptions,
    *,
    context: zmq.Context[Any] | None = None,
    curve: CurveClientConfig | None = None,
) -> list[Source]:
    """The sources for ``endpoints`` (strings become :class:`ZmqSource` or
    :class:`CaptureSource`; sources are kept), with their replay endpoints.  Raises
    :class:`~kvevents.errors.ConfigError` for no endpoint, a replay map naming none, or
    duplicate source names; closes what it opened before raising."""
    specs: list[EndpointSpec] = (
        [endpoints] if isinstance(endpoints, (str, Source)) else list(endpoints)
    )
    if not specs:
        raise ConfigError("Subscriber needs at least one endpoint or source")
    replay_for, by_topic = _replay_map(specs, replay_endpoints)
    sources: list[Source] = []
    try:
        for spec in specs:
            if not isinstance(spec, str):
                sources.append(spec)
            elif spec.startswith("capture:"):
                sources.append(CaptureSource(spec[len("capture:") :], name=spec))
            elif spec.endswith(".kvcap") and "://" not in spec:
                sources.append(CaptureSource(spec, name=spec))
            else:
                sources.append(
                    ZmqSource(
                        spec,
                        topic,
                        replay_for.get(spec),
                        replay_by_topic=by_topic.get(spec),
                        context=context,
                        rcvhwm=options.rcvhwm,
                        max_message_size_bytes=options.max_message_size_bytes,
                        curve=curve,
                    )
                )
    except BaseException:
        for src in sources:
            src.close()
        raise
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        for src in sources:
            src.close()
        raise ConfigError(f"source names must be unique: {names}")
    return sources


def zmq_links(endpoints: EndpointSpec | Sequence[EndpointSpec], replay: ReplaySpec) -> int:
    """How many monitored ZMQ connections :func:`open_sources` and the replays may open:
    one per endpoint string that is not a capture, one per replay endpoint given."""
    specs = [endpoints] if isinstance(endpoints, (str, Source)) else list(endpoints)
    live = sum(
        1
        for s in specs
        if isinstance(s, str) and not s.startswith("capture:") and not s.endswith(".kvcap")
    )
    if replay is None:
        replays = 0
    elif isinstance(replay, str):
        replays = 1
    elif isinstance(replay, Mapping):
        replays = len(replay)
    else:
        replays = sum(1 for r in replay if r is not None)
    return live + replays


def _replay_map(
    specs: Sequence[EndpointSpec], replay: ReplaySpec
) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """``(endpoint -> replay endpoint, endpoint -> {topic -> replay endpoint})``."""
    if replay is None:
        return {}, {}
    if isinstance(replay, Mapping):
        plain: dict[str, str] = {}
        by_topic: dict[str, dict[str, str]] = {}
        endpoints = {s for s in specs if isinstance(s, str)}
        for k, v in replay.items():
            if k in endpoints:
                plain[k] = v
                continue
            ep, sep, topic = k.partition("#")
            if not sep or ep not in endpoints:
                raise ConfigError(
                    f"replay_endpoints key {k!r} names no endpoint given "
                    "(use '<endpoint>' or '<endpoint>#<topic>')"
                )
            by_topic.setdefault(ep, {})[topic] = v
        return plain, by_topic
    if isinstance(replay, str):
        replay = [replay]
    if len(replay) != len(specs):
        raise ConfigError(f"replay_endpoints has {len(replay)} entries for {len(specs)} endpoints")
    return {s: r for s, r in zip(specs, replay) if isinstance(s, str) and r is not None}, {}
