"""Sequence tracking for one publisher stream: :class:`StreamTracker` and its actions.

The tracker is pure logic shared with the core (``kvevents inspect`` summarises captures
with it), so it lives in :mod:`kvevents.seqtrack`; this module is its import path on
the router side and re-exports it unchanged.
"""

from __future__ import annotations

from kvevents.seqtrack import (
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
    StreamTracker,
    TrackerAction,
)

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
    "StartReplay",
    "StreamTracker",
    "TrackerAction",
]
