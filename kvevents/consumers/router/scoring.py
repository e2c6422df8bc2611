"""Scoring: what a worker costs for a prompt, and the cheapest worker.

``cost(worker) = n − (w_gpu·gpu + w_cpu·cpu + w_storage·storage) + load_weight · load``
for an ``n``-token prompt, where ``gpu``/``cpu``/``storage`` are the worker's
:class:`~kvevents.consumers.router.match.Match` and ``load`` its load (0.0 when not
given); lower is better, ties go to the smallest worker id.  :func:`rank` prices every
candidate; :func:`cheapest` finds the same first candidate without pricing the workers
that have no match one by one.  Both evaluate that expression, written the same way, so
equal costs and the tie break come out the same.

May import: :mod:`kvevents.consumers.index` (for :data:`WorkerId`) and
:mod:`kvevents.consumers.router.match`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import compress

from kvevents.consumers.index import WorkerId
from kvevents.consumers.router.match import ZERO, Candidate, Match

__all__ = ["TierWeights", "cheapest", "monotone", "rank"]


@dataclass(frozen=True)
class TierWeights:
    """How much a reused token of each tier is worth (1.0 = no prefill needed)."""

    gpu: float = 1.0
    cpu: float = 0.8
    storage: float = 0.5


def monotone(weights: TierWeights, load_weight: float) -> bool:
    """Whether a match can never raise a cost (every weight finite, tier weights ≥ 0):
    the condition for :func:`cheapest`."""
    wt = weights
    return min(wt.gpu, wt.cpu, wt.storage) >= 0 and all(
        map(math.isfinite, (wt.gpu, wt.cpu, wt.storage, load_weight))
    )


def rank(
    matches: Mapping[WorkerId, Match],
    workers: Iterable[WorkerId],
    n: int,
    loads: Mapping[WorkerId, float] | None,
    weights: TierWeights,
    load_weight: float,
) -> list[Candidate]:
    """Every worker of ``workers`` with its match (absent from ``matches``: all zero),
    load and cost, best first (cost, then worker id)."""
    wt = weights
    out = []
    for wid in workers:
        m = matches.get(wid, ZERO)
        load = float(loads.get(wid, 0.0)) if loads else 0.0
        reused = wt.gpu * m.gpu + wt.cpu * m.cpu + wt.storage * m.storage
        out.append(Candidate(wid, m, load, n - reused + load_weight * load))
    out.sort(key=lambda c: (c.cost, c.worker))
    return out


def cheapest(
    matches: Mapping[WorkerId, Match],
    ordered: Sequence[WorkerId],
    known: AbstractSet[WorkerId],
    n: int,
    loads: Mapping[WorkerId, float] | None,
    weights: TierWeights,
    load_weight: float,
) -> WorkerId | None:
    """``rank(...)[0].worker`` over ``ordered`` (sorted worker ids, ``known`` the same as
    a container, holding every worker of ``matches``) plus the workers of ``loads``;
    None when there is none.  Requires :func:`monotone` weights.

    With weights ≥ 0 a match never raises a cost, so a worker's cost without its match
    is an upper bound: the best unmatched cost is the minimum over every candidate of
    ``n - 0.0 + lw * load`` (C loops), and matched workers are then compared at their
    true cost.
    """
    lw = load_weight
    best: tuple[float, WorkerId] | None = None
    zero = lw * 0.0
    if loads:
        # ``float(lw) * x == lw * x`` for an int ``lw`` too (int * float converts it)
        base = map((n - 0.0).__add__, map(float(lw).__mul__, map(float, loads.values())))
        best = _least(list(base), loads)
        if not known <= loads.keys():
            for wid in ordered:  # the first index worker without a load (load 0.0)
                if wid not in loads:
                    best = min(best, (n - 0.0 + zero, wid))
                    break
    else:
        for wid in ordered:  # the smallest worker without a match
            if wid not in matches:
                best = (n - 0.0 + zero, wid)
                break
    if matches:
        # each matched worker at its true cost, ``n - reused + lw * load``
        wg, wc, ws = weights.gpu, weights.cpu, weights.storage
        if loads:
            get = loads.get
            costs = [
                n - (wg * g + wc * c + ws * st) + lw * float(get(wid, 0.0))
                for wid, (g, c, st) in matches.items()
            ]
        else:
            costs = [n - (wg * g + wc * c + ws * st) + zero for g, c, st in matches.values()]
        matched = _least(costs, matches)
        if best is None or matched < best:
            best = matched
    return None if best is None else best[1]


def _least(costs: list[float], workers: Iterable[WorkerId]) -> tuple[float, WorkerId]:
    """``min(zip(costs, workers))`` (``workers`` aligned with ``costs``), in fewer steps:
    the least cost first (float comparisons only), then the least worker among those
    that have it."""
    least = min(costs)
    if least != least:  # NaN: compare as tuples, as ``rank``'s sort would
        return min(zip(costs, workers))
    return least, min(compress(workers, map(least.__eq__, costs)))
