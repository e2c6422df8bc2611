"""KV-aware routing over a :class:`~kvevents.consumers.index.BlockIndex` (DESIGN §4).

:meth:`Router.find_matches` says, per worker, how many leading prompt tokens that engine
would actually reuse from each tier, counted the way vLLM counts them:

* ``gpu``: the longest prefix held on GPU, in whole engine blocks, the minimum over the
  worker's prefix-indexable groups;
* ``cpu``: the tokens the CPU tier adds *after* ``gpu``.  Per group with chunk size
  ``T = blocks_per_chunk × block_size``, consecutive CPU chunks are counted from chunk
  ``gpu // T``; the hit ends at ``T × (last hit chunk + 1)``; the smallest end over the
  groups wins, and if any group would add less than one whole chunk beyond ``gpu``
  (or has no chunk at all) ``cpu`` is 0;
* ``storage``: likewise after ``gpu + cpu``.

The walk computes the prompt's content keys once and intersects per-tier worker bitsets
along them, so its cost grows with the matched length, not with workers × length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvevents.consumers.content import prompt_keys
from kvevents.consumers.index import BlockIndex, WorkerId, _Layout
from kvevents.errors import ConfigError

__all__ = ["Candidate", "Match", "Router", "TierWeights"]


class Match(NamedTuple):
    """Prompt tokens a worker can reuse, per tier (``gpu`` first, then ``cpu``, ``storage``)."""

    gpu: int = 0
    cpu: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        """All reusable prompt tokens."""
        return self.gpu + self.cpu + self.storage


@dataclass(frozen=True)
class TierWeights:
    """How much a reused token of each tier is worth (1.0 = no prefill needed)."""

    gpu: float = 1.0
    cpu: float = 0.8
    storage: float = 0.5


@dataclass(frozen=True)
class Candidate:
    """A scored worker: lower ``cost`` is better."""

    worker: WorkerId
    match: Match
    load: float
    cost: float
    """Prompt tokens minus tier-weighted reused tokens, plus ``load_weight × load``."""


_ZERO = Match()


class Router:
    """Picks the worker that makes a prompt cheapest to prefill.

    ``cost(worker) = len(tokens) − (w_gpu·gpu + w_cpu·cpu + w_storage·storage)
    + load_weight · load``; ties go to the smallest :data:`WorkerId`.
    """

    def __init__(
        self,
        index: BlockIndex,
        weights: TierWeights | None = None,
        load_weight: float = 1.0,
    ) -> None:
        self.index = index
        self.weights = weights if weights is not None else TierWeights()
        self.load_weight = load_weight

    # ---------------------------------------------------------------- matching

    def find_matches(
        self, tokens: Sequence[int], lora_name: str | None = None
    ) -> dict[WorkerId, Match]:
        """Per worker with anything reusable, its :class:`Match` (absent means all zero)."""
        index = self.index
        lay = index.layout()
        unit = lay.canonical
        if not lay.gpu_classes or len(tokens) < unit:
            return {}
        keys = prompt_keys(tokens, unit, lora_name)
        # GPU: every prefix-indexable slot starts at its first block boundary.
        gpu_ends = _walk(keys, index.marks(0), lay.gpu_classes, lay.gpu_mask, {})
        gpu_of = _per_worker_gpu(gpu_ends, lay)
        if not lay.chunk_classes:
            return {wid: Match(g) for wid, g in gpu_of.items() if g}
        cpu_of = self._chunk_tier(keys, 1, lay, gpu_of)
        if cpu_of:
            base = dict(gpu_of)
            for wid, c in cpu_of.items():
                base[wid] = base.get(wid, 0) + c
        else:
            base = gpu_of
        sto_of = self._chunk_tier(keys, 2, lay, base)
        if not cpu_of and not sto_of:
            return {wid: Match(g) for wid, g in gpu_of.items() if g}
        out = {
            wid: Match(g, cpu_of.get(wid, 0), sto_of.get(wid, 0)) for wid, g in gpu_of.items() if g
        }
        for wid, c in cpu_of.items():
            if wid not in out:
                out[wid] = Match(gpu_of.get(wid, 0), c, sto_of.get(wid, 0))
        for wid, st in sto_of.items():
            if wid not in out:
                out[wid] = Match(gpu_of.get(wid, 0), cpu_of.get(wid, 0), st)
        return out

    def _chunk_tier(
        self,
        keys: list[int],
        tier: int,
        lay: _Layout,
        base_of: Mapping[WorkerId, int],
    ) -> dict[WorkerId, int]:
        """Tokens a chunk tier adds after ``base_of[worker]`` (0 where none)."""
        unit = lay.canonical
        marks = self.index.marks(tier)
        if not marks:
            return {}
        alive = lay.chunk_mask
        slot_chunk = lay.slot_chunk
        worker_slots = lay.worker_slots
        slot_bit = lay.slot_bit
        start_bits: dict[int, list[int]] = {}
        for wid, base in base_of.items():
            if base <= 0:
                continue
            for slot in worker_slots[wid]:
                size = slot_chunk.get(slot)
                if size is not None:
                    first = (base // size + 1) * (size // unit)
                    bits = start_bits.get(first)
                    if bits is None:
                        start_bits[first] = [slot_bit[slot]]
                    else:
                        bits.append(slot_bit[slot])
        # distinct single bits: their sum is their union, computed in C
        starts = {first: sum(bits) for first, bits in start_bits.items()}
        late = sum(starts.values())
        ends = _walk(keys, marks, lay.chunk_classes, alive & ~late, starts)
        out: dict[WorkerId, int] = {}
        multi: set[WorkerId] = set()
        slot_worker = lay.slot_worker
        for slot, e in ends.items():
            wid = slot_worker[slot]
            if len(worker_slots[wid]) > 1:
                multi.add(wid)
                continue
            base = base_of.get(wid, 0)
            add = e * unit - base
            if add >= slot_chunk[slot]:
                out[wid] = add
        for wid in multi:
            base = base_of.get(wid, 0)
            best: int | None = None
            for s in worker_slots[wid]:
                end = ends.get(s)
                # every group must add at least one whole chunk of its own beyond base
                if s not in slot_chunk or end is None or end * unit - base < slot_chunk[s]:
                    best = None
                    break
                best = end * unit if best is None else min(best, end * unit)
            if best is None:
                continue
            align = lay.worker_align[wid]
            best = best // align * align  # whole blocks of every group
            if best > base:
                out[wid] = best - base
        return out

    # ---------------------------------------------------------------- choosing

    def score(
        self,
        tokens: Sequence[int],
        loads: Mapping[WorkerId, float] | None = None,
        lora_name: str | None = None,
    ) -> list[Candidate]:
        """Every candidate worker with its match and cost, best first.

        Candidates are the index's workers plus any worker named in ``loads``.
        """
        matches = self.find_matches(tokens, lora_name)
        workers = set(self.index.workers())
        if loads:
            workers.update(loads)
        n = len(tokens)
        wt = self.weights
        out = []
        for wid in workers:
            m = matches.get(wid, _ZERO)
            load = float(loads.get(wid, 0.0)) if loads else 0.0
            reused = wt.gpu * m.gpu + wt.cpu * m.cpu + wt.storage * m.storage
            out.append(Candidate(wid, m, load, n - reused + self.load_weight * load))
        out.sort(key=lambda c: (c.cost, c.worker))
        return out

    def select(
        self,
        tokens: Sequence[int],
        loads: Mapping[WorkerId, float] | None = None,
        lora_name: str | None = None,
    ) -> WorkerId:
        """The cheapest worker for ``tokens``; ties go to the smallest worker id.

        Raises :class:`~kvevents.errors.ConfigError` when there is no worker at all.
        """
        ranked = self.score(tokens, loads, lora_name)
        if not ranked:
            raise ConfigError("no workers to route to: the index is empty and no loads given")
        return ranked[0].worker


def _per_worker_gpu(gpu_ends: dict[int, int], lay: _Layout) -> dict[WorkerId, int]:
    """Worker GPU hits from slot ends: the minimum over its slots, in whole blocks of each."""
    unit = lay.canonical
    out: dict[WorkerId, int] = {}
    multi: set[WorkerId] = set()
    slot_worker = lay.slot_worker
    worker_slots = lay.worker_slots
    for slot, e in gpu_ends.items():
        wid = slot_worker[slot]
        if len(worker_slots[wid]) > 1:
            multi.add(wid)
        else:
            out[wid] = e * unit
    for wid in multi:
        low = min(gpu_ends.get(s, 0) for s in worker_slots[wid]) * unit
        align = lay.worker_align[wid]
        out[wid] = low // align * align
    return out


def _walk(
    keys: list[int],
    marks: Mapping[int, int],
    classes: list[tuple[int, int]],
    alive: int,
    starts: dict[int, int],
) -> dict[int, int]:
    """Walk the prompt's unit keys once for many slots at a time.

    ``classes`` are (units per step, slot mask): a slot of step ``u`` is checked at every
    unit index ``j`` with ``j % u == 0``.  Slots in ``alive`` are checked from their first
    step; those in ``starts[j]`` join at ``j``.  A slot dies at its first miss.  Returns,
    per slot with at least one hit, the unit index where its run of hits ends.
    """
    n = len(keys)
    ends: dict[int, int] = {}
    hits = 0
    get = marks.get
    pending_starts = dict(starts)
    if len(classes) == 1 and not pending_starts:
        u, mask = classes[0]
        alive &= mask
        j = u
        while j <= n and alive:
            held = get(keys[j - 1], 0)
            dead = alive & ~held
            if dead:
                d = dead & hits
                while d:  # usually one or two slots die at a time
                    low = d & -d
                    ends[low.bit_length() - 1] = j - u
                    d ^= low
                alive ^= dead
            hits |= alive
            j += u
        if alive & hits:
            last = (n // u) * u
            for s in _bits(alive & hits):
                ends[s] = last
        return ends
    steps = [u for u, _ in classes]
    masks = [m for _, m in classes]
    total = 0
    for m in masks:
        total |= m
    alive &= total
    step = 0
    for u in steps:
        step = math.gcd(step, u)
    # every class boundary and every start is a multiple of ``step``
    for j in range(step, n + 1, step):
        if pending_starts:
            s_mask = pending_starts.pop(j, 0)
            alive |= s_mask & total
        elif not alive:
            break
        if not alive:
            continue
        b = 0
        for u, m in zip(steps, masks):
            if j % u == 0:
                b |= m
        chk = alive & b
        if not chk:
            continue
        held = get(keys[j - 1], 0)
        dead = chk & ~held
        if dead:
            d = dead & hits
            if d:
                for u, m in zip(steps, masks):
                    dm = d & m
                    if dm:
                        if dm & (dm - 1):
                            for s in _bits(dm):
                                ends[s] = j - u
                        else:
                            ends[dm.bit_length() - 1] = j - u
            alive ^= dead
        hits |= chk & held
    rest = alive & hits
    if rest:
        for u, m in zip(steps, masks):
            rm = rest & m
            if rm:
                last = (n // u) * u
                for s in _bits(rm):
                    ends[s] = last
    return ends


def _bits(x: int) -> list[int]:
    """Positions of the set bits of ``x``, lowest first."""
    if x.bit_count() <= 16:
        out = []
        while x:
            low = x & -x
            out.append(low.bit_length() - 1)
            x ^= low
        return out
    s = bin(x)[:1:-1]
    out = []
    i = s.find("1")
    while i >= 0:
        out.append(i)
        i = s.find("1", i + 1)
    return out
