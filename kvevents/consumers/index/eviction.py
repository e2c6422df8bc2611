"""The memory cap: which resident entry goes when more than ``max_blocks`` are resident.

One job: count resident (worker, group, hash) entries and evict beyond the cap, oldest
first, leaves before their parents, in an order decided by the event stream alone (see
:meth:`Eviction.evict`).  Its bookkeeping (resident children per parent in
``GroupState.kids``, the eviction queue) starts once more than half the cap is first
resident (:attr:`Eviction.tracking`), so an index far from its cap pays nothing for it.
The feeding code reports every entry that becomes or stops being resident here
(:meth:`Eviction.enter`, :meth:`Eviction.add_child`, :meth:`Eviction.unkid`,
:meth:`Eviction.queue_store`).

Free links: a block whose parent became resident in the same GPU store, just before
it, with no earlier place in the queue (not in :attr:`Eviction.forgotten`), is not
counted among its parent's children; its packed record carries
:data:`~.records.FREE_LINK` instead.  Leaves still go before their parents: the queue
takes a store's blocks leaf first, so such a block's first place comes before every
place of its parent, and when the queue reaches it the block is evicted, or deferred
and then counted (the flag cleared).  The eviction order is the one full counts give;
the usual GPU store of many blocks costs one count instead of one per block, and
their one-hash removals none.  Which stores link freely is decided block by block in
:mod:`.stores` (plain GPU stores of new blocks, while the bookkeeping runs or may start
during the store: :meth:`Eviction.may_track`).

Changing a rule here: the order is :meth:`Eviction.evict`'s three steps;
``tests/consumers/test_index_cap.py`` checks the bound, the children counts and the
free links against a recount after random streams, and that two indexes fed one stream
evict the same entries; ``tests/consumers/test_index_snapshot_bytes.py`` pins the
index's whole state for fixed streams, so a change of order shows there as new digests
(record them, and bump :data:`~.snapshot.SNAPSHOT_FORMAT` if the state's layout
changes).  Imports :mod:`.marks`, :mod:`.records`, :mod:`.stats` and :mod:`.workers`.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Collection, Iterable, Iterator
from itertools import islice
from typing import Any, Union

from kvevents.consumers.index.marks import Marks
from kvevents.consumers.index.records import (
    Hash,
    Record,
    content_key,
    counted_parent,
    gpu_refs,
    has_free_link,
    holds_none,
    parent_of,
    without_free_link,
)
from kvevents.consumers.index.stats import IndexStats
from kvevents.consumers.index.workers import GroupState, WorkerTable

__all__ = ["Eviction", "QueueItem"]

QueueItem = Union[Hash, "array[int]", tuple[Hash, ...]]
"""One item of the eviction queue: an entry's hash, or a GPU store's hashes in store
order (root first), taken from the end (leaf first): a tuple of the event's hashes when
queued (cheap to make), rewritten by compaction as an ``array("Q")`` when they are all
unsigned 64-bit ints (as vLLM's are)."""


class Eviction:
    """Resident entry count, eviction order and eviction under ``max_blocks``.

    Public state (read and updated by the feeding rooms, :mod:`.refs` and :mod:`.stores`):

    * ``resident``: resident entries (``len(index)``);
    * ``watch``: when ``resident`` exceeds it, call :meth:`watch_hit` (half the cap until
      tracking starts, then the cap);
    * ``tracking``: the eviction bookkeeping is on;
    * ``storing``: a GPU store is being applied (its blocks are queued at its end).

    The eviction queue is two parallel lists, ``qgroups`` (the group) and ``qhashes``
    (a :data:`QueueItem`: one hash, or one GPU store's hashes), read from item
    ``qhead``, of whose hashes (a store's, from its end) ``qcut`` are already taken.
    Its length in hashes, ``qlen``, counts the ``qtaken`` hashes already taken from its
    front too: the queue is the same sequence of hashes as one item per block would
    be, in fewer items.  A store that compaction keeps becomes an array of plain
    numbers, not objects: the queue keeps no hash object alive beyond one compaction
    period, and looking its hashes up touches no old object.
    """

    __slots__ = (
        "forgotten",
        "marks",
        "max_blocks",
        "qcut",
        "qgroups",
        "qhashes",
        "qhead",
        "qlen",
        "qlimit",
        "qtaken",
        "ready",
        "resident",
        "stats",
        "storing",
        "table",
        "tracking",
        "watch",
    )

    def __init__(
        self,
        max_blocks: int,
        table: WorkerTable,
        marks: tuple[Marks, Marks, Marks],
        stats: IndexStats,
    ) -> None:
        self.max_blocks = max_blocks
        self.table = table
        self.marks = marks
        self.stats = stats
        self.resident = 0
        # The eviction queue: (group, hash) of each entry in the order it became resident
        # (a GPU store's blocks leaf first: one item per store, its hashes taken from the
        # end), as two parallel lists read from qhead; stale hashes are skipped when
        # reached.  ready: deferred entries whose last resident child went away (evicted
        # before the queue).
        self.qgroups: list[GroupState] = []
        self.qhashes: list[QueueItem] = []
        self.qhead = 0
        self.qcut = 0
        self.qtaken = 0
        self.qlen = 0
        self.qlimit = 1 << 16
        self.ready: deque[tuple[GroupState, Hash]] = deque()
        self.storing = False
        self.tracking = False
        self.watch = max_blocks // 2
        # (tracking only) hashes that lost their record, or stopped being resident
        # without one, since the last compaction: they may still have places in the
        # queue, so a link to one of them is never free.  Emptied by compact(), which
        # also runs when this set outgrows qlimit (where eviction takes the queue
        # faster than it grows, so the queue alone would never ask for one).
        self.forgotten: set[Hash] = set()

    # ------------------------------------------------------------------ bookkeeping

    def enter(self, gs: GroupState, h: Hash, m: Record | None) -> None:
        """(Tracking only.)  ``h`` (record ``m``) became resident through a CPU/STORAGE
        store: one more resident child for its parent, and its place in the eviction
        queue."""
        if m is not None:
            self.add_child(gs, h, m)
        self.qgroups.append(gs)
        self.qhashes.append(h)
        self.qlen += 1
        if self.qlen > self.qlimit or len(self.forgotten) > self.qlimit:
            self.compact()

    def add_child(self, gs: GroupState, h: Hash, m: Record | None) -> None:
        """(Tracking only.)  ``h`` (record ``m``) became resident: one more resident child
        for its parent (the GPU store, or :meth:`enter`, queues it).  A
        :data:`~.records.FREE_LINK` left from an earlier residency is cleared: this
        link is counted."""
        if m is not None:
            p = parent_of(m)
            if p is not None:
                gs.kids[p] = gs.kids.get(p, 0) + 1
            if has_free_link(m):
                gs.meta[h] = without_free_link(m)

    def queue_store(self, gs: GroupState, hashes: Any) -> None:
        """Queue a GPU store's blocks for eviction as one item, taken leaf first (they
        became resident together, so each block goes before its parent), then enforce
        the cap (blocks of an event being applied are not queued yet, so the cap is
        checked again)."""
        self.storing = False
        if self.tracking:
            n = len(hashes)
            if n:
                item: QueueItem
                item = hashes[0] if n == 1 else tuple(hashes)
                self.qgroups.append(gs)
                self.qhashes.append(item)
                self.qlen += n
                if self.qlen > self.qlimit or len(self.forgotten) > self.qlimit:
                    self.compact()
        if self.resident > self.watch:
            self.watch_hit()

    def may_track(self, n: int) -> bool:
        """Whether the bookkeeping runs, or may start before ``n`` more entries are
        resident (:meth:`watch_hit` starts it once more than ``watch`` are)."""
        return self.tracking or self.resident + n > self.watch

    def watch_hit(self) -> None:
        """More entries are resident than ``watch``: start the eviction bookkeeping
        (first time: more than half the cap) and evict if over the cap."""
        if not self.tracking:
            self.start_tracking()
        if self.resident > self.max_blocks:
            self.evict()

    def start_tracking(self) -> None:
        """Build the children counts and the eviction queue from the index as it is (each
        group's resident entries in record order, groups in slot order); from then on the
        feeding code keeps them up to date."""
        self.tracking = True
        self.watch = self.max_blocks
        slots = self.table.slots
        for slot in sorted(slots):
            gs = slots[slot][1]
            kids = gs.kids
            r1, r2 = gs.refs[1], gs.refs[2]
            run: list[Hash] = []
            for h, m in gs.meta.items():
                if gpu_refs(m) > 0 or h in r1 or h in r2:
                    p = parent_of(m)
                    if p is not None:
                        kids[p] = kids.get(p, 0) + 1
                    run.append(h)
            self.queue_run(gs, run)
            meta = gs.meta  # (held on CPU/STORAGE without a record:)
            self.queue_run(gs, [h for h in [*r1, *(h for h in r2 if h not in r1)] if h not in meta])
        self.qlimit = max(1 << 16, 4 * self.qlen)

    def queue_run(self, gs: GroupState, run: list[Hash]) -> None:
        """Queue the entries ``run`` of ``gs`` (first to be taken first) as one item."""
        if not run:
            return
        item: QueueItem
        if len(run) == 1:
            item = run[0]
        else:
            run.reverse()  # (an item's hashes are taken from its end)
            item = _packed(run)
        self.qgroups.append(gs)
        self.qhashes.append(item)
        self.qlen += len(run)

    def unkid(self, gs: GroupState, p: Hash) -> None:
        """A resident entry whose parent is ``p`` stopped being resident."""
        kids = gs.kids
        c = kids.pop(p, None)  # (one lookup for the usual count of 1)
        if c is None:
            return
        if c > 1:
            kids[p] = c - 1
        elif p in gs.deferred:
            self.ready.append((gs, p))

    def reparent(self, gs: GroupState, h: Hash, old: Record, new: Record) -> None:
        """``h``'s record is replaced (an orphan healed): if it is resident, it is now a
        child of the new record's parent."""
        if not self.tracking:
            return
        po, pn = counted_parent(old), counted_parent(new)
        if po != pn and gs.held(h):
            if po is not None:
                self.unkid(gs, po)
            if pn is not None:
                gs.kids[pn] = gs.kids.get(pn, 0) + 1

    def clear_group(self, gs: GroupState, held: Collection[Hash]) -> None:
        """The entries ``held`` of ``gs`` stopped being resident at once (a clear or a
        reset): nothing of the group is resident any more."""
        self.resident -= len(held)
        gs.kids.clear()
        gs.deferred.clear()
        self.forget(held)

    def forget(self, hashes: Iterable[Hash]) -> None:
        """``hashes`` lost their records, or their residency without a record: they may
        still have places in the queue (see :attr:`forgotten`)."""
        if self.tracking:
            self.forgotten.update(hashes)

    # ------------------------------------------------------------------ eviction

    def evict(self) -> None:
        """Evict resident entries until at most ``max_blocks - max_blocks // 100`` remain
        (at least one below the cap, so that eviction runs in batches).

        Only resident entries are evicted (the entry, its metadata record and its tier
        refcounts go; counted in ``stats.evicted_by_cap``), and the order is a function of
        the event stream alone (never of queries, wall time or dict order of queries), so
        two indexes fed the same events evict the same entries:

        1. entries passed over earlier because they had resident children (see 2), as
           soon as their last resident child is gone: they are the oldest;
        2. the eviction queue: entries in the order they became resident (the blocks of
           one GPU store leaf first); an entry that still has resident children in its
           group (entries naming it as parent) is passed over (deferred) instead, so
           leaves go before their parents and a shared prefix outlives every chat built
           on it;
        3. if 1 and 2 have nothing left (a parent cycle, say), deferred entries in the
           order they were deferred, children or not: the cap always holds.  While a GPU
           store is being applied its blocks are not queued yet, so this step waits for
           the end of the event (the cap holds again once the event is applied).
        """
        goal = self.max_blocks - max(1, self.max_blocks // 100) + 1
        while self.resident > goal:
            if self.ready:
                self._evict_ready()
                continue
            entry = self._pop_queue()
            if entry is not None:
                self._evict_queued(*entry)
                continue
            if self.storing or not self._evict_deferred(goal):
                break
        self._drop_taken()

    def _evict_ready(self) -> None:
        """Step 1 of :meth:`evict`: the oldest deferred entry whose last resident child
        went away, if it is still deferred, childless, resident and a live worker's."""
        gs, h = self.ready.popleft()
        if h not in gs.deferred or gs.kids.get(h) or not self.table.live(gs):
            return
        if not gs.held(h):
            del gs.deferred[h]
            return
        self.drop(gs, h, gs.meta.get(h))

    def _pop_queue(self) -> tuple[GroupState, Hash] | None:
        """The eviction queue's next (group, hash), taken; None when it is empty."""
        if self.qhead >= len(self.qhashes):
            return None
        gs, x = self.qgroups[self.qhead], self.qhashes[self.qhead]
        if isinstance(x, (int, bytes)):
            h: Hash = x
            self.qhead += 1
        else:  # a GPU store: its hashes from the end
            self.qcut += 1
            h = x[-self.qcut]
            if self.qcut == len(x):
                self.qhead += 1
                self.qcut = 0
        self.qtaken += 1
        return gs, h

    def _evict_queued(self, gs: GroupState, h: Hash) -> None:
        """Step 2 of :meth:`evict` for the queue's next entry: skipped if it is a removed
        worker's, not resident any more or deferred already; deferred if it has resident
        children (its free link, if any, now counted); else evicted."""
        if not self.table.live(gs) or not gs.held(h):
            return
        m = gs.meta.get(h)
        if gs.kids and h in gs.kids:
            gs.deferred[h] = None
            if m is not None and has_free_link(m):  # now counted
                self.add_child(gs, h, m)
            return
        if gs.deferred and h in gs.deferred:
            return
        self.drop(gs, h, m)

    def _drop_taken(self) -> None:
        """Forget the items the queue has taken, once they are most of it."""
        if self.qtaken > 4096 and 2 * self.qtaken > self.qlen:
            head, cut = self.qhead, self.qcut
            if cut:
                rest = self.qhashes[head][:-cut]  # type: ignore[index]
                self.qhashes[head] = rest[0] if len(rest) == 1 else rest
                self.qcut = 0
            del self.qgroups[:head]
            del self.qhashes[:head]
            self.qhead = 0
            self.qlen -= self.qtaken
            self.qtaken = 0

    def _evict_deferred(self, goal: int) -> bool:
        """Step 3 of :meth:`evict`; False if there was nothing to evict."""
        evicted = False
        slots = self.table.slots
        for slot in sorted(slots):
            _, gs = slots[slot]
            for h in list(gs.deferred):
                if self.resident <= goal:
                    return True
                del gs.deferred[h]
                if gs.held(h):
                    self.drop(gs, h, gs.meta.get(h))
                    evicted = True
        return evicted

    def drop(self, gs: GroupState, h: Hash, m: Record | None) -> None:
        """Evict the resident entry ``h`` of ``gs`` (``m`` is its record) whole."""
        p: Hash | None
        if m is not None:
            del gs.meta[h]
            ck, on_gpu, p = content_key(m), gpu_refs(m) > 0, counted_parent(m)
        else:
            ck, on_gpu, p = None, False, None
        self.forgotten.add(h)  # (later places of h in the queue may remain)
        slot = gs.slot
        r = gs.refs
        if ck is not None:
            if on_gpu:
                self.marks[0].unmark(ck, slot)
            if r[1] and r[1].pop(h, None) is not None:
                self.marks[1].unmark(ck, slot)
            if r[2] and r[2].pop(h, None) is not None:
                self.marks[2].unmark(ck, slot)
        else:
            r[1].pop(h, None)
            r[2].pop(h, None)
        if gs.deferred:
            gs.deferred.pop(h, None)
        self.resident -= 1
        self.stats.evicted_by_cap += 1
        if p is not None:
            kids = gs.kids
            c = kids.pop(p, None)
            if c is not None:
                if c > 1:
                    kids[p] = c - 1
                elif p in gs.deferred:
                    self.ready.append((gs, p))

    def compact(self) -> None:
        """Rewrite the eviction queue without the hashes it would skip (entries no longer
        resident, deferred or of removed workers) and without repeats (an entry keeps its
        first place), so that it stays proportional to the resident entries.

        Each hash the queue ever holds is looked at here or by :meth:`evict` about once
        (most entries leave by their removal events, long before the queue reaches
        them); a store's resident hashes keep their order, in a shorter item."""
        # per live group (a removed worker's are skipped): the hashes already kept
        seen: dict[GroupState, set[Hash]] = {g: set() for _, g in self.table.slots.values()}
        groups: list[GroupState] = []
        items: list[QueueItem] = []
        n = 0  # hashes kept
        for gs, x in self._items_left():
            kept = seen.get(gs)
            item = None if kept is None else _still_queued(gs, x, kept)
            if item is not None:
                groups.append(gs)
                items.append(item)
                n += 1 if isinstance(item, (int, bytes)) else len(item)
        self.qgroups, self.qhashes, self.qhead = groups, items, 0
        self.qcut = self.qtaken = 0
        self.qlen = n
        self.qlimit = max(1 << 16, 4 * n)
        # every place left is a resident entry's (forget() hears when one stops being)
        self.forgotten.clear()

    def _items_left(self) -> Iterator[tuple[GroupState, QueueItem]]:
        """The queue's items not taken yet (the head store without its taken hashes)."""
        items = zip(islice(self.qgroups, self.qhead, None), islice(self.qhashes, self.qhead, None))
        if self.qcut:
            gs, x = next(items)
            yield gs, x[: -self.qcut]  # type: ignore[index]
        yield from items


def _still_queued(gs: GroupState, x: QueueItem, kept: set[Hash]) -> QueueItem | None:
    """What of queue item ``x`` of ``gs`` keeps its place: its resident hashes that are
    neither deferred nor already ``kept`` (added to it), in order; None if none."""
    if isinstance(x, (int, bytes)):  # one entry
        if not gs.held(x) or x in kept or x in gs.deferred:
            return None
        kept.add(x)
        return x
    # a GPU store.  Usually none of its hashes has a record or a CPU/STORAGE reference any
    # more (its blocks were removed and their records trimmed): one C-level pass each tells
    r1, r2 = gs.refs[1], gs.refs[2]
    if holds_none(gs.meta, x) and (not r1 or holds_none(r1, x)) and (not r2 or holds_none(r2, x)):
        return None
    resident = [y for y in x if gs.held(y)]
    if len(resident) == len(x) and kept.isdisjoint(x) and gs.deferred.keys().isdisjoint(x):
        kept.update(x)  # (a store kept whole)
        return x if type(x) is array else _packed(x)
    keep: list[Any] = []  # (the hashes of x: ints when x is an array)
    for h in reversed(resident):  # (queue order: leaf first)
        if h not in kept and h not in gs.deferred:
            kept.add(h)
            keep.append(h)
    if not keep:
        return None
    if len(keep) == 1:
        return keep[0]  # type: ignore[no-any-return]
    keep.reverse()
    return _packed(keep)


def _packed(hashes: Any) -> QueueItem:
    """A store's hashes as an ``array("Q")`` (plain numbers), or a tuple when some do not
    fit (bytes, negative or wider than 64 bits)."""
    try:
        return array("Q", hashes)
    except (TypeError, OverflowError):
        return tuple(hashes)
