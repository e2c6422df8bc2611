"""Relay KV event streams through NATS JetStream, and read them back (extra ``nats``).

* :class:`JetStreamRelay` follows engines over ZMQ and appends each batch's raw payload
  to a JetStream stream (``kvevents relay``);
* :class:`JetStreamSubscriber` / :class:`AsyncJetStreamSubscriber` read that stream and
  yield the same batches and anomalies as :class:`~kvevents.consumers.Subscriber`;
* :class:`LocalNatsServer` starts a local ``nats-server`` for tests and trials.

Needs ``nats-py`` (``pip install 'kvevents[nats]'``), imported when a connection is made.
"""

from kvevents.jetstream.naming import DEFAULT_STREAM, BatchHeaders, msg_id, subject_for
from kvevents.jetstream.reader import (
    HISTORY_MISSED,
    AsyncJetStreamSubscriber,
    HeaderTracker,
    JetStreamStats,
    JetStreamSubscriber,
    StreamPosition,
)
from kvevents.jetstream.relay import JetStreamRelay, RelayStats, ensure_stream
from kvevents.jetstream.server import LocalNatsServer, find_nats_server

__all__ = [
    "DEFAULT_STREAM",
    "HISTORY_MISSED",
    "AsyncJetStreamSubscriber",
    "BatchHeaders",
    "HeaderTracker",
    "JetStreamRelay",
    "JetStreamStats",
    "JetStreamSubscriber",
    "LocalNatsServer",
    "RelayStats",
    "StreamPosition",
    "ensure_stream",
    "find_nats_server",
    "msg_id",
    "subject_for",
]
