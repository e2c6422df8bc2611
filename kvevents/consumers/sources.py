"""Pluggable inputs of the :class:`~kvevents.consumers.subscriber.Subscriber`.

A :class:`Source` hands the subscriber raw messages - never decoded - tagged with what
they are (:class:`SourceMessage`): a live batch, a replayed batch, the end of a replay or a
malformed frame.  Two sources ship:

* :class:`ZmqSource` - one vLLM-compatible publisher endpoint (or an XSUB/XPUB proxy in
  front of several): a SUB socket on the live endpoint and a DEALER per replay
  endpoint.  ZMQ reconnects on its own; a socket monitor reports each disconnect and
  reconnect, so the subscriber checks the stream's identity (by replay) before it trusts
  what the new connection delivers: a publisher restarted on the same endpoint is
  detected even when its seq has passed the old one.
* :class:`CaptureSource` - a capture file (:mod:`kvevents.capture`).  A file cannot be
  asked for a replay; instead the replayed frames that were recorded answer the gaps
  *in band* (``replay_inband``), so a capture of a session that replayed reads back as
  the same applied stream.

A relay reader (:mod:`kvevents.jetstream`) implements the same protocol.

This module is the one import path for all of them; each lives in its own room:
:mod:`~kvevents.consumers.source_protocol` (the protocol and message kinds),
:mod:`~kvevents.consumers.zmq_source` and :mod:`~kvevents.consumers.capture_source`.
"""

from __future__ import annotations

from kvevents.consumers.capture_source import CaptureSource
from kvevents.consumers.source_protocol import (
    BAD_FRAME,
    CONNECTED,
    DISCONNECTED,
    LIVE,
    REPLAY,
    REPLAY_DISCONNECTED,
    REPLAY_END,
    Source,
    SourceMessage,
)
from kvevents.consumers.zmq_source import DEFAULT_MAX_MESSAGE_SIZE_BYTES, ZmqSource

__all__ = [
    "BAD_FRAME",
    "CONNECTED",
    "DEFAULT_MAX_MESSAGE_SIZE_BYTES",
    "DISCONNECTED",
    "LIVE",
    "REPLAY",
    "REPLAY_DISCONNECTED",
    "REPLAY_END",
    "CaptureSource",
    "Source",
    "SourceMessage",
    "ZmqSource",
]
