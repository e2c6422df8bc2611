"""Sequence tracking of one publisher stream: :class:`StreamTracker` (a pure state
machine: inputs in, actions out, no I/O and no clock), the actions it answers with and
what it remembers of a stream's past.

Rooms: :mod:`~kvevents.seqtrack.tracker` (the rules), :mod:`~kvevents.seqtrack.actions`
(``Deliver``, ``Report``, ``Drop``, ``StartReplay`` and the anomaly kinds) and
:mod:`~kvevents.seqtrack.history` (fingerprints of the last delivered seqs, ranges lost).
A core package: the subscriber and ``kvevents inspect`` use it; imports only
:mod:`kvevents.errors`.
"""

from __future__ import annotations

from kvevents.seqtrack.actions import (
    DISOWNED_SEQ,
    DUPLICATE,
    GAP,
    HISTORY_MISSED,
    PUBLISHER_RESTART,
    UNRECOVERABLE_LOSS,
    Deliver,
    Drop,
    Report,
    StartReplay,
    TrackerAction,
)
from kvevents.seqtrack.history import SeqHistory
from kvevents.seqtrack.tracker import StreamTracker

__all__ = [
    "DISOWNED_SEQ",
    "DUPLICATE",
    "GAP",
    "HISTORY_MISSED",
    "PUBLISHER_RESTART",
    "UNRECOVERABLE_LOSS",
    "Deliver",
    "Drop",
    "Report",
    "SeqHistory",
    "StartReplay",
    "StreamTracker",
    "TrackerAction",
]
