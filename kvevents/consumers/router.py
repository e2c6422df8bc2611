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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, compress, islice, repeat
from operator import sub
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
        if len(lay.gpu_classes) == 1 and len(lay.chunk_classes) <= 1 and not lay.multi_workers:
            return _uniform_matches(keys, lay, index)
        # Results per slot, in tokens, for the slots of single-slot workers ("simple"
        # slots, usually all of them); workers with several scoring groups are resolved
        # per worker from their slots' run ends.  Each walk reports its hits as runs
        # (end, slots); the next tier's start positions and the "whole chunk beyond the
        # base" rule are applied to those runs as whole bitsets, so the per-slot Python
        # work is one bit extraction per tier hit plus the C-level assembly of the answer.
        gpu_end = [0] * (lay.nslots + 1)  # indexed by slot + 1
        slot_end: dict[int, int] = {}
        runs = _walk(keys, index.marks(0), lay.gpu_classes, lay.gpu_mask, {})
        starts: dict[int, int] = {}
        aligned = _gpu_runs(runs, lay, gpu_end, slot_end, starts)
        hit = 0
        for _, bits in runs:
            hit |= bits
        hit &= lay.simple_mask
        multi: dict[WorkerId, list[int]] = {}
        for wid in lay.multi_workers:
            low = min(slot_end.get(s, 0) for s in lay.worker_slots[wid]) * unit
            align = lay.worker_align[wid]
            multi[wid] = [low // align * align, 0, 0]
        if not lay.chunk_classes:
            return _assemble(lay, gpu_end, None, None, multi, hit)
        tier_ends: list[list[int] | None] = [gpu_end, None, None]
        base_end = gpu_end
        for tier in (1, 2):
            marks = index.marks(tier)
            if not marks:
                continue
            walk_starts = _multi_starts(lay, multi, starts) if multi else starts
            late = sum(walk_starts.values())  # disjoint slot sets: the sum is the union
            runs = _walk(keys, marks, lay.chunk_classes, lay.chunk_mask & ~late, walk_starts)
            end = base_end.copy()
            slot_end = {}
            credited = _chunk_runs(runs, lay, starts, aligned, end, slot_end)
            hit |= credited
            tier_ends[tier] = base_end = end
            if multi:
                _multi_chunk(lay, multi, slot_end, tier)
            if tier == 1 and index.marks(2):
                # STORAGE starts after the CPU hit, or where the CPU walk started
                nxt: dict[int, int] = {}
                for first, bits in starts.items():
                    rest = bits & ~credited
                    if rest:
                        nxt[first] = rest
                for e, bits in runs:
                    got = bits & credited
                    if got:
                        for v, mask in lay.chunk_classes:
                            b = got & mask
                            if b:
                                nxt[e + v] = nxt.get(e + v, 0) | b
                starts = nxt
                aligned |= credited
        return _assemble(lay, gpu_end, tier_ends[1], tier_ends[2], multi, hit)

    # ---------------------------------------------------------------- choosing

    def score(
        self,
        tokens: Sequence[int],
        loads: Mapping[WorkerId, float] | None = None,
        lora_name: str | None = None,
    ) -> list[Candidate]:
        """Every candidate worker with its match and cost, best first.

        Candidates are the index's workers plus any worker named in ``loads``, less
        the workers marked stale (:meth:`BlockIndex.set_stale`).
        """
        matches = self.find_matches(tokens, lora_name)
        workers = set(self.index.workers())
        if loads:
            workers.update(loads)
        workers -= self.index.stale_workers
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


_tuple_new = tuple.__new__


def _uniform_matches(keys: list[int], lay: _Layout, index: BlockIndex) -> dict[WorkerId, Match]:
    """find_matches for the usual fleet: one engine block size, at most one chunk size,
    one scoring group per worker.  The same rules as the general path, with each walk
    fused with the recording of its runs."""
    unit = lay.canonical
    (u, gmask), *_ = lay.gpu_classes
    v, cmask = lay.chunk_classes[0] if lay.chunk_classes else (0, 0)
    pos_bits = lay.pos_bits
    gpu_end = [0] * (lay.nslots + 1)  # tokens, indexed by slot + 1
    get = index.marks(0).get
    ks = keys[u - 1 :: u]
    first_hit = alive = gmask & get(ks[0], 0) if ks else 0
    starts: dict[int, int] = {}  # unit position -> slots whose CPU walk starts there
    aligned = 0  # slots whose GPU end is a whole number of chunks
    part = bool(gmask & ~cmask)  # some slots have no chunk size (yet)
    first = v  # the chunk boundary after the current run end
    pend = 0  # slots whose CPU walk starts at ``first``
    e = u
    # the None sentinel misses for everyone: survivors end at the last whole block
    for k in chain(islice(ks, 1, None), (None,)) if alive else ():
        now = alive & get(k, 0)  # type: ignore[arg-type]
        if now != alive:
            b = alive ^ now  # these slots' run of hits ends at e
            alive = now
            if v:
                cb = b & cmask if part else b
                if e >= first:
                    if pend:
                        starts[first] = pend
                        pend = 0
                    first = (e // v + 1) * v
                pend |= cb
                if e == first - v:
                    aligned |= cb
            tokens = e * unit
            while b:  # one slot per bit, highest first
                p = b.bit_length()
                gpu_end[p] = tokens
                b ^= pos_bits[p]
            if not now:
                break
        e += u
    if pend:
        starts[first] = pend
    if not v:
        return _assemble(lay, gpu_end, None, None, {}, first_hit)
    ends: list[list[int] | None] = [gpu_end, None, None]
    base = gpu_end
    # slots with a GPU hit start their CPU walk late; the others at the first chunk
    late = first_hit & cmask
    want_next = bool(index.marks(2))
    hit = first_hit
    for tier in (1, 2):
        marks = index.marks(tier)
        if not marks:
            continue
        end = base.copy()
        credited, nxt = _uniform_chunk_walk(
            keys[v - 1 :: v], marks, v, unit, cmask & ~late, starts, aligned, end, pos_bits,
            want_next and tier == 1,
        )  # fmt: skip
        ends[tier] = base = end
        hit |= credited
        if tier == 1 and want_next:
            # STORAGE starts after the CPU hit, or where the CPU walk started
            for f, bits in starts.items():
                rest = bits & ~credited
                if rest:
                    nxt[f] = nxt.get(f, 0) | rest
            starts = nxt
            late = sum(nxt.values())  # disjoint slot sets: the sum is the union
            aligned |= credited
    return _assemble(lay, gpu_end, ends[1], ends[2], {}, hit)


def _uniform_chunk_walk(
    ks: list[int],
    marks: Mapping[int, int],
    v: int,
    unit: int,
    alive: int,
    starts: dict[int, int],
    aligned: int,
    end: list[int],
    pos_bits: list[int],
    want_next: bool,
) -> tuple[int, dict[int, int]]:
    """One chunk tier of :func:`_uniform_matches` over the chunk keys ``ks``.

    Slots in ``alive`` start at the first chunk, those in ``starts[j]`` at unit ``j``.
    A slot is credited when its run adds a whole chunk beyond its base: it started at
    the first chunk, or its base is chunk-aligned (``aligned``), or its run goes past
    the chunk where it started.  Credited slots get ``end[slot + 1]`` (tokens).  Returns
    the credited slots and, with ``want_next``, where they start the next tier.
    """
    get = marks.get
    sget = starts.get
    last_start = max(starts, default=0)
    credited = 0
    nxt: dict[int, int] = {}
    j = 0
    for k in chain(ks, (None,)):
        j += v
        new = sget(j, 0)
        if new:
            alive |= new
        elif not alive:
            if j >= last_start:
                break
            continue
        if j == v:
            new = alive  # the first chunk: nobody has a hit yet
        now = alive & get(k, 0)  # type: ignore[arg-type]
        if now != alive:
            b = alive ^ now
            alive = now
            if new:
                b &= ~new  # joined here and missed at once: no hit
            e = j - v
            st = sget(e)
            if st:
                b &= ~(st & ~aligned)  # started at e with an unaligned base: < 1 chunk
            if b:
                credited |= b
                if want_next:
                    nxt[j] = b
                tokens = e * unit
                while b:
                    p = b.bit_length()
                    end[p] = tokens
                    b ^= pos_bits[p]
    return credited, nxt


def _gpu_runs(
    runs: list[tuple[int, int]],
    lay: _Layout,
    gpu_end: list[int],
    slot_end: dict[int, int],
    starts: dict[int, int],
) -> int:
    """Record GPU runs: simple slots' ends in ``gpu_end`` (tokens, indexed by slot + 1),
    other slots' ends in ``slot_end`` (units, by slot); fill ``starts`` (unit position →
    simple slots whose CPU walk starts there).  Returns the simple slots whose GPU end is
    a whole number of chunks."""
    unit = lay.canonical
    simple = lay.simple_mask
    everyone = not lay.multi_workers
    chunk_classes = lay.chunk_classes
    pos_bits = lay.pos_bits
    aligned = 0
    if len(chunk_classes) == 1 and everyone and not simple & ~chunk_classes[0][1]:
        # the usual fleet: one chunk size, every slot scores alone
        v = chunk_classes[0][0]
        first = 0
        pend = 0
        for e, b in runs:
            f = (e // v + 1) * v
            if f != first:  # runs come mostly in order of end
                if pend:
                    starts[first] = starts.get(first, 0) | pend
                first = f
                pend = b
            else:
                pend |= b
            if not e % v:
                aligned |= b
            tokens = e * unit
            while b:  # one slot per bit, highest first
                p = b.bit_length()
                gpu_end[p] = tokens
                b ^= pos_bits[p]
        if pend:
            starts[first] = starts.get(first, 0) | pend
        return aligned
    for e, bits in runs:
        b = bits if everyone else bits & simple
        if b:
            for v, mask in chunk_classes:
                cb = b & mask
                if cb:
                    first = (e // v + 1) * v
                    starts[first] = starts.get(first, 0) | cb
                    if not e % v:
                        aligned |= cb
            tokens = e * unit
            while b:
                p = b.bit_length()
                gpu_end[p] = tokens
                b ^= pos_bits[p]
        if not everyone:
            m = bits & ~simple
            while m:
                p = m.bit_length()
                slot_end[p - 1] = e
                m ^= pos_bits[p]
    return aligned


def _chunk_runs(
    runs: list[tuple[int, int]],
    lay: _Layout,
    starts: dict[int, int],
    aligned: int,
    end: list[int],
    slot_end: dict[int, int],
) -> int:
    """Record a chunk tier's runs.  A simple slot is credited when its run adds at least
    one whole chunk beyond its base: always if it started at the first chunk, or if its
    base was chunk-aligned, or if its run goes past the chunk where it started.  Credited
    slots get ``end[slot + 1]`` (tokens); other slots' run ends go to ``slot_end`` (units,
    by slot).  Returns the credited simple slots."""
    unit = lay.canonical
    simple = lay.simple_mask
    everyone = not lay.multi_workers
    pos_bits = lay.pos_bits
    credited = 0
    for e, bits in runs:
        b = bits if everyone else bits & simple
        if b:
            st = starts.get(e)
            if st:
                b &= ~(st & ~aligned)  # started at e with an unaligned base: < 1 chunk
            if b:
                credited |= b
                tokens = e * unit
                while b:
                    p = b.bit_length()
                    end[p] = tokens
                    b ^= pos_bits[p]
        if not everyone:
            m = bits & ~simple
            while m:
                p = m.bit_length()
                slot_end[p - 1] = e
                m ^= pos_bits[p]
    return credited


def _multi_starts(
    lay: _Layout, multi: dict[WorkerId, list[int]], starts: dict[int, int]
) -> dict[int, int]:
    """``starts`` plus the start positions of multi-slot workers (from their base)."""
    unit = lay.canonical
    out = dict(starts)
    slot_chunk = lay.slot_chunk
    pos_bits = lay.pos_bits
    for wid, tiers in multi.items():
        base = tiers[0] + tiers[1] + tiers[2]
        if base <= 0:
            continue
        for slot in lay.worker_slots[wid]:
            size = slot_chunk.get(slot)
            if size is not None:
                first = (base // size + 1) * (size // unit)
                out[first] = out.get(first, 0) | pos_bits[slot + 1]
    return out


def _multi_chunk(
    lay: _Layout, multi: dict[WorkerId, list[int]], slot_end: dict[int, int], tier: int
) -> None:
    """A chunk tier's credit for multi-slot workers: every group must add at least one
    whole chunk of its own beyond the base; the smallest end wins, in whole blocks."""
    unit = lay.canonical
    slot_chunk = lay.slot_chunk
    for wid, tiers in multi.items():
        base = tiers[0] + tiers[1] + tiers[2]
        best: int | None = None
        for s in lay.worker_slots[wid]:
            e = slot_end.get(s)
            if s not in slot_chunk or e is None or e * unit - base < slot_chunk[s]:
                best = None
                break
            best = e * unit if best is None else min(best, e * unit)
        if best is None:
            continue
        align = lay.worker_align[wid]
        best = best // align * align
        if best > base:
            tiers[tier] = best - base


def _assemble(
    lay: _Layout,
    gpu_end: list[int],
    cpu_end: list[int] | None,
    storage_end: list[int] | None,
    multi: dict[WorkerId, list[int]],
    hit: int = -1,
) -> dict[WorkerId, Match]:
    """The answer: per worker with a non-zero total, its Match.

    ``hit`` (when known) covers every simple slot with a non-zero end: few of them are
    visited bit by bit, many are assembled by C loops over every position.
    """
    out: dict[WorkerId, Match]
    if hit >= 0 and hit.bit_count() * 8 < lay.nslots:
        c_end = gpu_end if cpu_end is None else cpu_end
        s_end = c_end if storage_end is None else storage_end
        pos_bits = lay.pos_bits
        found = []
        while hit:
            p = hit.bit_length()
            found.append(p)
            hit ^= pos_bits[p]
        out = {}
        pos_wids = lay.pos_wids
        for p in reversed(found):  # in slot order, as the C loops give them
            total = s_end[p]
            wid = pos_wids[p]
            if total and wid is not None:
                g = gpu_end[p]
                c = c_end[p]
                out[wid] = Match(g, c - g, total - c)
    else:
        last = gpu_end
        if cpu_end is None:
            cpu: Iterable[int] = repeat(0)
        else:
            cpu = map(sub, cpu_end, gpu_end)
            last = cpu_end
        if storage_end is None:
            storage: Iterable[int] = repeat(0)
        else:
            storage = map(sub, storage_end, last)
            last = storage_end
        matches = map(_tuple_new, repeat(Match), zip(gpu_end, cpu, storage))
        # positions without a simple worker (None) have all-zero ends and are dropped
        out = dict(compress(zip(lay.pos_wids, matches), last))  # type: ignore[arg-type]
    for wid, (g, c, st) in multi.items():
        if g or c or st:
            out[wid] = Match(g, c, st)
    return out


def _walk(
    keys: list[int],
    marks: Mapping[int, int],
    classes: list[tuple[int, int]],
    alive: int,
    starts: dict[int, int],
) -> list[tuple[int, int]]:
    """Walk the prompt's unit keys once for many slots at a time.

    ``classes`` are (units per step, slot mask): a slot of step ``u`` is checked at every
    unit index ``j`` with ``j % u == 0``.  Slots in ``alive`` are checked from their first
    step; those in ``starts[j]`` join at ``j``.  A slot dies at its first miss.  Returns
    runs ``(end, slots)``: the slots with at least one hit whose run of hits ends at unit
    index ``end``, each slot in exactly one run.
    """
    n = len(keys)
    get = marks.get
    runs: list[tuple[int, int]] = []
    if len(classes) == 1:
        u, mask = classes[0]
        alive &= mask
        ks = keys[u - 1 :: u]
        if not starts:
            if not alive or not ks:
                return runs
            alive &= get(ks[0], 0)  # slots that miss the first step never had a hit
            e = u
            for k in islice(ks, 1, None):
                now = alive & get(k, 0)
                if now != alive:
                    runs.append((e, alive ^ now))
                    if not now:
                        return runs
                    alive = now
                e += u
            if alive:
                runs.append((e, alive))
            return runs
        pending = {j: b & mask for j, b in starts.items() if b & mask}
        j = 0
        for k in ks:
            j += u
            new = pending.pop(j, 0) if pending else 0
            if new:
                alive |= new
            elif not alive:
                if not pending:
                    break
                continue
            if j == u:
                new = alive  # the first step: nobody has a hit yet
            now = alive & get(k, 0)
            if now != alive:
                dead = alive ^ now
                if new:
                    dead &= ~new  # joined here and missed at once: no hit
                if dead:
                    runs.append((j - u, dead))
                alive = now
        if alive:
            runs.append((len(ks) * u, alive))
        return runs
    hits = 0
    pending_starts = dict(starts)
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
                        runs.append((j - u, dm))
            alive ^= dead
        hits |= chk & held
    rest = alive & hits
    if rest:
        for u, m in zip(steps, masks):
            rm = rest & m
            if rm:
                runs.append(((n // u) * u, rm))
    return runs
