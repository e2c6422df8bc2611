"""Stores: what the index learns from ``BlockStored`` events, on every tier.

One job: turn a store into metadata records and residencies.

* A store that carries sizes and tokens (every GPU store, self-describing CPU/STORAGE
  stores) records each block's metadata and content key, block by block
  (:meth:`Stores.store_described`); its residencies are counted by
  :meth:`RefRules.ref`.  Content keys chain as vLLM's block hashes do
  (``hash_block_tokens`` over the parent's hash, the block's tokens and its extra keys),
  but over canonical units with a stable hash (:mod:`kvevents.consumers.content`).
* A CPU/STORAGE placeholder (vLLM's offload connector publishes only the chunk's tail
  hash) joins the GPU record of the same worker, group and hash, or waits for it in the
  pending table (:meth:`Stores.store_placeholder`).
* A legacy store (bytes hashes, no group) is looked up in every group (:mod:`.legacy`).

Also learns each worker's groups' kinds, block sizes and windows and, when not
configured, its blocks per chunk and lookahead.  Imports
:mod:`kvevents.consumers.content`, :mod:`.records`, :mod:`.refs` and :mod:`.workers`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvevents.consumers.content import (
    ROOT_KEY,
    chain_units,
    lookahead_key,
    lookahead_mm,
    root_key,
    split_extras,
    store_tokens,
)
from kvevents.consumers.index.records import (
    Hash,
    Record,
    add_gpu,
    block_size,
    chain_key,
    content_key,
    end_tokens,
    gpu_refs,
    pack,
    packs_end,
    packs_size,
    plain_hash,
    unkeyed,
    with_free_link,
)
from kvevents.consumers.index.refs import RefRules
from kvevents.consumers.index.workers import GPU, KEYED_KINDS, TIERS, GroupState, WorkerState
from kvevents.errors import ConfigError
from kvevents.events import BlockStored
from kvevents.native import NATIVE

__all__ = ["Stores"]


class _StoreRun:
    """One described store's blocks, applied in order (:meth:`store_all`, for
    :meth:`Stores.store_described`).

    Holds what the blocks chain on: ``key`` and ``end``, the content key and the token
    end position of the block before (None when unknown), and ``parent``, its hash.

    Free links (see :mod:`.eviction`): in a plain GPU store (:func:`_free_links_allowed`)
    of new blocks, a block whose parent became resident just before it in the same
    store, with no earlier place in the eviction queue, is not counted among its
    parent's resident children; its record carries the flag instead.  The first block
    that had a record (or whose hash is not a plain 64-bit number) ends them for the
    rest of the store.  A link is free only while the memory cap's bookkeeping runs, so
    a store during which it neither runs nor can start has none.
    """

    __slots__ = (
        "end",
        "ev",
        "extras",
        "feed",
        "free_links",
        "gs",
        "hold",
        "keep",
        "key",
        "keyed",
        "la",
        "link_free",
        "lora",
        "off",
        "parent",
        "pending",
        "size",
        "tier",
        "tokens",
        "w",
    )

    def __init__(
        self,
        feed: Stores,
        w: WorkerState,
        gs: GroupState,
        ev: BlockStored,
        tier: int,
        off: int,
        keyed: bool,
        key: int | None,
        end: int | None,
    ) -> None:
        self.feed = feed
        self.w = w
        self.gs = gs
        self.ev = ev
        self.tier = tier
        self.off = off
        self.keyed = keyed
        self.key = key
        self.end = end
        self.parent: Hash | None = ev.parent_block_hash
        # the event's fields each block reads
        self.size = ev.block_size
        self.lora = ev.lora_name
        self.extras = ev.extra_keys
        self.la = ev.lookahead_token_ids
        self.keep = feed.keep_token_ids
        self.tokens = store_tokens(ev.token_ids, feed.canonical_block_size) if keyed else None
        self.pending = w.wid in feed.pending.per_worker
        # a new GPU record is made holding its first GPU reference (RefRules.ref's
        # ``held``) unless a placeholder may join it before that reference
        self.hold = tier == GPU and not self.pending
        self.free_links = _free_links_allowed(self)
        self.link_free = False  # the next new block's link to its parent is free

    def store_all(self) -> None:
        """Each block of the store in order: its record (new, an orphan's healed, or an
        LRU touch on the GPU tier: to the end of the group's record order), then one
        more reference on the store's tier (:meth:`RefRules.ref`)."""
        feed, w, gs, tier, keyed = self.feed, self.w, self.gs, self.tier, self.keyed
        meta, ref, new_record, hold = gs.meta, feed.ref, self.new_record, self.hold
        hashes = self.ev.block_hashes
        for i in range(self.compiled_blocks(), len(hashes)):
            h = hashes[i]
            m = meta.get(h)
            if self.free_links and (m is not None or not plain_hash(h)):
                self.free_links = self.link_free = False
            if m is None:
                ck = new_record(i, h, None)
                held = hold
            else:
                held = False
                ck = content_key(m)
                if ck is None and keyed and self.key is not None:
                    ck = new_record(i, h, m)  # an orphan healed
                else:
                    if tier == GPU:  # an LRU touch
                        del meta[h]
                        meta[h] = m
                    self.key, self.end = chain_key(m), end_tokens(m)
            self.parent = h
            fresh = ref(w, gs, tier, h, ck, self.link_free, held)
            self.link_free = self.free_links and fresh

    def compiled_blocks(self) -> int:
        """How many of the store's blocks, from the first, the compiled core stored: the
        new blocks of a plain GPU store (content keys, no LoRA name, extra keys,
        lookahead ids or kept token ids, no placeholder waiting) during which the memory
        cap's bookkeeping neither runs nor can start, each by :meth:`new_record` and
        :meth:`RefRules.ref`'s rules, until the first block it does not store so (one
        with a record, a hash or end that does not pack); 0 without the core's tables."""
        gs, feed, tokens = self.gs, self.feed, self.tokens
        hashes = self.ev.block_hashes
        if (
            NATIVE is None
            or not self.hold
            or self.key is None
            or tokens is None
            or tokens.packed is None
            or self.lora is not None
            or self.extras is not None
            or self.la
            or self.keep
            or feed.cap.may_track(len(hashes))
            or not feed.compiled_tables(gs)
        ):
            return 0
        done, self.key, self.end, self.parent, resident = NATIVE.gpu_store_blocks(
            gs.meta, gs.refs[1], gs.refs[2], feed.marks[GPU], gs.slot, hashes, 0,
            tokens.packed, self.off, self.size, feed.canonical_block_size, self.key,
            self.end, self.parent,
        )  # fmt: skip
        feed.cap.resident += resident
        return int(done)

    def new_record(self, i: int, h: Hash, old: Record | None) -> int | None:
        """Record block ``i`` (hash ``h``) with its content key (returned: the key its
        marks use), keeping the refcount of an orphan's record ``old``, and join the
        placeholders waiting for it."""
        size, extras, tokens = self.size, self.extras, self.tokens
        end = self.end + size if self.end is not None else None
        start = self.off + i * size
        extra = extras[i] if extras is not None and i < len(extras) else None
        chain = ck = None
        if tokens is not None and self.key is not None:  # (tokens: a keyed store's)
            ex = None
            if extra is not None:
                root = i == 0 and self.ev.parent_block_hash is None
                ex = split_extras(extra, self.lora, root)
            try:
                chain = ck = tokens.block_key(self.key, start, size, ex)
                la = self.la
                if la and i < len(la) and la[i]:
                    ck = lookahead_key(chain, la[i], lookahead_mm(ex, size))
            except ConfigError:
                chain = ck = None  # token ids outside int64: no content key
                self.feed.stats.skipped["bad_token_ids"] += 1
        elif self.keyed:
            self.feed.stats.skipped["unknown_parent"] += 1
        ids = tuple(self.ev.token_ids[start : start + size]) if self.keep else None
        end_blocks = end // size if end is not None else None
        gpu = 1 if old is None and self.hold else 0  # (see __init__)
        m = pack(ck, end_blocks, self.parent, size, self.lora, extra, ids, chain, gpu)
        if self.link_free:
            m = with_free_link(m)
        if old is not None:  # an orphan healed: keep its refcount, re-key its residencies
            m = add_gpu(m, gpu_refs(old))
            self.feed.rekey(self.gs, h, old, m)
        self.gs.meta[h] = m
        if self.pending:
            self.join(h, m)
        self.key, self.end = chain, end  # (chain is None only where ck is)
        return ck

    def join(self, h: Hash, m: Record) -> None:
        """The placeholders waiting for ``h`` (new record ``m``) join it."""
        feed, w, gs = self.feed, self.w, self.gs
        p = feed.pending.take(w.wid, gs.group, h)
        if p is not None:
            feed.join_pending(w, gs, h, m, p)


def _free_links_allowed(run: _StoreRun) -> bool:
    """Whether a store's blocks may link freely: a GPU store during which the memory
    cap's bookkeeping runs or may start (a link is free only while it runs: see
    :meth:`RefRules.ref`'s return), whose every new record is a packed one (no LoRA
    name, extra keys, lookahead ids or kept token ids; sizes, positions and parent in
    range) with content keys, all its token ids packable, no leading tokens outside its
    blocks, and no placeholder of its worker waiting."""
    size, n, parent = run.size, len(run.ev.block_hashes), run.parent
    return (
        run.tier == GPU
        and run.feed.cap.may_track(n)
        and run.keyed
        and run.lora is None
        and run.extras is None
        and not run.la
        and not run.off
        and not run.keep
        and not run.pending
        and packs_size(size)
        and (parent is None or plain_hash(parent))
        and (run.end is None or packs_end(run.end // size + n))
        and run.tokens is not None
        and run.tokens.packed is not None
    )


class Stores(RefRules):
    """Applies ``BlockStored`` events (see the module docstring)."""

    def store_described(self, w: WorkerState, ev: BlockStored, tier: int) -> None:
        """A store that carries block sizes and tokens: every GPU store, and (``tier``
        -1: metadata only) the blocks of a self-describing CPU/STORAGE chunk.

        What the store teaches about its group comes first (:meth:`learn_group`).  Then
        each block, in order, gets a metadata record if it has none (or an orphan's
        record is healed: it had no content key because its parent was unknown), with
        the content key chained on its parent's (:meth:`chain_start`, :meth:`new_record`),
        and one more reference on ``tier`` (:meth:`RefRules.ref`).  A block whose record
        exists is an LRU touch on the GPU tier.  A GPU store's blocks then take one
        place in the memory cap's eviction queue, leaf first.
        """
        n = len(ev.block_hashes)
        gs = self.table.group(w, ev.group_idx or 0)
        partial = self.learn_group(w, gs, ev, tier)
        if partial is None:
            return
        if tier >= 0:
            self.stats.stored[TIERS[tier]] += n
        off = len(ev.token_ids) - n * ev.block_size  # leading tokens of no block
        if off < 0:
            self.stats.skipped["short_token_ids"] += n
            return
        keyed = gs.indexable_kind and not partial
        if keyed and ev.block_size % self.canonical_block_size:
            self.stats.skipped["block_size_not_multiple_of_canonical"] += n
            keyed = False
        key, end = self.chain_start(gs, ev, off, keyed)
        self.cap.storing = tier == GPU  # (until cap.queue_store: see Eviction.evict)
        _StoreRun(self, w, gs, ev, tier, off, keyed, key, end).store_all()
        if tier == GPU:
            self.cap.queue_store(gs, ev.block_hashes)
            if not keyed and not gs.indexable_kind:
                self.stats.skipped["kind:" + (gs.kind or "none")] += n

    def learn_group(
        self, w: WorkerState, gs: GroupState, ev: BlockStored, tier: int
    ) -> bool | None:
        """What a store says about its group and worker: kind, block size (the largest
        GPU block size seen), sliding window, lookahead tokens (when not configured).

        Returns whether the store is a *partial tail* (a GPU store at a finer block size
        than its group's: vLLM's ``cache_partial_block``, only looked up in Mamba
        "align" mode: kept for its removal, never matched), or None for a store with no
        block size (counted, nothing applied)."""
        stats = self.stats
        n = len(ev.block_hashes)
        kind = ev.kv_cache_spec_kind
        if kind is not None and kind != gs.kind:
            self.set_kind(w, gs, kind)
        size = ev.block_size
        if size <= 0:
            stats.skipped["bad_block_size"] += n
            return None
        partial = False
        if tier == GPU and size != gs.block_size:
            if size > gs.block_size:
                if gs.block_size:
                    self.unkey_partials(gs, size)
                gs.block_size = size
                self.table.layout_changed = True
            else:
                partial = True
                stats.skipped["partial_tail"] += n
        window = ev.kv_cache_spec_sliding_window
        if tier == GPU and window is not None and window != gs.window:
            gs.window = window
            self.table.layout_changed = True
        la = ev.lookahead_token_ids
        if la and tier == GPU and not w.la_fixed and la[0] and len(la[0]) != w.lookahead:
            w.lookahead = len(la[0])
            self.table.layout_changed = True
        return partial

    def chain_start(
        self, gs: GroupState, ev: BlockStored, off: int, keyed: bool
    ) -> tuple[int | None, int | None]:
        """The content key the store's first block chains on and the token position it
        starts at (each None when unknown: a parent without a record).

        A store without a parent starts at the root key of its LoRA name and cache salt
        (the salt is in the first block's extra keys), at token 0.  Leading tokens that
        are no block of the store (``off`` of them: null blocks outside a sliding window,
        which the engine does not hash) are chained over, so the hashed blocks' keys
        stay positional."""
        parent = ev.parent_block_hash
        key: int | None
        end: int | None
        if parent is None:
            extras = ev.extra_keys
            if extras and extras[0] is not None:
                first = split_extras(extras[0], ev.lora_name, True)
                key = root_key(ev.lora_name, first.salt if first is not None else None)
            else:
                key = ROOT_KEY if ev.lora_name is None else root_key(ev.lora_name)
            end = 0
        else:
            m = gs.meta.get(parent)
            key, end = (None, None) if m is None else (chain_key(m), end_tokens(m))
        if off and keyed:
            if key is not None:
                try:
                    unit = self.canonical_block_size
                    key = chain_units(key, ev.token_ids[:off], unit) if off % unit == 0 else None
                except ConfigError:
                    key = None
            if end is not None:
                end += off
        return key, end

    def store_self_describing(self, w: WorkerState, ev: BlockStored, tier: int) -> None:
        """A CPU/STORAGE store carrying its chunk's tokens: every block's metadata is
        recorded (the chunk's inner blocks as retained records unless a tier holds
        them) and the chunk tail is counted on ``tier``."""
        gs = w.groups.get(ev.group_idx or 0)
        if gs is not None and gs.block_size and ev.block_size != gs.block_size:
            # a partial tail at hash granularity (vLLM's boundary keys): join its last hash
            # instead
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
        self, w: WorkerState, ev: BlockStored, tier: int, tails: Sequence[Hash] | None = None
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
        meta, ref = gs.meta, self.ref
        observe = None if w.bpc_fixed else self.observe_tail
        hashes = ev.block_hashes if tails is None else tails
        stats.stored[TIERS[tier]] += len(hashes)
        for h in hashes:
            m = meta.get(h)
            if m is None:
                self.pending.add(w.wid, gs.group, h, tier)
                continue
            stats.joined += 1
            if observe is not None:
                observe(w, gs, m)
            ref(w, gs, tier, h, content_key(m))

    def join_pending(
        self, w: WorkerState, gs: GroupState, h: Hash, m: Record, p: list[int]
    ) -> None:
        """The GPU record ``m`` of ``h`` arrived: the placeholders that waited for it
        (``p``: how many per tier) join it now, each one reference on its tier."""
        ck = content_key(m)
        for tier in (1, 2):
            for _ in range(p[tier]):
                self.stats.joined += 1
                self.stats.joined_late += 1
                self.observe_tail(w, gs, m)
                self.ref(w, gs, tier, h, ck)

    def set_kind(self, w: WorkerState, gs: GroupState, kind: str) -> None:
        """The group's KV-cache spec kind: only prefix-indexable and windowed kinds get
        content keys (:data:`.workers.KEYED_KINDS`)."""
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
        """A chunk tail ``m`` was stored on CPU/STORAGE: unless configured, the worker's
        blocks per chunk is the gcd of the block counts at which tails fall."""
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
