"""The GPU/CPU join's memory: the pending table and the retention of GPU-removed metadata.

One job: keep, bounded, what a late join needs.  A CPU/STORAGE placeholder whose GPU
store has not arrived waits in the :class:`PendingTable` (at most ``max_pending``
entries; one pushed out, cleared or removed before it joins is counted as unjoined); a
metadata record no tier holds any more is kept by :class:`Retention` (at most
``limit``; the oldest go first) for a CPU store arriving after the GPU removal and as the
parent of later stores.  Imports :mod:`.eviction` (to tell it which hashes lost their
records), :mod:`.records`, :mod:`.stats` and :mod:`.workers`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Protocol

from kvevents.consumers.index.eviction import Eviction
from kvevents.consumers.index.records import Hash
from kvevents.consumers.index.stats import IndexStats
from kvevents.consumers.index.workers import GroupState, WorkerId, WorkerTable
from kvevents.native import NATIVE

__all__ = ["EntryKey", "PendingTable", "RetainedOrder", "Retention", "adopt_retained"]

logger = logging.getLogger("kvevents.consumers.index")

EntryKey = tuple[WorkerId, int, Hash]
"""One (worker, group, hash) entry."""


class RetainedOrder(Protocol):
    """The retained entries, oldest first: an ``OrderedDict`` of entry -> None, or with
    the compiled core its ``kvevents_native.RetainedQueue`` (the same entries in a flat
    table of 16-byte entries; keys() and items() are lists there)."""

    def __setitem__(self, key: EntryKey, value: None, /) -> None: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __len__(self) -> int: ...
    def pop(self, key: EntryKey, default: None, /) -> None: ...
    def popitem(self, last: bool = ...) -> tuple[EntryKey, None]: ...
    def keys(self) -> Any: ...
    def items(self) -> Any: ...


def new_retained() -> RetainedOrder:
    """An empty retained order: the compiled core's when it runs, else an OrderedDict."""
    if NATIVE is not None:
        return NATIVE.RetainedQueue()  # type: ignore[no-any-return]
    return OrderedDict()


def adopt_retained(order: RetainedOrder) -> RetainedOrder:
    """``order`` (a restored snapshot's OrderedDict) in the kind :func:`new_retained`
    makes, in the same order."""
    if NATIVE is None or not isinstance(order, OrderedDict):
        return order
    out = new_retained()
    for key in order:
        out[key] = None
    return out


class PendingTable:
    """Placeholder chunks waiting for their GPU store, oldest first.

    ``entries`` maps (worker, group, hash) to ``[0, CPU count, STORAGE count]``;
    ``per_worker`` counts each worker's entries (a worker without any is absent, so the
    feeding code skips the table for it at the cost of one dict lookup).
    """

    __slots__ = ("entries", "max_pending", "per_worker", "stats")

    def __init__(self, max_pending: int, stats: IndexStats) -> None:
        self.max_pending = max_pending
        self.stats = stats
        self.entries: OrderedDict[EntryKey, list[int]] = OrderedDict()
        self.per_worker: dict[WorkerId, int] = {}

    def add(self, wid: WorkerId, group: int, h: Hash, tier: int) -> None:
        """One more placeholder of ``h`` on ``tier`` waits (the oldest beyond
        ``max_pending`` are dropped, counted as ``unjoined["pending_overflow"]``)."""
        self.stats.pending += 1
        key = (wid, group, h)
        entries = self.entries
        p = entries.get(key)
        if p is None:
            p = entries[key] = [0, 0, 0]
            self.per_worker[wid] = self.per_worker.get(wid, 0) + 1
        p[tier] += 1
        while len(entries) > self.max_pending:
            (owid, _, _), old = entries.popitem(last=False)
            self._left(owid)
            if not self.stats.unjoined["pending_overflow"]:
                logger.warning(
                    "block index: more than %d CPU/STORAGE stores wait for their GPU store; "
                    "dropping the oldest (counted as unjoined[pending_overflow])",
                    self.max_pending,
                )
            self.stats.unjoined["pending_overflow"] += old[1] + old[2]

    def take(self, wid: WorkerId, group: int, h: Hash) -> list[int] | None:
        """The waiting counts of ``h`` (``[0, CPU, STORAGE]``), taken out of the table;
        None if nothing waits for it."""
        p = self.entries.pop((wid, group, h), None)
        if p is not None:
            self._left(wid)
        return p

    def remove_one(self, wid: WorkerId, group: int, h: Hash, tier: int) -> bool:
        """A removal of ``h`` on ``tier`` cancels one waiting placeholder (counted as
        ``unjoined["removed_while_pending"]``); False if none waited."""
        key = (wid, group, h)
        p = self.entries.get(key)
        if p is None or p[tier] <= 0:
            return False
        p[tier] -= 1
        self.stats.unjoined["removed_while_pending"] += 1
        if not (p[1] or p[2]):
            del self.entries[key]
            self._left(wid)
        return True

    def drop_worker(self, wid: WorkerId) -> None:
        """Forget every placeholder of ``wid`` (``unjoined["cleared_while_pending"]``)."""
        if self.per_worker.pop(wid, 0):
            dropped = [k for k in self.entries if k[0] == wid]
            for k in dropped:
                counts = self.entries.pop(k)
                self.stats.unjoined["cleared_while_pending"] += counts[1] + counts[2]

    def _left(self, wid: WorkerId) -> None:
        """One entry of ``wid`` left the table."""
        n = self.per_worker.get(wid, 0) - 1
        if n > 0:
            self.per_worker[wid] = n
        else:
            self.per_worker.pop(wid, None)


class Retention:
    """Metadata records no tier holds, oldest first, at most ``limit`` of them.

    ``records`` is keyed by (worker, group, hash); an entry that becomes resident again
    leaves it (:meth:`forget`), one dropped beyond ``limit`` loses its record (counted in
    ``stats.metadata_evicted``, and added to ``cap.forgotten`` while the memory cap's
    bookkeeping runs).  ``table`` is the index's worker table, to find the records.
    """

    __slots__ = ("cap", "limit", "records", "stats", "table")

    def __init__(self, limit: int, table: WorkerTable, stats: IndexStats, cap: Eviction) -> None:
        self.limit = limit
        self.table = table
        self.stats = stats
        self.cap = cap
        self.records: RetainedOrder = new_retained()

    def retire(self, wid: WorkerId, gs: GroupState, h: Hash) -> None:
        """``h`` of ``gs`` is no longer held by any tier: keep its record, bounded."""
        self.records[(wid, gs.group, h)] = None
        if len(self.records) > self.limit:
            self.trim()

    def retire_all(self, wid: WorkerId, gs: GroupState, hashes: Iterable[Hash]) -> None:
        """:meth:`retire` of each of ``hashes`` (none held by any tier), in order, the
        trim done once after them: the same records go (a trim takes the oldest first,
        and it keeps what is held, which none of these is)."""
        records, group = self.records, gs.group
        for h in hashes:
            records[(wid, group, h)] = None
        if len(records) > self.limit:
            self.trim()

    def forget(self, wid: WorkerId, group: int, h: Hash) -> None:
        """``h`` is held again (or gone): it is no longer a retained record."""
        self.records.pop((wid, group, h), None)

    def trim(self) -> None:
        """Drop the oldest retained records until at most ``limit`` remain (a record some
        tier holds again is left alone: it only loses its retained place)."""
        retired = self.records
        while len(retired) > self.limit:
            (owid, ogroup, oh), _ = retired.popitem(last=False)
            ow = self.table.workers.get(owid)
            ogs = ow.groups.get(ogroup) if ow is not None else None
            if ogs is None:
                continue
            if oh not in ogs.meta or ogs.held(oh):
                continue  # gone, or held again: only its retained place goes
            del ogs.meta[oh]
            self.stats.metadata_evicted += 1
            self.cap.forget((oh,))  # (its places in the eviction queue may remain)
