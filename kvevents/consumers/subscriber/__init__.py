"""The subscriber SDK: follow many publishers without losing track of any.

:class:`Subscriber` reads one or more sources (ZMQ endpoints of vLLM-compatible
publishers, capture files, or any :class:`~kvevents.consumers.source_protocol.Source`), decodes
each batch, tracks seq per stream (:mod:`kvevents.seqtrack`) and yields, in
order:

* :class:`ReceivedBatch` - a decoded batch to apply, with its raw topic and payload bytes
  (so a recorder can store it losslessly) and whether it came through replay;
* :class:`Anomaly` - a counted value describing something the application should know
  (see :data:`ANOMALY_KINDS`; :attr:`Anomaly.needs_reset` says when to reset a worker).

**Streams and workers.**  A stream is one ``(endpoint, topic, dp_rank)``: several engines
may share an endpoint (an XSUB/XPUB proxy) as long as their topics differ.  The worker id
is ``(source, dp_rank)``, where ``source`` is the endpoint (or source name) when the
topic is empty, else ``"<endpoint>#<topic>"`` (:func:`worker_source`), e.g.
``("tcp://proxy:5557#kv@engine-a", 0)``.

**Catch-up.**  A new stream is replayed from seq 0: the publisher's ring answers from its
oldest seq; what it no longer holds is a ``history_missed`` anomaly with the seq range
(the index starts incomplete; nothing to reset).  With a replay endpoint the whole ring
is also asked for when the live socket connects and no stream of that endpoint is known
yet, so idle engines are caught up too; a new stream whose endpoint was already asked
for its ring rides on that request, so the ring is asked for once per connect.

**Gaps, duplicates, order.**  A gap is repaired by a DEALER replay merged with live
traffic, so nothing is applied twice or out of order.  A seq is either delivered or
reported lost (``unrecoverable_loss``), never both; only a replay that proves the ring no
longer holds a seq the live path has passed makes it lost, so a live backlog deeper than
the ring invents nothing.  A batch arriving after its seq was reported lost is dropped
and counted as ``late``; duplicates and reordered batches never reset anything.

**Restarts** are detected by the identity of the last applied seq, not by seq order:
every replay starts at the last applied seq and compares its payload fingerprint, and
after the live socket reconnects (a ZMQ socket monitor reports it), or when a batch
contradicts what was applied, the stream is checked that way before anything new is
applied.  A restart (``publisher_restart``) resets that worker and resyncs it from the
new stream's start.

**Frames the publisher never sent.**  A live seq that jumps ahead, fills a hole or
contradicts an applied seq is held or dropped until the replay service vouches for it; a
seq the replay disowns is reported ``disowned_seq``, never applied and never a reason to
reset (docs/subscriber.md: what this covers; CURVE is the real defence).

**Liveness.**  Idle engines publish nothing, so silence alone proves nothing.  After a
third of ``stale_after_s`` without a batch, a worker's replay endpoint is probed (a
request from its last seq: the end marker answers); a worker with neither a batch nor an
answer for ``stale_after_s`` is reported ``stale`` (exclude it from routing:
:meth:`~kvevents.consumers.index.BlockIndex.set_stale`) and ``live`` again when its stream
or its replay endpoint is heard from.  A worker without a replay endpoint is never made
stale by silence.

**Bounds.**  Replays have a timeout (``replay_timeout_s``: a worker's stream waits at
most that long without progress), a bound on how many run at once, and a cooldown
(``replay_cooldown_s``) after a replay endpoint timed out.  Every socket has
``ZMQ_MAXMSGSIZE`` (``max_message_size_bytes``): an oversize frame makes
ZMQ drop that connection, which is counted in :attr:`SubscriberStats.connections`; the
stream reconnects and its gap is replayed or reported.  Everything dropped or skipped is
counted in :attr:`Subscriber.stats` with a reason label.  Anomalies are values, never
exceptions: the stream always goes on.

Threading: a subscriber is used from one thread (ZMQ sockets are not thread-safe).  For
asyncio use :class:`~kvevents.consumers.aio.AsyncSubscriber`, which drives the same
:class:`SubscriberCore`.

**Rooms.**  This package is the one import path; each job has its own module:
``items`` (the values handed out and the counters), ``options`` (settings, their checks
and opening sources), ``streams`` (the shared tables and the replay adapters of a
source), ``table`` (naming, decoding, new streams, each source's last live topic),
``outbox`` (tracker actions to items; it returns the replay a tracker asks for),
``replay`` (replay scheduling, deadlines, catch-up requests; its ``apply`` carries a
tracker's actions out), ``replies`` (replies, end markers and connection events to the
streams), ``inband`` (replays recorded in a capture), ``liveness`` (probes and
staleness), ``waiting`` (the sockets to wait on), ``core`` (:class:`SubscriberCore`,
which composes them, routes each message and runs the one receive loop) and
``blocking`` (:class:`Subscriber`).  Each room is given what it needs when it is made.
"""

from __future__ import annotations

from kvevents.consumers.subscriber.blocking import Subscriber
from kvevents.consumers.subscriber.core import SubscriberCore
from kvevents.consumers.subscriber.items import (
    ANOMALY_KINDS,
    BAD_FRAME_KIND,
    DEFAULT_STALE_AFTER_S,
    LIVE_AGAIN,
    REPLAY_TIMEOUT,
    STALE,
    UNDECODABLE,
    Anomaly,
    ReceivedBatch,
    SubscriberItem,
    SubscriberStats,
    worker_source,
)
from kvevents.consumers.subscriber.options import EndpointSpec, ReplaySpec, SubscriberOptions

__all__ = [
    "ANOMALY_KINDS",
    "BAD_FRAME_KIND",
    "DEFAULT_STALE_AFTER_S",
    "LIVE_AGAIN",
    "REPLAY_TIMEOUT",
    "STALE",
    "UNDECODABLE",
    "Anomaly",
    "EndpointSpec",
    "ReceivedBatch",
    "ReplaySpec",
    "Subscriber",
    "SubscriberCore",
    "SubscriberItem",
    "SubscriberOptions",
    "SubscriberStats",
    "worker_source",
]
