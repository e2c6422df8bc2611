"""KV-aware routing over a :class:`~kvevents.consumers.index.BlockIndex`.

The rooms, each with one job:

* :mod:`~kvevents.consumers.router.router`: the :class:`Router` façade (request → keys →
  matches → the cheapest worker);
* :mod:`~kvevents.consumers.router.walk`: the prefix walk over the index's layout (the
  bitset walk every usual worker is answered by);
* :mod:`~kvevents.consumers.router.lookup`: vLLM's per-worker lookup rules for hybrid,
  windowed and speculative workers;
* :mod:`~kvevents.consumers.router.scoring`: the cost of a worker and the cheapest one;
* :mod:`~kvevents.consumers.router.match`: the result types;
* :mod:`~kvevents.consumers.router.pending`: the pending overlay (what was just routed
  to a worker and is not confirmed by its events yet).

May import: the rooms above (this package re-exports the public names).
"""

from kvevents.consumers.router.match import Candidate, Match
from kvevents.consumers.router.pending import PendingOverlay, PendingStats
from kvevents.consumers.router.router import Router
from kvevents.consumers.router.scoring import TierWeights

__all__ = ["Candidate", "Match", "PendingOverlay", "PendingStats", "Router", "TierWeights"]
