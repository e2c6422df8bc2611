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
from collections.abc import Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import compress, islice, repeat
from operator import add, mul, sub

from kvevents.consumers.index import WorkerId
from kvevents.consumers.router.match import ZERO, Candidate, Match

__all__ = ["TierWeights", "cheapest", "choose", "monotone", "rank", "slot_costs"]


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
    pending: Mapping[WorkerId, int] | None = None,
    pending_weight: float = 0.0,
) -> list[Candidate]:
    """Every worker of ``workers`` with its match (absent from ``matches``: all zero),
    load and cost, best first (cost, then worker id).  ``pending``: per worker, tokens
    pending beyond its match, credited at ``pending_weight``."""
    wt = weights
    out = []
    for wid in workers:
        m = matches.get(wid, ZERO)
        load = float(loads.get(wid, 0.0)) if loads else 0.0
        reused = wt.gpu * m.gpu + wt.cpu * m.cpu + wt.storage * m.storage
        p = pending.get(wid, 0) if pending else 0
        if p:
            reused += pending_weight * p
        out.append(Candidate(wid, m, load, n - reused + load_weight * load, p))
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
    costs: list[float] = []
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
            zero = lw * 0.0
            costs = [n - (wg * g + wc * c + ws * st) + zero for g, c, st in matches.values()]
    return choose(matches, costs, ordered, known, n, loads, lw)


def slot_costs(
    pos_wids: Sequence[WorkerId | None],
    ends: tuple[Sequence[int], Sequence[int] | None, Sequence[int] | None],
    n: int,
    loads: Mapping[WorkerId, float] | None,
    weights: TierWeights,
    load_weight: float,
) -> tuple[list[WorkerId], list[float]]:
    """The workers with a match and their costs, from per-slot ends (the GPU, CPU and
    STORAGE ends in tokens, indexed by slot + 1 as ``pos_wids``; None: the tier adds
    nothing), in slot order: the workers and the costs :func:`cheapest` computes from
    their :class:`Match`, without building one (C loops over every slot).  Requires
    :func:`monotone` weights.

    The terms of a tier that adds nothing, and the load term without loads, are left
    out: with finite weights each is ±0.0, and adding ±0.0 to the rest changes no cost
    (a cost is never −0.0), so every cost compares as :func:`cheapest`'s does.
    """
    gpu_end, cpu_end, storage_end = ends
    reused: Iterable[float] = map(mul, repeat(weights.gpu), gpu_end)
    last = gpu_end
    if cpu_end is not None:
        cpu = map(mul, repeat(weights.cpu), map(sub, cpu_end, gpu_end))
        reused = map(add, reused, cpu)
        last = cpu_end
    if storage_end is not None:
        storage = map(mul, repeat(weights.storage), map(sub, storage_end, last))
        reused = map(add, reused, storage)
        last = storage_end
    # (a slot without a worker has all-zero ends and is dropped with the unmatched)
    wids: list[WorkerId] = list(compress(pos_wids, last))  # type: ignore[arg-type]
    costs: Iterable[float] = map(sub, repeat(n), compress(reused, last))
    if loads:
        load = map(float, map(loads.get, wids, repeat(0.0)))
        costs = map(add, costs, map(mul, repeat(load_weight), load))
    return wids, list(costs)


def choose(
    matched: Collection[WorkerId],
    costs: list[float],
    ordered: Sequence[WorkerId],
    known: AbstractSet[WorkerId],
    n: int,
    loads: Mapping[WorkerId, float] | None,
    load_weight: float,
) -> WorkerId | None:
    """:func:`cheapest` once the matched workers are priced: ``matched`` the workers with
    a match (iterated in the order of ``costs``, their costs)."""
    lw = load_weight
    zero = lw * 0.0
    matched_best: tuple[float, WorkerId] | None = None
    if costs:
        matched_best = _least(costs, matched)
        bound = _unmatched_bound(n, loads, lw)
        if bound is not None and matched_best[0] < bound:
            return matched_best[1]  # no candidate can come near it without a match
    if not isinstance(matched, (Mapping, AbstractSet)):
        matched = set(matched)  # (tested for membership below)
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
            if wid not in matched:
                best = (n - 0.0 + zero, wid)
                break
    if matched_best is not None and (best is None or matched_best < best):
        best = matched_best
    return None if best is None else best[1]


def _unmatched_bound(n: int, loads: Mapping[WorkerId, float] | None, lw: float) -> float | None:
    """A cost no candidate can go below without a match: the least of ``n - 0.0 + lw *
    load`` over the loads and over load 0.0 (a worker without one), for ``lw >= 0`` (the
    cost then grows with the load).  None when that is not known cheaply: a negative
    ``lw``, or a NaN bound.

    One C pass (``min``): a NaN load compares false both ways, so ``min`` skips it
    unless it comes first (then the bound is NaN); its worker's cost is NaN, which
    ranks as +inf and cannot go below the bound.  An infinite load with ``lw`` 0 gives a
    NaN cost too, ranked the same; the least load -inf gives a bound of -inf (or NaN
    with ``lw`` 0), which nothing is below."""
    if lw < 0:
        return None
    zero_load = n - 0.0 + lw * 0.0
    if not loads:
        return zero_load
    try:
        bound = min(n - 0.0 + lw * float(min(loads.values())), zero_load)
    except TypeError:  # loads of a type min cannot take: the general path
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
