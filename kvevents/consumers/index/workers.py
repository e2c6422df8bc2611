"""Workers, their KV-cache groups and slots: the state every other room works on.

One job: the per-(worker, group) tables (metadata records, CPU/STORAGE refcounts, the
eviction bookkeeping's children counts), the slot numbering the router's bitsets use,
and the vocabulary of tiers and group kinds.  Imports only :mod:`.records` and
:mod:`kvevents.events`.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

from kvevents.consumers.index.records import (
    Hash,
    RecordMap,
    RefCounts,
    gpu_refs,
    new_record_map,
    new_ref_counts,
)
from kvevents.events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, PREFIX_INDEXABLE_SPEC_KINDS

__all__ = [
    "CPU",
    "GPU",
    "IGNORED_KINDS",
    "KEYED_KINDS",
    "LOCAL_KINDS",
    "PLACEHOLDER_TIER",
    "STORAGE",
    "SW_KINDS",
    "TIERS",
    "TIER_OF",
    "GroupState",
    "WorkerId",
    "WorkerState",
    "WorkerTable",
    "bpc_lookup",
    "per_worker",
]

WorkerId = tuple[str, int]
"""A worker: ``(source, dp_rank)`` (source is the endpoint or capture name)."""

TIERS: tuple[str, str, str] = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
"""Tier names in index order: 0 = GPU, 1 = CPU, 2 = STORAGE."""
GPU, CPU, STORAGE = 0, 1, 2
"""The tiers' indices (in :data:`TIERS`, the marks and ``GroupState.refs``)."""
# Other spellings of the offload tiers seen on the wire: vLLM 0.26's "FS" / "OBJ" (before
# STORAGE replaced them) and other producers' names for host memory and storage.
_MEDIUM_ALIASES: dict[str | None, int] = {
    "CPU_PINNED": 1,
    "FS": 2,
    "OBJ": 2,
    "DISK": 2,
    "EXTERNAL": 2,
    "REMOTE": 2,
}
TIER_OF: dict[str | None, int] = {
    None: 0,
    MEDIUM_GPU: 0,
    MEDIUM_CPU: 1,
    MEDIUM_STORAGE: 2,
    **_MEDIUM_ALIASES,
}
"""Tier index of every medium spelling the index accepts (a new spelling goes here)."""
PLACEHOLDER_TIER: dict[str | None, int] = {
    MEDIUM_CPU: 1,
    MEDIUM_STORAGE: 2,
    **_MEDIUM_ALIASES,
}
"""The offload tiers' spellings (a store in one of them may be a placeholder)."""
SW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
"""Sliding-window group kinds."""
LOCAL_KINDS = frozenset({"chunked_local_attention"})
"""Chunked local attention group kinds."""
IGNORED_KINDS = frozenset({"encoder_only_attention", "cross_attention"})
"""Kinds vLLM's prefix cache does not consult (encoder outputs, cross attention)."""
KEYED_KINDS = PREFIX_INDEXABLE_SPEC_KINDS | SW_KINDS | LOCAL_KINDS
"""Kinds whose blocks get content keys: prefix-indexable ones, and the windowed kinds the
hybrid lookup judges from their own blocks."""


class GroupState:
    """Per (worker, KV-cache group) state: the group's slot, kind and tables.

    ``meta`` maps an engine hash to its metadata record (:mod:`.records`; the GPU
    refcount lives in the record), ``refs[1]`` / ``refs[2]`` the CPU / STORAGE refcount
    per chunk-tail hash (``refs[0]`` stays empty).  ``kids`` and ``deferred`` belong to
    the memory cap (:mod:`.eviction`): how many resident entries name each hash as their
    parent, and the entries the eviction queue passed over because they had resident
    children.
    """

    __slots__ = (
        "bit",
        "block_size",
        "deferred",
        "group",
        "indexable_kind",
        "kids",
        "kind",
        "meta",
        "refs",
        "slot",
        "window",
    )

    def __init__(self, group: int, slot: int) -> None:
        self.group = group
        self.slot = slot
        self.bit = 1 << slot
        self.block_size = 0  # the largest GPU block size seen (smaller: partial tails)
        self.kind: str | None = None
        self.window: int | None = None  # kv_cache_spec_sliding_window
        # kind None, prefix-indexable, sliding window or chunked local: compute content keys
        self.indexable_kind = True
        self.meta: RecordMap = new_record_map()
        # (GPU references are counted in the records; refs[GPU] stays an empty dict)
        self.refs: tuple[dict[Hash, int], RefCounts, RefCounts] = (
            {},
            new_ref_counts(),
            new_ref_counts(),
        )
        self.kids: dict[Hash, int] = {}
        self.deferred: dict[Hash, None] = {}

    def held(self, h: Hash) -> bool:
        """Whether any tier holds ``h`` in this group (the entry is resident)."""
        m = self.meta.get(h)
        r = self.refs
        return (m is not None and gpu_refs(m) > 0) or h in r[CPU] or h in r[STORAGE]


class WorkerState:
    """One worker: its groups and its learned or configured settings."""

    __slots__ = ("bpc", "bpc_fixed", "eagle", "groups", "la_fixed", "lookahead", "wid")

    def __init__(
        self, wid: WorkerId, bpc: int, lookahead: int | None = None, eagle: bool = False
    ) -> None:
        self.wid = wid
        self.groups: dict[int, GroupState] = {}
        self.bpc = bpc  # blocks per chunk; 0 = unknown
        self.bpc_fixed = bpc > 0
        self.lookahead = lookahead or 0  # speculative lookahead tokens per block hash
        self.la_fixed = lookahead is not None
        self.eagle = eagle  # EAGLE's drop of the last matched block


class WorkerTable:
    """Every worker by id, and every group by slot (the lowest free slot is reused).

    ``layout_changed`` is set whenever something the router's layout is built from
    changes (a group or worker added or removed, a group's kind, block size or window, a
    worker's blocks per chunk or lookahead); whoever builds the layout clears it.
    """

    __slots__ = ("free_slots", "layout_changed", "next_slot", "slots", "workers")

    def __init__(self) -> None:
        self.workers: dict[WorkerId, WorkerState] = {}
        self.slots: dict[int, tuple[WorkerState, GroupState]] = {}
        self.free_slots: list[int] = []
        self.next_slot = 0
        self.layout_changed = True

    def group(self, w: WorkerState, group: int) -> GroupState:
        """The state of ``group`` of ``w``, created (with a slot) when new."""
        gs = w.groups.get(group)
        if gs is None:
            if self.free_slots:
                slot = heapq.heappop(self.free_slots)
            else:
                slot = self.next_slot
                self.next_slot += 1
            gs = GroupState(group, slot)
            w.groups[group] = gs
            self.slots[slot] = (w, gs)
            self.layout_changed = True
        return gs

    def remove(self, wid: WorkerId) -> None:
        """Forget worker ``wid`` and free its slots (its tables must be cleared first)."""
        w = self.workers.pop(wid, None)
        if w is None:
            return
        for gs in w.groups.values():
            del self.slots[gs.slot]
            heapq.heappush(self.free_slots, gs.slot)
        self.layout_changed = True

    def live(self, gs: GroupState) -> bool:
        """Whether ``gs`` still belongs to a worker of the table (not a removed one's)."""
        t = self.slots.get(gs.slot)
        return t is not None and t[1] is gs


def per_worker(config: Any, wid: WorkerId) -> Any:
    """A per-worker setting: one value for all, or a mapping by WorkerId, source or "*"."""
    if not isinstance(config, Mapping):
        return config
    for key in (wid, wid[0], "*"):
        if key in config:
            return config[key]
    return None


def bpc_lookup(config: int | Mapping[Any, int] | None, wid: WorkerId) -> int:
    """Blocks per chunk configured for ``wid`` (0: learn it)."""
    if config is None:
        return 0
    if isinstance(config, int):
        return config
    for key in (wid, wid[0]):
        if key in config:
            return int(config[key])
    return int(config.get("*", 0))
