"""Stores: what the index learns from ``BlockStored`` events, on every tier.

One job: turn a store into metadata records and residencies.  A store that carries
sizes and tokens (every GPU store, self-describing CPU/STORAGE stores) records each
block's metadata and content key (:meth:`Stores.store_described`, with its fast path
for the usual GPU store beside the general path: both build records with
:mod:`.records`' layout and count residencies by :meth:`RefRules.ref`'s rules); a
CPU/STORAGE placeholder joins the GPU record of the same worker, group and hash, or
waits for it in the pending table (:meth:`Stores.store_placeholder`); a legacy store
(bytes hashes, no group) is looked up in every group.  Also learns each worker's
groups' kinds and block sizes and, when not configured, its blocks per chunk.
Imports :mod:`kvevents.consumers.content`, :mod:`.marks`, :mod:`.records`,
:mod:`.refs` and :mod:`.workers`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from xxhash import xxh3_64_intdigest as xxh

from kvevents.consumers.content import (
    ROOT_KEY,
    EventExtras,
    chain_block,
    chain_units,
    lookahead_key,
    lookahead_mm,
    pack_tokens,
    root_key,
    split_extras,
)
from kvevents.consumers.index.marks import add_dup
from kvevents.consumers.index.records import (
    CK_MASK,
    END_SHIFT,
    FIELD_MASK,
    FREE_LINK,
    GPU_ONE,
    HAS_CK,
    PARENT_SHIFT,
    SIZE_SHIFT,
    Hash,
    Record,
    add_gpu,
    block_size,
    chain_key,
    content_key,
    end_tokens,
    gpu_refs,
    pack,
    unkeyed,
)
from kvevents.consumers.index.refs import RefRules
from kvevents.consumers.index.workers import KEYED_KINDS, TIERS, GroupState, WorkerState
from kvevents.errors import ConfigError
from kvevents.events import BlockStored

__all__ = ["Stores"]

_NO_PENDING: dict[Any, list[int]] = {}  # the pending table seen by a worker without entries


class Stores(RefRules):
    """Applies ``BlockStored`` events (see the module docstring)."""

    def store_described(self, w: WorkerState, ev: BlockStored, tier: int) -> None:
        """A store that carries sizes and tokens (every GPU store, self-describing CPU)."""
        stats = self.stats
        hashes = ev.block_hashes
        n = len(hashes)
        gs = w.groups.get(ev.group_idx or 0)
        if gs is None:
            gs = self.table.group(w, ev.group_idx or 0)
        size = ev.block_size
        kind = ev.kv_cache_spec_kind
        if kind is not None and kind != gs.kind:
            self.set_kind(w, gs, kind)
        if size <= 0:
            stats.skipped["bad_block_size"] += n
            return
        partial = False
        if tier == 0 and size != gs.block_size:
            if size > gs.block_size:
                if gs.block_size:
                    self.unkey_partials(gs, size)
                gs.block_size = size
                self.table.layout_changed = True
            else:
                # a store at hash granularity into a coarser group: vLLM's partial tail
                # (cache_partial_block), only looked up in Mamba "align" mode; it keeps
                # its metadata (for its removal) but is never matched
                partial = True
                stats.skipped["partial_tail"] += n
        window = ev.kv_cache_spec_sliding_window
        if tier == 0 and window is not None and window != gs.window:
            gs.window = window
            self.table.layout_changed = True
        la = ev.lookahead_token_ids
        if la and tier == 0 and not w.la_fixed and la[0] and len(la[0]) != w.lookahead:
            w.lookahead = len(la[0])
            self.table.layout_changed = True
        if tier >= 0:
            stats.stored[TIERS[tier]] += n
        toks = ev.token_ids
        need = n * size
        off = len(toks) - need
        if off < 0:
            stats.skipped["short_token_ids"] += n
            return
        unit = self.canonical_block_size
        index_keys = gs.indexable_kind and not partial
        if index_keys and size % unit:
            stats.skipped["block_size_not_multiple_of_canonical"] += n
            index_keys = False
        lora = ev.lora_name
        extras = ev.extra_keys
        parent = ev.parent_block_hash
        meta = gs.meta
        pk: int | None
        pend: int | None
        if parent is None:
            if extras and extras[0] is not None:
                ex0 = split_extras(extras[0], lora, True)
                pk = root_key(lora, ex0.salt if ex0 is not None else None)
            else:
                pk = ROOT_KEY if lora is None else root_key(lora)
            pend = 0
        else:
            pm = meta.get(parent)
            if pm is None:
                pk = pend = None
            elif type(pm) is int:  # _ck and _end_tokens of a packed record, inline
                pk = pm & CK_MASK if pm & HAS_CK else None
                e = (pm >> END_SHIFT) & FIELD_MASK
                pend = (e - 1) * ((pm >> SIZE_SHIFT) & FIELD_MASK) if e else None
            else:
                pk, pend = chain_key(pm), end_tokens(pm)
        if off and index_keys:
            # leading blocks the engine did not hash (null blocks outside a window):
            # chain over their tokens so the hashed blocks' keys stay positional
            if pk is not None:
                try:
                    pk = chain_units(pk, toks[:off], unit) if off % unit == 0 else None
                except ConfigError:
                    pk = None
            if pend is not None:
                pend += off
        pending = self.pending.entries if w.wid in self.pending.per_worker else _NO_PENDING
        self.cap.storing = tier == 0  # (until cap.queue_store: see Eviction.evict)
        first = 0
        if (
            tier == 0
            and index_keys
            and lora is None
            and extras is None
            and not la
            and not off
            and not self.keep_token_ids
            and not pending
            and size <= FIELD_MASK
            and (parent is None or (type(parent) is int and 0 <= parent <= CK_MASK))
            and (pend is None or pend // size + n < FIELD_MASK)
        ):
            # Fast path for the usual GPU store: new records packed inline (the fields
            # of records.pack added up) and refcounted as RefRules.ref would (a hash with no record has
            # no residency and no retirement entry: both always go with a record).  It
            # stops at the first block that needs the general path below.
            q = size // unit
            # the blocks' canonical units as slices of the packed tokens, in order
            tbuf: memoryview | None
            try:
                tbuf = memoryview(pack_tokens(toks[off:] if off else toks))
            except ConfigError:
                tbuf = None  # ids no key can be made of: the general path counts them
            width = 8 * unit
            ta = 0
            marks = self.marks[0]
            r1, r2 = gs.refs[1], gs.refs[2]
            bit = gs.bit
            fixed = (size << SIZE_SHIFT) + GPU_ONE  # block size and a GPU refcount of 1
            keyed = fixed + HAS_CK  # plus the key flag
            step = 1 << END_SHIFT
            end_field = ((pend // size + 1) << END_SHIFT) if pend is not None else 0
            parent_field = ((parent + 1) << PARENT_SHIFT) if parent is not None else 0
            cap = self.cap
            resident = cap.resident
            watch = cap.watch
            tracking = cap.tracking
            setdefault = meta.setdefault
            kids = gs.kids
            kids_get = kids.get
            forgotten = cap.forgotten
            # FREE_LINK when the next block's link to this one is free (see
            # Eviction): this block became resident here, with no place in the queue
            free = 0
            try:
                for h in hashes if tbuf is not None else ():
                    if type(h) is not int or not 0 <= h <= CK_MASK:
                        break
                    if pk is not None:
                        if q == 1:
                            k = xxh(tbuf[ta : ta + width], pk)  # type: ignore[index]
                            ta += width
                        else:
                            k = pk
                            for _ in range(q):
                                k = xxh(tbuf[ta : ta + width], k)  # type: ignore[index]
                                ta += width
                        v = keyed + k
                    else:
                        ta += q * width
                        k = None
                        v = fixed
                    if end_field:
                        v += end_field + step
                    v += parent_field + free
                    # insert only if new (a fresh int is never the stored object)
                    if setdefault(h, v) is not v:
                        break  # the hash has a record: the general path takes over
                    if end_field:
                        end_field += step
                    if k is not None:
                        mv = marks.get(k)
                        if mv is None:
                            marks[k] = bit
                        elif mv & bit:
                            add_dup(marks, k, bit)
                        else:
                            marks[k] = mv | bit
                    else:
                        stats.skipped["unknown_parent"] += 1
                    if h not in r1 and h not in r2:
                        resident += 1
                        if tracking:
                            if parent is not None and not free:
                                kids[parent] = kids_get(parent, 0) + 1
                            free = 0 if h in forgotten else FREE_LINK
                        if resident > watch:
                            cap.resident = resident
                            cap.watch_hit()
                            resident = cap.resident
                            watch = cap.watch
                            tracking = True
                    else:
                        free = 0
                    pk = k
                    parent_field = (h + 1) << PARENT_SHIFT
                    parent = h
                    first += 1
            finally:
                cap.resident = resident
            if first == n:
                self.cap.queue_store(gs, hashes)
                return  # (index_keys held: nothing to count as skipped)
            if first:
                pend = None if pend is None else pend + first * size
        t = tuple(toks) if index_keys or self.keep_token_ids else ()
        for i in range(first, n):
            h = hashes[i]
            m = meta.get(h)
            ck = content_key(m) if m is not None else None
            if m is None or (ck is None and pk is not None and index_keys):
                end = pend + size if pend is not None else None
                base = off + i * size
                chain = None
                if index_keys and pk is not None:
                    ex: EventExtras | None = None
                    if extras is not None and i < len(extras) and extras[i] is not None:
                        ex = split_extras(extras[i], lora, i == 0 and ev.parent_block_hash is None)
                    try:
                        chain = ck = chain_block(pk, t[base : base + size], unit, ex)
                        if la and i < len(la) and la[i]:
                            ck = lookahead_key(chain, la[i], lookahead_mm(ex, size))
                    except ConfigError:
                        chain = ck = None  # token ids outside int64: no content key
                        stats.skipped["bad_token_ids"] += 1
                elif index_keys:
                    stats.skipped["unknown_parent"] += 1
                m = pack(
                    ck,
                    end // size if end is not None else None,
                    parent,
                    size,
                    lora,
                    extras[i] if extras is not None and i < len(extras) else None,
                    t[base : base + size] if self.keep_token_ids else None,
                    chain,
                )
                if h in meta:  # an orphan healed: keep its refcount, re-key its residencies
                    m = add_gpu(m, gpu_refs(meta[h]))
                    self.rekey(gs, h, meta[h], m)
                meta[h] = m
                if pending:
                    p = self.pending.take(w.wid, gs.group, h)
                    if p is not None:
                        self.join_pending(w, gs, h, m, p)
                pk, pend = (chain if chain is not None else ck), end
            else:
                if tier == 0:
                    # LRU touch: move to the end of the group's insertion order
                    del meta[h]
                    meta[h] = m
                pk, pend = chain_key(m), end_tokens(m)
            parent = h
            self.ref(w, gs, tier, h, ck)
        if tier == 0:
            self.cap.queue_store(gs, hashes)
            if not index_keys and not gs.indexable_kind:
                stats.skipped["kind:" + (gs.kind or "none")] += n

    def store_self_describing(self, w: WorkerState, ev: BlockStored, tier: int) -> None:
        """A CPU/STORAGE store carrying its chunk's tokens: every block's metadata is
        recorded (the chunk's inner blocks as retained records unless a tier holds
        them) and the chunk tail is counted on ``tier``."""
        gs = w.groups.get(ev.group_idx or 0)
        if gs is not None and gs.block_size and ev.block_size != gs.block_size:
            # a partial tail at hash granularity (C§5.8): join its last hash instead
            self.stats.skipped["self_describing_partial"] += 1
            self.store_placeholder(w, ev, tier, tails=ev.block_hashes[-1:])
            return
        # record metadata for every constituent (no tier refs), then ref the chunk tail
        self.store_described(w, ev, -1)
        gs = w.groups[ev.group_idx or 0]
        if not gs.block_size:
            gs.block_size = ev.block_size
            self.table.layout_changed = True
        hashes = ev.block_hashes
        tail = hashes[-1]
        for h in hashes[:-1]:
            # the chunk's other blocks keep their metadata as retained records (bounded
            # by gpu_metadata_retention) unless a tier holds them
            if h in gs.meta and not gs.held(h):
                self.retention.retire(w.wid, gs, h)
        m = gs.meta.get(tail)
        if m is None:  # pragma: no cover - bad input already counted
            return
        self.stats.self_describing += 1
        self.stats.stored[TIERS[tier]] += 1
        self.observe_tail(w, gs, m)
        self.ref(w, gs, tier, tail, content_key(m))

    def store_placeholder(
        self, w: WorkerState, ev: BlockStored, tier: int, tails: Iterable[Hash] | None = None
    ) -> None:
        """A CPU/STORAGE placeholder (or, with ``tails``, those hashes of a store): each
        tail joins its GPU record and is counted on ``tier``, or waits in the pending
        table until its GPU store comes."""
        stats = self.stats
        gs = w.groups.get(ev.group_idx or 0)
        if gs is None:
            gs = self.table.group(w, ev.group_idx or 0)
        kind = ev.kv_cache_spec_kind
        if kind is not None and kind != gs.kind and gs.kind is None:
            self.set_kind(w, gs, kind)
        meta = gs.meta
        for h in ev.block_hashes if tails is None else tails:
            stats.stored[TIERS[tier]] += 1
            m = meta.get(h)
            if m is None:
                self.pending.add(w.wid, gs.group, h, tier)
                continue
            stats.joined += 1
            self.observe_tail(w, gs, m)
            self.ref(w, gs, tier, h, content_key(m))

    def join_pending(
        self, w: WorkerState, gs: GroupState, h: Hash, m: Record, p: list[int]
    ) -> None:
        ck = content_key(m)
        for tier in (1, 2):
            for _ in range(p[tier]):
                self.stats.joined += 1
                self.stats.joined_late += 1
                self.observe_tail(w, gs, m)
                self.ref(w, gs, tier, h, ck)

    def set_kind(self, w: WorkerState, gs: GroupState, kind: str) -> None:
        gs.kind = kind
        gs.indexable_kind = kind in KEYED_KINDS
        self.table.layout_changed = True

    def unkey_partials(self, gs: GroupState, size: int) -> None:
        """The group's block size grew to ``size``: records of smaller blocks were partial
        tails (cache_partial_block) and lose their content key and marks."""
        for h, m in list(gs.meta.items()):
            if block_size(m) < size and content_key(m) is not None:
                new = unkeyed(m)
                self.rekey(gs, h, m, new)
                gs.meta[h] = new
                self.stats.skipped["partial_tail"] += 1

    def observe_tail(self, w: WorkerState, gs: GroupState, m: Record) -> None:
        if w.bpc_fixed:
            return
        end = end_tokens(m)
        size = gs.block_size or block_size(m)
        if end is None or size <= 0 or end % size:
            return
        bpc = math.gcd(w.bpc, end // size)
        if bpc and bpc != w.bpc:
            w.bpc = bpc
            self.table.layout_changed = True
