"""Tier refcounts: the general path of counting residencies in and out.

One job: the refcount rules every store, removal and clear goes through: a (worker,
group, hash) is *resident* while any tier holds it (GPU: the refcount in its record;
CPU/STORAGE: ``GroupState.refs``); the first reference on a tier marks its content key
in that tier's :class:`~.marks.TierMarks`, the last one unmarks it; an entry that
stops being resident keeps its record as retained metadata (:mod:`.join`); the memory
cap (:mod:`.eviction`) hears of every entry that becomes or stops being resident.
The batch loop's fast paths (:mod:`.apply`) apply these rules inline, with the same
record constants (:mod:`.records`) and mark steps (:mod:`.marks`).

:class:`RefRules` also holds the state the feeding rooms share, as documented public
attributes.  Imports :mod:`.eviction`, :mod:`.join`, :mod:`.marks`, :mod:`.records`,
:mod:`.stats` and :mod:`.workers`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvevents.consumers.index.eviction import Eviction
from kvevents.consumers.index.join import PendingTable, Retention
from kvevents.consumers.index.marks import TierMarks, drop_dup, mark, unmark
from kvevents.consumers.index.records import (
    CK_MASK,
    F_GPU,
    FREE_LINK,
    GPU_ONE,
    GPU_SHIFT,
    HAS_CK,
    PARENT_MASK,
    PARENT_SHIFT,
    Hash,
    Record,
    add_gpu,
    content_key,
    counted_parent,
    gpu_refs,
)
from kvevents.consumers.index.stats import IndexStats
from kvevents.consumers.index.workers import (
    TIERS,
    GroupState,
    WorkerId,
    WorkerState,
    WorkerTable,
    bpc_lookup,
    per_worker,
)

__all__ = ["RefRules"]


class RefRules:
    """The index's feeding state and its refcount rules.

    Public state, shared with the other feeding rooms (:mod:`.stores`, :mod:`.apply`)
    and read by the :class:`~.block_index.BlockIndex` facade:

    * ``stats``: the :class:`~.stats.IndexStats` counters;
    * ``table``: the :class:`~.workers.WorkerTable` (property ``workers``: ``table.workers``);
    * ``marks``: the three tiers' :class:`~.marks.TierMarks`;
    * ``cap``: the :class:`~.eviction.Eviction` (resident count, memory cap);
    * ``pending``: the :class:`~.join.PendingTable`; ``retention``: the
      :class:`~.join.Retention` of records no tier holds;
    * ``canonical_block_size``, ``keep_token_ids`` and the per-worker settings
      (``bpc_config``, ``lookahead_config``, ``eagle_config``) as the index was built.
    """

    def __init__(
        self,
        *,
        canonical_block_size: int,
        max_blocks: int,
        gpu_metadata_retention: int,
        max_pending: int,
        keep_token_ids: bool,
        bpc_config: int | Mapping[Any, int] | None,
        lookahead_config: int | Mapping[Any, int] | None,
        eagle_config: bool | Mapping[Any, bool],
    ) -> None:
        self.canonical_block_size = canonical_block_size
        self.keep_token_ids = keep_token_ids
        self.bpc_config = bpc_config
        self.lookahead_config = lookahead_config
        self.eagle_config = eagle_config
        self.stats = IndexStats()
        self.table = WorkerTable()
        self.marks: tuple[TierMarks, TierMarks, TierMarks] = (
            TierMarks(),
            TierMarks(),
            TierMarks(),
        )
        self.cap = Eviction(max_blocks, self.table, self.marks, self.stats)
        self.pending = PendingTable(max_pending, self.stats)
        self.retention = Retention(gpu_metadata_retention, self.table, self.stats, self.cap)

    @property
    def workers(self) -> dict[WorkerId, WorkerState]:
        """Every worker by id (``table.workers``)."""
        return self.table.workers

    def worker(self, wid: WorkerId) -> WorkerState:
        """The state of worker ``wid``, created with its configured settings when new."""
        w = self.workers.get(wid)
        if w is None:
            w = self.workers[wid] = WorkerState(
                wid,
                bpc_lookup(self.bpc_config, wid),
                per_worker(self.lookahead_config, wid),
                bool(per_worker(self.eagle_config, wid)),
            )
        return w

    # ------------------------------------------------------------------ in

    def ref(self, w: WorkerState, gs: GroupState, tier: int, h: Hash, ck: int | None) -> None:
        """Count one more residency of ``h`` on ``tier``; ``ck`` is its content key.

        For the GPU tier the record of ``h`` holds the refcount; if the memory cap has
        just dropped that record, there is nothing to count.  ``tier < 0`` (metadata
        only) counts nothing.
        """
        if tier < 0:
            return
        r = gs.refs
        if tier == 0:
            meta = gs.meta
            m = meta.get(h)
            if m is None:
                # the memory cap dropped this entry whole while it was being applied
                # (e.g. while joining its pending CPU stores); nothing left to count
                return
            if isinstance(m, int):
                c = m >> GPU_SHIFT
                meta[h] = m + GPU_ONE
            else:
                c = m[F_GPU]
                meta[h] = add_gpu(m, 1)
            if c:
                return
            elsewhere = h in r[1] or h in r[2]
        else:
            refs = r[tier]
            c = refs.get(h, 0)
            refs[h] = c + 1
            if c:
                return
            om = gs.meta.get(h)
            elsewhere = (om is not None and gpu_refs(om) > 0) or h in r[3 - tier]
        if ck is not None:
            mark(self.marks[tier], ck, gs.bit)
        if elsewhere:
            return
        cap = self.cap
        cap.resident += 1
        if self.retention.records:
            self.retention.forget(w.wid, gs.group, h)
        if cap.tracking:
            m = gs.meta.get(h)
            if tier:
                cap.enter(gs, h, m)
            else:  # (a GPU store: the store queues the event's blocks)
                cap.add_child(gs, h, m)
        if cap.resident > cap.watch:
            cap.watch_hit()

    # ------------------------------------------------------------------ out

    def remove(self, w: WorkerState, group: int, hashes: Iterable[Hash], tier: int) -> None:
        """One residency of each of ``hashes`` on ``tier`` fewer (unknown ones counted)."""
        gs = w.groups.get(group)
        if gs is None:
            for h in hashes:
                self.remove_unknown(w, None, group, h, tier)
            return
        r = gs.refs
        refs = r[tier]
        marks = self.marks[tier]
        meta = gs.meta
        bit = gs.bit
        cap = self.cap
        retention = self.retention
        retired = retention.records
        wid = w.wid
        removed = 0
        unknown = 0
        for h in hashes:
            if tier == 0:
                m = meta.get(h)
                c = 0 if m is None else gpu_refs(m)
                if not c or m is None:
                    self.remove_unknown(w, gs, group, h, tier)
                    continue
                removed += 1
                meta[h] = add_gpu(m, -1)
                if c > 1:
                    continue
                elsewhere = h in r[1] or h in r[2]
            else:
                cc = refs.get(h)
                if cc is None:
                    if h in meta or wid in self.pending.per_worker:
                        self.remove_unknown(w, gs, group, h, tier)
                    else:  # (remove_unknown's last case, inline: evicted or unknown)
                        unknown += 1
                    continue
                removed += 1
                if cc > 1:
                    refs[h] = cc - 1
                    continue
                del refs[h]
                m = meta.get(h)
                if type(m) is int:  # the packed record, inline
                    elsewhere = m >= GPU_ONE or h in r[3 - tier]
                    if m & HAS_CK:
                        ck = m & CK_MASK
                        if marks.dups and drop_dup(marks, ck, bit):
                            pass  # another engine block of this slot has it
                        else:  # (marks.unmark, inline)
                            v = marks.get(ck)
                            if v is not None:
                                if v == bit:  # the only holder
                                    del marks[ck]
                                else:
                                    v &= ~bit
                                    if v:
                                        marks[ck] = v
                                    else:
                                        del marks[ck]
                    if not elsewhere:
                        cap.resident -= 1
                        if gs.deferred:
                            gs.deferred.pop(h, None)
                        p = (m >> PARENT_SHIFT) & PARENT_MASK
                        if p and gs.kids and not m & FREE_LINK:
                            cap.unkid(gs, p - 1)
                        retired[(wid, group, h)] = None
                        if len(retired) > retention.limit:
                            retention.trim()
                    continue
                elsewhere = (m is not None and gpu_refs(m) > 0) or h in r[3 - tier]
            if m is not None:
                mck = content_key(m)
                if mck is not None:
                    unmark(marks, mck, bit)
            if not elsewhere:
                cap.resident -= 1
                if gs.deferred:
                    gs.deferred.pop(h, None)
                if m is not None:
                    mp = counted_parent(m)
                    if mp is not None and gs.kids:
                        cap.unkid(gs, mp)
                    retired[(wid, group, h)] = None
                    if len(retired) > retention.limit:
                        retention.trim()
                else:  # held without a record: its places stay queued
                    cap.forget((h,))
        if removed:
            self.stats.removed[TIERS[tier]] += removed
        if unknown:
            self.stats.unknown_removals[TIERS[tier]] += unknown

    def remove_unknown(
        self, w: WorkerState, gs: GroupState | None, group: int, h: Hash, tier: int
    ) -> None:
        """A removal of ``h`` the tier does not hold: it cancels a waiting placeholder, is
        a chunk's non-tail constituent (harmless), or is counted as unknown."""
        if (
            tier
            and w.wid in self.pending.per_worker
            and self.pending.remove_one(w.wid, group, h, tier)
        ):
            return
        if tier and gs is not None and h in gs.meta:
            # fan-out of a chunk's non-tail constituents (C§5.8): harmless
            self.stats.skipped["removed_non_tail"] += 1
            return
        self.stats.unknown_removals[TIERS[tier]] += 1

    def clear_tiers(self, w: WorkerState, *, keep_metadata: bool) -> None:
        """Drop every residency of ``w`` on every tier (``AllBlocksCleared`` keeps the
        metadata as retained records; a reset drops it too) and its waiting placeholders."""
        wid = w.wid
        gpu_marks = self.marks[0]
        for gs in w.groups.values():
            bit = gs.bit
            meta = gs.meta
            held: set[Hash] = set()
            for h, m in meta.items():
                if gpu_refs(m):
                    held.add(h)
                    ck = content_key(m)
                    if ck is not None:
                        unmark(gpu_marks, ck, bit)
            for h in held:
                meta[h] = add_gpu(meta[h], -gpu_refs(meta[h]))
            for tier in (1, 2):
                refs = gs.refs[tier]
                marks = self.marks[tier]
                for h in refs:
                    tm = gs.meta.get(h)
                    ck = content_key(tm) if tm is not None else None
                    if ck is not None:
                        unmark(marks, ck, bit)
                held.update(refs)
                refs.clear()
            self.cap.clear_group(gs, held)
            if keep_metadata:
                for h in held:
                    if h in gs.meta:
                        self.retention.retire(wid, gs, h)
            else:
                for h in gs.meta:
                    self.retention.forget(wid, gs.group, h)
                self.cap.forget(gs.meta)
                gs.meta.clear()
        self.pending.drop_worker(wid)

    def rekey(self, gs: GroupState, h: Hash, old: Record, new: Record) -> None:
        """``h``'s record changes from ``old`` to ``new`` (an orphan healed, a partial
        tail unkeyed): move its marks on every tier holding it, and its parent link."""
        self.cap.reparent(gs, h, old, new)
        old_ck, new_ck = content_key(old), content_key(new)
        for tier in range(3):
            if (gpu_refs(old) > 0) if tier == 0 else (h in gs.refs[tier]):
                marks = self.marks[tier]
                if old_ck is not None:
                    unmark(marks, old_ck, gs.bit)
                if new_ck is not None:
                    mark(marks, new_ck, gs.bit)
