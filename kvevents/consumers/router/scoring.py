"""Scoring: what a worker costs for a prompt, and the cheapest worker.

``cost(worker) = n − (w_gpu·gpu + w_cpu·cpu + w_storage·storage) + load_weight · load``
for an ``n``-token prompt, where ``gpu``/``cpu``/``storage`` are the worker's
:class:`~kvevents.consumers.router.match.Match` and ``load`` its load (0.0 when not
given); lower is better, ties go to the smallest worker id, and a NaN cost (a load
weight of 0 times an infinite load, a NaN load) ranks as +inf would.  :func:`rank` prices every
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
from itertools import compress, islice

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
    out.sort(key=lambda c: (_ordered(c.cost), c.worker))
    return out


def _ordered(cost: float) -> float:
    """``cost`` as it is compared: a NaN as +inf (NaN has no place in an order)."""
    return cost if cost == cost else math.inf


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
    zero = lw * 0.0
    matched: tuple[float, WorkerId] | None = None
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
        bound = _unmatched_bound(n, loads, lw)
        if bound is not None and matched[0] < bound:
            return matched[1]  # no candidate can come near it without a match
    best: tuple[float, WorkerId] | None = None
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
    if matched is not None and (best is None or matched < best):
        best = matched
    return None if best is None else best[1]


def _unmatched_bound(n: int, loads: Mapping[WorkerId, float] | None, lw: float) -> float | None:
    """A cost no candidate can go below without a match: the least of ``n - 0.0 + lw *
    load`` over the loads and over load 0.0 (a worker without one), for ``lw >= 0`` (the
    cost then grows with the load).  None when that is not known cheaply: a negative
    ``lw``, or a NaN cost among the loads (where comparisons do not order)."""
    if lw < 0:
        return None
    zero_load = n - 0.0 + lw * 0.0
    if not loads:
        return zero_load
    try:
        values = loads.values()
        weighted = lw * sum(values)
        if weighted != weighted:  # a NaN load (or +inf with -inf; an inf one with lw 0)
            return None
        bound = min(n - 0.0 + lw * float(min(values)), zero_load)
    except TypeError:  # loads of a type min or sum cannot take: the general path
        return None
    return None if bound != bound else bound


def _least(costs: list[float], workers: Iterable[WorkerId]) -> tuple[float, WorkerId]:
    """``min(zip(costs, workers))`` (``workers`` aligned with ``costs``; a NaN cost
    compared as +inf, and returned as +inf), in fewer steps: the least cost first (float
    comparisons only), then the least worker among those that have it."""
    total = sum(costs)
    if total != total:  # a NaN (or +inf with -inf): order them as rank does
        costs = list(map(_ordered, costs))
    least = min(costs)
    if costs.count(least) == 1:  # (usual: no tie at the top) the one worker, by position
        return least, next(islice(workers, costs.index(least), None))
    return least, min(compress(workers, map(least.__eq__, costs)))
