"""What the router walks: per-worker lookup plans and the slot classes of the bitset walk.

One job: turn the index's workers and groups into the structures
:mod:`kvevents.consumers.router` reads (:class:`IndexLayout`, :class:`LookupPlan`,
:class:`SpecGroup`).  Built on demand and cached by the index until a worker, group,
kind, block size, window, blocks per chunk or lookahead changes.  Imports only
:mod:`.workers` and :mod:`kvevents.events`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvevents.consumers.index.workers import (
    IGNORED_KINDS,
    LOCAL_KINDS,
    SW_KINDS,
    GroupState,
    WorkerId,
    WorkerState,
)
from kvevents.events import PREFIX_INDEXABLE_SPEC_KINDS

__all__ = [
    "IndexLayout",
    "LookupPlan",
    "SpecGroup",
    "build_layout",
    "lookup_plan",
    "slot_indexable",
]


@dataclass(frozen=True)
class SpecGroup:
    """Groups a worker's hybrid lookup judges together (vLLM's SpecGroup: one spec)."""

    cls: str
    """``"full"``, ``"sw"`` (sliding window) or ``"local"`` (chunked local attention)."""
    block_size: int
    window: int
    """Sliding window or attention chunk size in tokens (0 for full attention)."""
    bits: int
    """Slot bits of the member groups: a block is held when every member holds it."""
    slots: tuple[int, ...] = ()


@dataclass(frozen=True)
class LookupPlan:
    """How vLLM would look a request up on one worker (see :mod:`kvevents.consumers.router`)."""

    wid: WorkerId
    blocked: str | None
    """Why the worker is never credited (a group kind vLLM's lookup is not modelled for,
    an unknown window or block size), or None."""
    unitary: bool
    """One KV-cache group in all (vLLM's UnitaryKVCacheCoordinator)."""
    spec_groups: tuple[SpecGroup, ...]
    """In vLLM's GPU lookup order: full attention first."""
    align: int
    """Tokens a GPU hit is aligned to: the block size, or the lcm of the groups' sizes."""
    chunk_groups: tuple[tuple[str, int, int, int], ...]
    """Per offloaded group in the offload lookup order (full attention first):
    ``(cls, block size, window in chunks (0 for full), slot bit)``."""
    windowed: bool
    """Some group is windowed (sliding window or chunked local): the CPU bound starts one
    token short of the request."""
    bpc: int
    """Blocks per chunk (0: unknown, no CPU/STORAGE credit)."""
    lookahead: int
    """Speculative lookahead tokens hashed with each block (0: none)."""
    eagle: bool
    """EAGLE's drop of the last matched block."""


@dataclass
class IndexLayout:
    """What the router's walk needs about slots (a slot is one worker's KV-cache group;
    its bit in a tier's marks is ``1 << slot``), rebuilt when slots change.

    The bitset walks serve *simple* workers: one full-attention group, no speculative
    mode.  Every other worker is looked up on its own, from its :class:`LookupPlan`.
    """

    canonical: int
    """Tokens per content-key unit (the index's ``canonical_block_size``)."""
    gpu_classes: list[tuple[int, int]]
    """(units per engine block, slot mask) for the slots of simple workers."""
    chunk_classes: list[tuple[int, int]]
    """(units per chunk, slot mask) for those slots whose worker's blocks_per_chunk is known."""
    gpu_mask: int
    chunk_mask: int
    slot_worker: dict[int, WorkerId]
    nslots: int = 0
    """One more than the highest simple slot."""
    pos_wids: list[WorkerId | None] = field(default_factory=list)
    """Indexed by ``slot + 1`` (a slot bit's ``bit_length()``): the simple slot's worker;
    ``nslots + 1`` entries."""
    pos_bits: list[int] = field(default_factory=list)
    """Indexed by ``slot + 1``: ``1 << slot`` (entry 0 is 0)."""
    simple_mask: int = 0
    """Slots of simple workers."""
    plans: dict[WorkerId, LookupPlan] = field(default_factory=dict)
    """Every worker's lookup plan."""
    complex_workers: tuple[WorkerId, ...] = ()
    """Workers the bitset walks do not serve (hybrid, windowed, speculative)."""
    complex_full_classes: list[tuple[int, int]] = field(default_factory=list)
    """(units per block, slot mask) of those workers' full-attention slots (without
    lookahead), whose prefix runs one walk finds for all of them."""
    complex_full_mask: int = 0


def slot_indexable(w: WorkerState, gs: GroupState) -> bool:
    """Whether the group is full attention (a kind-less group only when alone)."""
    if gs.kind is None:
        return len(w.groups) == 1
    return gs.kind in PREFIX_INDEXABLE_SPEC_KINDS


def lookup_plan(w: WorkerState, unit: int) -> LookupPlan:
    """Worker ``w``'s lookup plan, for content-key units of ``unit`` tokens."""
    blocked: str | None = None
    members: list[tuple[str, int, int, GroupState]] = []
    for g in sorted(w.groups):
        gs = w.groups[g]
        kind = gs.kind
        if slot_indexable(w, gs):
            cls, window = "full", 0
        elif kind in SW_KINDS or kind in LOCAL_KINDS:
            cls = "sw" if kind in SW_KINDS else "local"
            window = gs.window or 0
            if window <= 0:
                blocked = blocked or "no_window"
        elif kind is None or kind in IGNORED_KINDS:
            continue  # not consulted by vLLM's prefix lookup (or unknowable)
        else:
            blocked = blocked or "kind:" + kind
            continue
        if not gs.block_size or gs.block_size % unit:
            blocked = blocked or "block_size"
        members.append((cls, gs.block_size, window, gs))
    if not members:
        blocked = blocked or "no_group"
    spec: dict[tuple[str, int, int], list[int]] = {}
    for cls, size, window, gs in members:
        spec.setdefault((cls, size, window), []).append(gs.slot)
    order = sorted(spec.items(), key=lambda kv: kv[0][0] != "full")  # stable
    spec_groups = tuple(
        SpecGroup(c, b, wdw, sum(1 << x for x in slots), tuple(slots))
        for (c, b, wdw), slots in order
    )
    sizes = [m[1] for m in members if m[1]]
    unitary = len(w.groups) == 1
    align = math.lcm(*sizes) if sizes else 1
    bpc = w.bpc
    chunk_groups: list[tuple[str, int, int, int]] = []
    for cls, size, window, gs in sorted(members, key=lambda m: m[0] != "full"):
        tpc = bpc * size
        wchunks = 0 if cls == "full" or not tpc else -(-window // tpc)
        chunk_groups.append((cls, size, wchunks, gs.bit))
    return LookupPlan(
        wid=w.wid,
        blocked=blocked,
        unitary=unitary,
        spec_groups=spec_groups,
        align=align,
        chunk_groups=tuple(chunk_groups),
        windowed=any(m[0] != "full" for m in members),
        bpc=bpc,
        lookahead=w.lookahead,
        eagle=w.eagle,
    )


def build_layout(workers: dict[WorkerId, WorkerState], unit: int) -> IndexLayout:
    """The layout of ``workers`` (slot classes for the router's walk, per-worker plans)."""
    gpu: dict[int, int] = {}
    chunk: dict[int, int] = {}
    slot_worker: dict[int, WorkerId] = {}
    plans: dict[WorkerId, LookupPlan] = {}
    complex_workers: list[WorkerId] = []
    cfull: dict[int, int] = {}
    for wid in sorted(workers):
        w = workers[wid]
        plan = plans[wid] = lookup_plan(w, unit)
        simple = (
            plan.blocked is None
            and plan.unitary
            and plan.spec_groups[0].cls == "full"
            and not plan.lookahead
            and not plan.eagle
        )
        if not simple:
            if plan.blocked is None:  # (a blocked worker is never credited)
                complex_workers.append(wid)
                if not plan.lookahead:
                    for sg in plan.spec_groups:
                        if sg.cls == "full":
                            u = sg.block_size // unit
                            cfull[u] = cfull.get(u, 0) | sg.bits
            continue
        (gs,) = w.groups.values()
        slot_worker[gs.slot] = wid
        u = gs.block_size // unit
        gpu[u] = gpu.get(u, 0) | gs.bit
        if w.bpc:
            v = u * w.bpc
            chunk[v] = chunk.get(v, 0) | gs.bit
    nslots = max(slot_worker, default=-1) + 1
    pos_wids: list[WorkerId | None] = [None] * (nslots + 1)
    simple_mask = 0
    for slot, wid in slot_worker.items():
        pos_wids[slot + 1] = wid
        simple_mask |= 1 << slot
    return IndexLayout(
        canonical=unit,
        gpu_classes=sorted(gpu.items()),
        chunk_classes=sorted(chunk.items()),
        gpu_mask=_or_all(gpu.values()),
        chunk_mask=_or_all(chunk.values()),
        slot_worker=slot_worker,
        nslots=nslots,
        pos_wids=pos_wids,
        pos_bits=[0] + [1 << s for s in range(nslots)],
        simple_mask=simple_mask,
        plans=plans,
        complex_workers=tuple(complex_workers),
        complex_full_classes=sorted(cfull.items()),
        complex_full_mask=_or_all(cfull.values()),
    )


def _or_all(values: Iterable[int]) -> int:
    out = 0
    for v in values:
        out |= v
    return out
