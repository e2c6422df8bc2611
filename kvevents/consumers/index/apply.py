"""The batch apply loop: every event of a batch, in order, with the dominant shapes inline.

One job: dispatch each event to the room that applies it (:mod:`.stores` for stores,
:mod:`.refs` for removals and clears), taking two fast paths beside that general path
for the shapes that dominate a vLLM stream: a GPU ``BlockRemoved`` of one hash with a
packed record (the steps of :meth:`RefRules.remove`), and a one-hash CPU/STORAGE
placeholder whose GPU record is here (the steps of :meth:`Stores.store_placeholder` and
:meth:`RefRules.ref`).  Both read records with :mod:`.records`' constants and change
marks with :mod:`.marks`' steps; the differential and fast-path property tests hold them
to the general path.  Imports :mod:`.marks`, :mod:`.records`, :mod:`.stores` and
:mod:`.workers`.
"""

from __future__ import annotations

from kvevents.consumers.index.legacy import legacy_remove, legacy_store
from kvevents.consumers.index.marks import add_dup, drop_dup
from kvevents.consumers.index.records import (
    CK_MASK,
    FREE_LINK,
    GPU_ONE,
    GPU_TWO,
    HAS_CK,
    PARENT_MASK,
    PARENT_SHIFT,
)
from kvevents.consumers.index.stores import Stores
from kvevents.consumers.index.workers import PLACEHOLDER_TIER, TIER_OF, TIERS, WorkerState
from kvevents.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

__all__ = ["Feeder"]


class Feeder(Stores):
    """Applies event batches to the index state (see the module docstring)."""

    def apply(self, source: str, dp_rank: int, batch: KVEventBatch) -> None:
        """Apply every event of ``batch`` from worker ``(source, dp_rank)`` in order."""
        stats = self.stats
        stats.batches += 1
        w = self.workers.get((source, dp_rank))
        if w is None:
            w = self.worker((source, dp_rank))
        # The dominant shape, a GPU BlockRemoved of one hash whose record is a packed int
        # (vLLM sends one event per freed block), is applied inline: the same steps as
        # apply_event -> RefRules.remove, without the calls; so is a one-hash CPU/STORAGE
        # placeholder whose GPU record is here (store_placeholder -> RefRules.ref).
        # Everything else goes through apply_event.
        groups = w.groups
        wid = w.wid
        gpu_marks = self.marks[0]
        cap = self.cap
        retention_room = self.retention
        retired = retention_room.records
        retention = retention_room.limit
        applied = 0
        block_events = 0
        gpu_removed = 0  # not yet added to stats.removed["GPU"]
        gpu_unknown = 0  # not yet added to stats.unknown_removals["GPU"]
        try:
            for ev in batch.events:
                if type(ev) is BlockRemoved:
                    hashes = ev.block_hashes
                    medium = ev.medium
                    if medium == "CPU" or medium == "STORAGE":
                        if ev.group_idx is not None:  # (not a legacy removal)
                            if gpu_removed:
                                stats.removed[MEDIUM_GPU] += gpu_removed
                                gpu_removed = 0
                            applied += 1
                            block_events += len(hashes)
                            self.remove(w, ev.group_idx, hashes, TIER_OF[medium])
                            continue
                    elif len(hashes) == 1 and (medium == "GPU" or medium is None):
                        group = ev.group_idx or 0
                        gs = groups.get(group)
                        if gs is not None:
                            h = hashes[0]
                            meta = gs.meta
                            m = meta.get(h)
                            if type(m) is int and m >= GPU_ONE:
                                applied += 1
                                block_events += 1
                                gpu_removed += 1
                                meta[h] = m - GPU_ONE
                                if m >= GPU_TWO:
                                    continue  # still held by another store
                                if m & HAS_CK:
                                    ck = m & CK_MASK
                                    if gpu_marks.dups and drop_dup(gpu_marks, ck, gs.bit):
                                        pass  # another engine block of this slot has it
                                    else:  # (marks.unmark, inline)
                                        v = gpu_marks.get(ck)
                                        if v is not None:
                                            if v == gs.bit:  # the only holder
                                                del gpu_marks[ck]
                                            else:
                                                v &= ~gs.bit
                                                if v:
                                                    gpu_marks[ck] = v
                                                else:
                                                    del gpu_marks[ck]
                                r = gs.refs
                                if h in r[1] or h in r[2]:
                                    continue
                                cap.resident -= 1
                                deferred = gs.deferred
                                if deferred and h in deferred:
                                    del deferred[h]
                                if not m & FREE_LINK and gs.kids:
                                    # its parent has one resident child fewer
                                    p = (m >> PARENT_SHIFT) & PARENT_MASK
                                    if p:
                                        kids = gs.kids
                                        p -= 1
                                        c = kids.pop(p, None)  # (Eviction.unkid, inline)
                                        if c is not None:
                                            if c > 1:
                                                kids[p] = c - 1
                                            elif p in deferred:
                                                cap.ready.append((gs, p))
                                retired[(wid, group, h)] = None
                                if len(retired) > retention:
                                    retention_room.trim()
                                continue
                            if m is None or type(m) is int:
                                # a hash the GPU tier does not hold (evicted by the memory
                                # cap, or never announced): RefRules.remove_unknown's count
                                applied += 1
                                block_events += 1
                                gpu_unknown += 1
                                continue
                elif type(ev) is BlockStored and ev.medium == "GPU":
                    if gpu_removed:
                        stats.removed[MEDIUM_GPU] += gpu_removed
                        gpu_removed = 0
                    applied += 1
                    block_events += len(ev.block_hashes)
                    self.store_described(w, ev, 0)
                    continue
                elif type(ev) is BlockStored and w.bpc_fixed:
                    # a one-hash CPU/STORAGE placeholder whose GPU record is here: the
                    # join of _store_placeholder and _ref, inline
                    hashes = ev.block_hashes
                    tier = PLACEHOLDER_TIER.get(ev.medium, 0)
                    if (
                        tier
                        and len(hashes) == 1
                        and not (ev.block_size > 0 and ev.token_ids)
                        and type(hashes[0]) is int
                    ):
                        group = ev.group_idx or 0
                        gs = groups.get(group)
                        if gs is not None and (
                            ev.kv_cache_spec_kind is None or gs.kind is not None
                        ):
                            h = hashes[0]
                            m = gs.meta.get(h)
                            if type(m) is int:
                                if gpu_removed:
                                    stats.removed[MEDIUM_GPU] += gpu_removed
                                    gpu_removed = 0
                                applied += 1
                                block_events += 1
                                stats.stored[TIERS[tier]] += 1
                                stats.joined += 1
                                r = gs.refs
                                refs = r[tier]
                                c = refs.get(h, 0)
                                refs[h] = c + 1
                                if c:
                                    continue
                                if m & HAS_CK:  # (marks.mark, inline)
                                    marks = self.marks[tier]
                                    ck = m & CK_MASK
                                    v = marks.get(ck)
                                    if v is None:
                                        marks[ck] = gs.bit
                                    elif v & gs.bit:
                                        add_dup(marks, ck, gs.bit)
                                    else:
                                        marks[ck] = v | gs.bit
                                if m >= GPU_ONE or h in r[3 - tier]:
                                    continue
                                cap.resident += 1
                                if retired:
                                    retired.pop((wid, group, h), None)
                                if cap.tracking:
                                    cap.enter(gs, h, m)
                                if cap.resident > cap.watch:
                                    cap.watch_hit()
                                continue
                if gpu_removed:
                    stats.removed[MEDIUM_GPU] += gpu_removed
                    gpu_removed = 0
                self.apply_event(w, ev)
        finally:
            if gpu_removed:
                stats.removed[MEDIUM_GPU] += gpu_removed
            if gpu_unknown:
                stats.unknown_removals[MEDIUM_GPU] += gpu_unknown
            stats.applied += applied
            stats.block_events += block_events

    def apply_event(self, w: WorkerState, ev: KVEvent) -> None:
        """Apply one event from worker ``w`` (the general path: every kind of event)."""
        stats = self.stats
        stats.applied += 1
        if type(ev) is BlockStored:
            tier = TIER_OF.get(ev.medium, -1)
            n = len(ev.block_hashes)
            stats.block_events += n
            if tier == 0:
                self.store_described(w, ev, 0)
            elif tier < 0:
                stats.skipped["unknown_medium"] += n
            elif ev.block_size > 0 and ev.token_ids:
                self.store_self_describing(w, ev, tier)
            elif ev.group_idx is None and any(isinstance(h, bytes) for h in ev.block_hashes):
                legacy_store(self, w, ev, tier)
            else:
                self.store_placeholder(w, ev, tier)
        elif type(ev) is BlockRemoved:
            tier = TIER_OF.get(ev.medium, -1)
            stats.block_events += len(ev.block_hashes)
            if tier < 0:
                stats.skipped["unknown_medium"] += len(ev.block_hashes)
            elif (
                tier > 0
                and ev.group_idx is None
                and any(isinstance(h, bytes) for h in ev.block_hashes)
            ):
                legacy_remove(self, w, ev.block_hashes, tier)
            else:
                self.remove(w, ev.group_idx or 0, ev.block_hashes, tier)
        elif type(ev) is AllBlocksCleared:
            stats.cleared += 1
            self.clear_tiers(w, keep_metadata=True)
        else:  # pragma: no cover - the decoder yields only the three classes
            stats.skipped["unknown_event"] += 1
