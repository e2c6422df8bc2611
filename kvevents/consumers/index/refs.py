"""Tier refcounts: every residency counted in and out, by one set of rules.

One job: the refcount rules every store, removal and clear goes through.  A (worker,
group, hash) entry is *resident* while any tier holds it (GPU: the refcount in its
record, :func:`.records.gpu_refs`; CPU/STORAGE: ``GroupState.refs``).  References are
counted, not flags: vLLM's ``BlockPool.cache_full_blocks`` publishes a ``BlockStored``
for every block it caches and ``BlockPool._maybe_evict_cached_block`` a
``BlockRemoved`` for every block it evicts, and two engine blocks may carry one hash
(and one content key), so a store seen twice needs two removals.

* :meth:`RefRules.ref`: the first reference on a tier marks the content key in that
  tier's marks (:mod:`.marks`); the first on any tier makes the entry resident
  (counted, no longer retained metadata, told to the memory cap).
* :meth:`RefRules.remove`: the last reference on a tier unmarks the key; the last on any
  tier ends the residency (the record is kept as retained metadata, :mod:`.join`, for
  a late CPU store or later children); a
  removal of a hash the tier does not hold is :meth:`RefRules.remove_unknown`'s.
* :meth:`RefRules.clear_tiers`: ``AllBlocksCleared`` and resets, every tier at once.

:class:`RefRules` also holds the state the feeding rooms share, as documented public
attributes.  Imports :mod:`.eviction`, :mod:`.join`, :mod:`.marks`, :mod:`.records`,
:mod:`.stats` and :mod:`.workers`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvevents.consumers.index.eviction import Eviction
from kvevents.consumers.index.join import PendingTable, Retention
from kvevents.consumers.index.marks import Marks, new_marks
from kvevents.consumers.index.records import (
    Hash,
    Record,
    add_gpu,
    content_key,
    counted_parent,
    drop_gpu,
    gpu_refs,
)
from kvevents.consumers.index.stats import IndexStats
from kvevents.consumers.index.workers import (
    CPU,
    GPU,
    STORAGE,
    TIERS,
    GroupState,
    WorkerId,
    WorkerState,
    WorkerTable,
    bpc_lookup,
    per_worker,
)
from kvevents.native import NATIVE

__all__ = ["RefRules"]


class RefRules:
    """The index's feeding state and its refcount rules.

    Public state, shared with the other feeding rooms (:mod:`.stores`, :mod:`.apply`)
    and read by the :class:`~.block_index.BlockIndex` facade:

    * ``stats``: the :class:`~.stats.IndexStats` counters;
    * ``table``: the :class:`~.workers.WorkerTable` (property ``workers``: ``table.workers``);
    * ``marks``: the three tiers' marks (:mod:`.marks`);
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
        self.marks: tuple[Marks, Marks, Marks] = (new_marks(), new_marks(), new_marks())
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

    def ref(
        self,
        w: WorkerState,
        gs: GroupState,
        tier: int,
        h: Hash,
        ck: int | None,
        free_link: bool = False,
        held: bool = False,
    ) -> bool:
        """Count one more residency of ``h`` on ``tier``; ``ck`` is its content key.

        The first reference on a tier marks ``ck`` in that tier's marks.  For the GPU tier
        the record of ``h`` holds the refcount; if the memory cap has just dropped that
        record, there is nothing to count.  ``tier < 0`` (metadata only) counts nothing.

        The first reference on any tier (no other tier holds ``h``) makes the entry
        resident: one more resident entry, no longer a retained record, and (while the
        memory cap keeps its bookkeeping) a child of its parent with a place in the
        eviction queue (a GPU store queues its blocks itself, at its end).
        ``free_link``: a GPU store's new block whose link to its parent is free (its
        record carries the flag, see :mod:`.eviction`): not counted as a child.
        ``held``: a GPU store's new block whose record was made holding this, its first,
        GPU reference (``pack(..., gpu=1)``): nothing left to count in the record, and
        no retained place to forget (:class:`~.join.Retention` holds records it has).

        Returns whether ``h`` became resident and, while the bookkeeping runs, has no
        earlier place in the eviction queue (not :attr:`Eviction.forgotten`): the next
        block of its GPU store may then link to it freely.
        """
        if tier < 0:
            return False
        refs = gs.refs
        if tier == GPU:
            if not held:
                m = gs.meta.get(h)
                if m is None:
                    # the memory cap dropped this entry whole while it was being applied
                    # (e.g. while joining its pending CPU stores); nothing left to count
                    return False
                gs.meta[h] = add_gpu(m, 1)
                if gpu_refs(m):
                    return False  # not the first GPU reference
            if ck is not None:
                self.marks[GPU].mark(ck, gs.slot)
            if h in refs[CPU] or h in refs[STORAGE]:
                return False  # resident already
        else:
            counts = refs[tier]
            count = counts.get(h, 0)
            counts[h] = count + 1
            if count:
                return False  # not the first reference on this tier
            if ck is not None:
                self.marks[tier].mark(ck, gs.slot)
            m = gs.meta.get(h)
            if (m is not None and gpu_refs(m)) or h in refs[3 - tier]:
                return False  # resident already
        cap = self.cap
        cap.resident += 1
        # (a record just made has no retained place: retention keeps records it has)
        if not held and self.retention.records:
            self.retention.forget(w.wid, gs.group, h)
        fresh = False
        if cap.tracking:
            m = gs.meta.get(h)
            if tier != GPU:
                cap.enter(gs, h, m)
            elif not free_link:
                cap.add_child(gs, h, m)
            fresh = h not in cap.forgotten
        if cap.resident > cap.watch:
            cap.watch_hit()
        return fresh

    # ------------------------------------------------------------------ out

    def remove(self, w: WorkerState, group: int, hashes: Iterable[Hash], tier: int) -> None:
        """One residency of each of ``hashes`` on ``tier`` fewer.

        A hash the tier does not hold goes to :meth:`remove_unknown`.  The last reference
        on a tier unmarks the content key in that tier's marks.  The last on any tier (no
        other tier holds the hash) ends the entry's residency: one resident entry fewer,
        one resident child fewer for its parent, and its record retained (bounded, see
        :class:`~.join.Retention`) for a late CPU store or later children.  Held without
        a record, it may keep places in the eviction queue (:meth:`Eviction.forget`).
        """
        gs = w.groups.get(group)
        if gs is None:
            for h in hashes:
                self.remove_unknown(w, None, group, h, tier)
            return
        meta, refs, marks, slot = gs.meta, gs.refs, self.marks[tier], gs.slot
        if tier == GPU and not gs.kids and not gs.deferred and self.compiled_tables(gs):
            self.remove_gpu_compiled(w, gs, hashes)
            return
        counts, on_gpu = refs[tier], tier == GPU  # (CPU/STORAGE: the refcounts)
        # the other tiers' refcounts (CPU/STORAGE: the other one, twice)
        o1, o2 = (refs[CPU], refs[STORAGE]) if on_gpu else (refs[3 - tier], refs[3 - tier])
        cap, retire, wid = self.cap, self.retention.retire, w.wid
        removed = 0
        for h in hashes:
            m = meta.get(h)
            if not on_gpu:
                count = counts.get(h, 0)
            elif m is not None:
                count, dropped = drop_gpu(m)
            else:
                count = 0
            if not count:
                self.remove_unknown(w, gs, group, h, tier)
                continue
            removed += 1
            if on_gpu:
                meta[h] = dropped
            elif count > 1:
                counts[h] = count - 1
            else:
                del counts[h]
            if count > 1:
                continue  # not the last reference on this tier
            ck = content_key(m) if m is not None else None
            if ck is not None:
                marks.unmark(ck, slot)
            if h in o1 or h in o2 or (not on_gpu and m is not None and gpu_refs(m)):
                continue  # still resident (held by another tier)
            cap.resident -= 1
            if gs.deferred:
                gs.deferred.pop(h, None)
            if m is None:
                cap.forget((h,))
            else:
                parent = counted_parent(m) if gs.kids else None  # (kids: the cap's bookkeeping)
                if parent is not None:
                    cap.unkid(gs, parent)
                retire(wid, gs, h)
        if removed:
            self.stats.removed[TIERS[tier]] += removed

    def compiled_tables(self, gs: GroupState) -> bool:
        """Whether ``gs``'s records and refcounts and the GPU marks are the compiled
        core's tables (which its rules read and write directly)."""
        native = NATIVE
        if native is None or type(self.marks[GPU]) is not native.SlotMarks:
            return False
        tables: tuple[Any, ...] = (gs.meta, gs.refs[CPU], gs.refs[STORAGE])
        return all(type(t) is native.RecordTable and not t.spilled for t in tables)

    def remove_gpu_compiled(self, w: WorkerState, gs: GroupState, hashes: Iterable[Hash]) -> None:
        """:meth:`remove` of GPU removals of a group without eviction bookkeeping (no
        children counts, nothing deferred) by the compiled core's rule: the same
        references, marks, residencies and counters; the records whose residency ended
        are retained in order, trimmed once after them (:meth:`.join.Retention.retire_all`)."""
        assert NATIVE is not None
        removed, unknown, ended, retire = NATIVE.gpu_remove_run(
            gs.meta, gs.refs[CPU], gs.refs[STORAGE], self.marks[GPU], gs.slot,
            hashes if isinstance(hashes, (list, tuple)) else list(hashes),
        )  # fmt: skip
        stats = self.stats
        if unknown:
            stats.unknown_removals[TIERS[GPU]] += unknown
        if removed:
            stats.removed[TIERS[GPU]] += removed
        self.cap.resident -= ended
        if retire:
            self.retention.retire_all(w.wid, gs, retire)

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
            # fan-out of a chunk's non-tail constituents (vLLM's healed removals): harmless
            self.stats.skipped["removed_non_tail"] += 1
            return
        self.stats.unknown_removals[TIERS[tier]] += 1

    def clear_tiers(self, w: WorkerState, *, keep_metadata: bool) -> None:
        """Drop every residency of ``w`` on every tier (``AllBlocksCleared`` keeps the
        metadata as retained records; a reset drops it too) and its waiting placeholders."""
        wid = w.wid
        gpu_marks = self.marks[0]
        for gs in w.groups.values():
            slot = gs.slot
            meta = gs.meta
            # what was held, in a defined order (GPU in record order, then CPU and
            # STORAGE in refcount order): the order its records are retired in
            held: dict[Hash, None] = {}
            for h, m in meta.items():
                if gpu_refs(m):
                    held[h] = None
                    ck = content_key(m)
                    if ck is not None:
                        gpu_marks.unmark(ck, slot)
            for h in held:
                meta[h] = add_gpu(meta[h], -gpu_refs(meta[h]))
            for tier in (1, 2):
                refs = gs.refs[tier]
                marks = self.marks[tier]
                for h in refs:
                    tm = gs.meta.get(h)
                    ck = content_key(tm) if tm is not None else None
                    if ck is not None:
                        marks.unmark(ck, slot)
                held.update(dict.fromkeys(refs))
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
                    marks.unmark(old_ck, gs.slot)
                if new_ck is not None:
                    marks.mark(new_ck, gs.slot)
