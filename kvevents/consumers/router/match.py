"""The router's result types: :class:`Match` (reusable tokens per tier) and
:class:`Candidate` (a scored worker).

May import: :mod:`kvevents.consumers.index` (for :data:`WorkerId`) only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvevents.consumers.index import WorkerId

__all__ = ["ZERO", "Candidate", "Match"]


class Match(NamedTuple):
    """Prompt tokens a worker can reuse, per tier (``gpu`` first, then ``cpu``, ``storage``)."""

    gpu: int = 0
    cpu: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        """All reusable prompt tokens."""
        return self.gpu + self.cpu + self.storage


ZERO = Match()
"""The match of a worker with nothing reusable."""


@dataclass(frozen=True)
class Candidate:
    """A scored worker: lower ``cost`` is better."""

    worker: WorkerId
    match: Match
    load: float
    cost: float
    """Prompt tokens minus tier-weighted reused tokens (pending ones at their own
    weight), plus ``load_weight × load``."""
    pending: int = 0
    """Prompt tokens the router's pending overlay holds on this worker beyond ``match``
    (routed there, not yet confirmed by its events); never part of ``match``."""
