"""What a :class:`~kvevents.seqtrack.StreamTracker` answers with: the actions
its caller carries out, in order, and the anomaly kinds it reports.

* :class:`Deliver` - hand this batch to the application (strictly increasing ``seq``;
  nothing is delivered twice between two resets);
* :class:`Report` - an anomaly the application must see (``gap``, ``duplicate``,
  ``publisher_restart``, ``unrecoverable_loss``, ``history_missed``, ``disowned_seq``);
* :class:`Drop` - something was discarded (count it by reason: ``late``, ``mismatch``,
  ``replay_overlap``, ``replay_ahead``, ``stale_replay``, ...);
* :class:`StartReplay` - ask the publisher's replay endpoint for every batch it still
  holds from ``start`` on (vLLM's DEALER/ROUTER protocol).

One job: the tracker's output vocabulary.  Imports nothing of kvevents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar, Union

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
    "TrackerAction",
]

T = TypeVar("T")

GAP = "gap"
DUPLICATE = "duplicate"
PUBLISHER_RESTART = "publisher_restart"
UNRECOVERABLE_LOSS = "unrecoverable_loss"
HISTORY_MISSED = "history_missed"
DISOWNED_SEQ = "disowned_seq"
"""A live batch the publisher's replay service disowns: its seq is beyond the newest the
ring held when asked after the batch arrived, or the ring holds another payload under it,
or it contradicts an applied seq of a stream the replay showed unchanged.  Discarded,
never applied, never a reason to reset (a forged frame on an unauthenticated socket, or a
corrupted one)."""


@dataclass(frozen=True, slots=True)
class Deliver(Generic[T]):
    """Apply ``item`` (seq ``seq``); ``replayed`` is true if it came through replay."""

    seq: int
    item: T
    replayed: bool


@dataclass(frozen=True, slots=True)
class Report:
    """An anomaly to report.  ``first_seq``..``last_seq`` (inclusive) is the seq range it
    concerns; for ``publisher_restart`` ``first_seq`` is the seq that revealed the new
    stream (None when a replay did) and ``last_seq`` the old stream's last delivered
    seq."""

    kind: str
    first_seq: int | None
    last_seq: int | None
    detail: str


@dataclass(frozen=True, slots=True)
class Drop:
    """A batch or reply discarded (count it by ``reason``)."""

    seq: int | None
    reason: str


@dataclass(frozen=True, slots=True)
class StartReplay:
    """Request a replay of every buffered seq ``>= start``.  Replies and the end marker
    are passed back with ``replay_id``; a newer request supersedes an older one.  A
    tracker call answers at most one, as its last action."""

    start: int
    replay_id: int


TrackerAction = Union[Deliver[T], Report, Drop, StartReplay]
