"""The index's bounds hold: the memory cap (``len(index) <= max_blocks`` after every
apply, evicting only resident entries, leaves before their parents, oldest first,
decided by the stream alone), retained metadata (its own cap, self-describing chunks
included) and the pending table (free for workers without pending entries)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import asdict
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents.consumers.index import BlockIndex
from kvevents.consumers.index.records import FREE_LINK
from kvevents.consumers.index.records import counted_parent as _counted_parent
from kvevents.consumers.index.records import gpu_refs as _gpu
from kvevents.consumers.index.records import parent_of as _parent
from kvevents.consumers.router import Router
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch

BS = 16
W = [("a", 0), ("b", 0)]


def _toks(h: int, n: int = 1) -> list[int]:
    """Tokens of the blocks ``h .. h+n-1``: a function of the hash, so a hash re-stored
    anywhere carries the same content."""
    return [(h + i) * 100 + j for i in range(n) for j in range(BS)]


def gpu(hashes: list[int], parent: int | None, group: int = 0) -> BlockStored:
    toks = [t for h in hashes for t in _toks(h)]
    return BlockStored(hashes, parent, toks, BS, None, "GPU", None, group_idx=group,
                       kv_cache_spec_kind="full_attention")  # fmt: skip


def held_entries(index: BlockIndex) -> set[tuple[Any, int, Any]]:
    """(worker, group, hash) of every entry some tier holds, recounted from the tables."""
    out = set()
    for wid in index.workers():
        for g, gs in index._workers[wid].groups.items():
            for h, m in gs.meta.items():
                if _gpu(m) > 0:
                    out.add((wid, g, h))
            for tier in (1, 2):
                out.update((wid, g, h) for h in gs.refs[tier])
    return out


def check_bounds(index: BlockIndex) -> None:
    held = held_entries(index)
    assert len(index) == len(held) <= index.max_blocks
    for wid in index.workers():
        for g, gs in index._workers[wid].groups.items():
            # every record no tier holds is a retained record, and those are bounded
            for h in gs.meta:
                if (wid, g, h) not in held:
                    assert (wid, g, h) in index._retired
            # the children counts the eviction order relies on match a recount (of the
            # links that are not free)
            kids: Counter[Any] = Counter()
            for h, m in gs.meta.items():
                p = _counted_parent(m)
                if (wid, g, h) in held and p is not None:
                    kids[p] += 1
            # (counted once more than half the cap has been resident)
            assert gs.kids == (dict(kids) if index._tracking else {})
            assert all((wid, g, h) in held for h in gs.deferred)
    check_free_links(index, held)
    assert index.retained_count <= index.gpu_metadata_retention
    assert index._npending == dict(Counter(k[0] for k in index._pending))


def queue_places(index: BlockIndex) -> dict[tuple[int, Any], int]:
    """(group object id, hash) -> its first place in the eviction queue not taken yet."""
    cap = index._feed.cap
    first: dict[tuple[int, Any], int] = {}
    pos = 0
    for i in range(cap.qhead, len(cap.qhashes)):
        gs, x = cap.qgroups[i], cap.qhashes[i]
        if type(x) is int or type(x) is bytes:
            order: list[Any] = [x]
        else:
            order = list(x)[::-1]  # (taken from the end)
            if i == cap.qhead and cap.qcut:
                order = order[cap.qcut :]
        for h in order:
            first.setdefault((id(gs), h), pos)
            pos += 1
    return first


def check_free_links(index: BlockIndex, held: set[tuple[Any, int, Any]]) -> None:
    """A resident block whose link to its parent is free (not counted) has a place in
    the queue before every place of its parent, so the queue takes it first."""
    places: dict[tuple[int, Any], int] | None = None
    for wid in index.workers():
        for g, gs in index._workers[wid].groups.items():
            for h, m in gs.meta.items():
                if type(m) is int and m & FREE_LINK and (wid, g, h) in held:
                    assert index._tracking
                    places = queue_places(index) if places is None else places
                    mine = places.get((id(gs), h))
                    assert mine is not None, "a free link's block has no place in the queue"
                    theirs = places.get((id(gs), _parent(m)))
                    assert theirs is None or mine < theirs
                    assert h not in gs.deferred


@st.composite
def events(draw: st.DrawFn) -> KVEvent:
    kind = draw(st.sampled_from(["chain", "chain", "chain", "gpu_rm", "place", "self", "rm",
                                 "cycle", "clear"]))  # fmt: skip
    group = draw(st.sampled_from([0, 0, 1]))
    pool = st.integers(1, 60)
    if kind == "chain":
        start = draw(pool)
        n = draw(st.integers(1, 6))
        parent = draw(st.one_of(st.none(), pool))
        return gpu(list(range(start, start + n)), parent, group)
    if kind == "cycle":  # a block naming itself (or its own child) as parent
        h = draw(pool)
        return gpu([h, h + 1], h + draw(st.integers(0, 1)), group)
    if kind == "gpu_rm":
        return BlockRemoved(draw(st.lists(pool, min_size=1, max_size=3)), "GPU", group_idx=group)
    tier = draw(st.sampled_from(["CPU", "STORAGE"]))
    if kind == "place":
        hs = draw(st.lists(pool, min_size=1, max_size=2))
        return BlockStored(hs, None, [], 0, None, tier, None, group_idx=group)
    if kind == "self":
        start = draw(pool)
        parent = draw(st.one_of(st.none(), pool))
        return BlockStored([start, start + 1], parent, _toks(start, 2), BS, None, tier, None,
                           group_idx=group)  # fmt: skip
    if kind == "rm":
        return BlockRemoved(draw(st.lists(pool, min_size=1, max_size=2)), tier, group_idx=group)
    return AllBlocksCleared()


stream_st = st.lists(
    st.tuples(st.sampled_from(W), st.lists(events(), min_size=1, max_size=4)), max_size=40
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stream=stream_st,
    max_blocks=st.integers(1, 12),
    retention=st.sampled_from([0, 1, 5, 50]),
    bpc=st.sampled_from([2, None]),
)
def test_bounds_hold_after_every_apply(
    stream: list[tuple[tuple[str, int], list[KVEvent]]], max_blocks: int, retention: int,
    bpc: int | None,
) -> None:  # fmt: skip
    index = BlockIndex(blocks_per_chunk=bpc, max_blocks=max_blocks,
                       gpu_metadata_retention=retention, max_pending=4)  # fmt: skip
    for (source, rank), evs in stream:
        index.apply(source, rank, KVEventBatch(0.0, evs))
        check_bounds(index)
        assert index.pending_count <= 4


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=stream_st, max_blocks=st.integers(1, 12), seed=st.integers(0, 1000))
def test_queries_never_change_what_the_index_holds_or_evicts(
    stream: list[tuple[tuple[str, int], list[KVEvent]]], max_blocks: int, seed: int
) -> None:
    """Two indexes on one stream agree, whatever is queried on one of them in between."""
    quiet = BlockIndex(blocks_per_chunk=2, max_blocks=max_blocks, gpu_metadata_retention=5)
    asked = BlockIndex(blocks_per_chunk=2, max_blocks=max_blocks, gpu_metadata_retention=5)
    router = Router(asked)
    rng = random.Random(seed)
    for (source, rank), evs in stream:
        quiet.apply(source, rank, KVEventBatch(0.0, evs))
        asked.apply(source, rank, KVEventBatch(0.0, evs))
        for _ in range(3):
            h = rng.randrange(1, 70)
            router.find_matches(_toks(h, rng.randrange(1, 8)))
            asked.block_info(rng.choice(W), rng.randrange(2), h)
        asked.summary()
        asked.gauges()
    assert held_entries(asked) == held_entries(quiet)
    assert asdict(asked.stats) == asdict(quiet.stats)
    assert asked.summary() == quiet.summary()
    assert [dict(m) for m in asked._marks] == [dict(m) for m in quiet._marks]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1_000), st.integers(1, 5)), min_size=1, max_size=60),
    st.integers(2, 20),
)
def test_eviction_takes_leaves_before_their_parents(
    growth: list[tuple[int, int]], max_blocks: int
) -> None:
    """Stores only, each extending a resident block (or starting a root): however the
    cap bites, a resident entry's parent is always resident."""
    index = BlockIndex(max_blocks=max_blocks)
    parent_of: dict[int, int | None] = {}
    next_hash = 1
    for pick, n in growth:
        held = sorted(h for (_, _, h) in held_entries(index))
        parent = None if not held or pick % 4 == 0 else held[pick % len(held)]
        hashes = list(range(next_hash, next_hash + n))
        next_hash += n
        for i, h in enumerate(hashes):
            parent_of[h] = parent if i == 0 else hashes[i - 1]
        index.apply("a", 0, KVEventBatch(0.0, [gpu(hashes, parent)]))
        resident = {h for (_, _, h) in held_entries(index)}
        assert len(resident) <= max_blocks
        for h in resident:
            assert parent_of[h] is None or parent_of[h] in resident


def test_shared_roots_outlive_the_chats_built_on_them_oldest_chats_go_first() -> None:
    index = BlockIndex(max_blocks=100)
    system = list(range(1, 21))  # a 20-block system prompt, stored once
    index.apply("a", 0, KVEventBatch(0.0, [gpu(system, None)]))
    chats = []
    for c in range(40):  # each chat: 8 blocks on the system prompt, never re-announced
        hashes = list(range(1000 * (c + 1), 1000 * (c + 1) + 8))
        chats.append(hashes)
        index.apply("a", 0, KVEventBatch(0.0, [gpu(hashes, system[-1])]))
        assert len(index) <= 100
    resident = {h for (_, _, h) in held_entries(index)}
    assert set(system) <= resident
    kept = [c for c, hs in enumerate(chats) if set(hs) <= resident]
    gone = [c for c, hs in enumerate(chats) if not set(hs) & resident]
    assert kept == list(range(40 - len(kept), 40)) and len(kept) >= 9  # the newest chats
    assert gone == list(range(len(gone)))  # the oldest ones, whole
    assert index.stats.evicted_by_cap == 20 + 40 * 8 - len(index)
    # the system prompt still matches for a new chat, on the prompt's full length
    match = Router(index).find_matches(_toks(1, 20) + [7] * 64)[("a", 0)]
    assert match.gpu == 20 * BS


def test_cap_holds_when_one_worker_holds_only_retained_metadata() -> None:
    """The old eviction picked the worker with the most metadata; one whose records are
    all GPU-removed (retained) had nothing to evict, and the cap was not enforced."""
    index = BlockIndex(max_blocks=1000, gpu_metadata_retention=100_000)
    for start in range(1, 5001, 500):
        retained = list(range(start, start + 500))
        index.apply("old", 0, KVEventBatch(0.0, [gpu(retained, None)]))
        index.apply("old", 0, KVEventBatch(0.0, [BlockRemoved([h], "GPU", group_idx=0)
                                                 for h in retained]))  # fmt: skip
    assert len(index) == 0 and index.retained_count == 5000
    for c in range(30):
        hashes = list(range(10_000 * (c + 1), 10_000 * (c + 1) + 100))
        index.apply("new", 0, KVEventBatch(0.0, [gpu(hashes, None)]))
        assert len(index) <= 1000
    assert index.retained_count == 5000  # the retained records are not what the cap counts
    assert index.stats.evicted_by_cap == 3000 - len(index) and len(index) > 900


def test_self_describing_chunks_retire_their_inner_blocks() -> None:
    """20,000 chunks stored and evicted with retention 1,000 kept 61,000 records."""
    index = BlockIndex(blocks_per_chunk=4, gpu_metadata_retention=1_000)
    for c in range(20_000):
        hashes = list(range(4 * c + 1, 4 * c + 5))
        ev = BlockStored(hashes, None, _toks(hashes[0], 4), BS, None, "CPU", None, group_idx=0)
        index.apply("a", 0, KVEventBatch(0.0, [ev, BlockRemoved([hashes[-1]], "CPU",
                                                                group_idx=0)]))  # fmt: skip
    gs = index._workers[("a", 0)].groups[0]
    assert len(index) == 0
    assert len(gs.meta) == index.retained_count == 1_000
    assert index.stats.metadata_evicted == 80_000 - 1_000


def test_a_stale_pending_entry_changes_nothing_for_other_workers() -> None:
    """One worker's placeholder waiting for a GPU store that never comes leaves every
    other worker's stores as they would be without it (same records, free links and
    children counts), and joins when its own GPU store comes."""
    index = BlockIndex(blocks_per_chunk=4, max_blocks=10)
    alone = BlockIndex(blocks_per_chunk=4, max_blocks=10)
    index.apply("a", 0, KVEventBatch(0.0, [BlockStored([999], None, [], 0, None, "CPU", None,
                                                       group_idx=0)]))  # fmt: skip
    assert index.pending_count == 1
    for ix in (index, alone):
        ix.apply("b", 0, KVEventBatch(0.0, [gpu(list(range(1, 9)), None)]))
    b, b_alone = index._workers[("b", 0)].groups[0], alone._workers[("b", 0)].groups[0]
    assert b.meta == b_alone.meta and b.kids == b_alone.kids
    assert any(m & FREE_LINK for m in b.meta.values())  # (the cap's bookkeeping runs)
    index.apply("a", 0, KVEventBatch(0.0, [gpu(list(range(100, 104)), None)]))
    index.apply("a", 0, KVEventBatch(0.0, [gpu([999], 103)]))
    assert index.pending_count == 0 and index.stats.joined_late == 1
    check_bounds(index)


def test_gauges_read_the_bounds() -> None:
    index = BlockIndex(max_blocks=10, gpu_metadata_retention=3, blocks_per_chunk=2)
    index.apply("a", 0, KVEventBatch(0.0, [gpu(list(range(1, 9)), None)]))
    index.apply("a", 0, KVEventBatch(0.0, [BlockRemoved([8, 7, 6, 5, 4], "GPU", group_idx=0),
                                           BlockStored([50], None, [], 0, None, "CPU", None,
                                                       group_idx=0)]))  # fmt: skip
    assert index.gauges() == {"resident_entries": 3, "pending_joins": 1, "retained_metadata": 3}


def test_no_eviction_bookkeeping_far_below_the_cap() -> None:
    """The children counts and the eviction queue start at half the cap: an index far
    from its cap pays nothing for them."""
    index = BlockIndex(max_blocks=100)
    index.apply("a", 0, KVEventBatch(0.0, [gpu(list(range(1, 51)), None)]))
    gs = index._workers[("a", 0)].groups[0]
    assert not index._tracking and gs.kids == {} and index._qhashes == []
    index.apply("a", 0, KVEventBatch(0.0, [gpu(list(range(51, 61)), 50)]))
    assert index._tracking and len(index) == 60
    # the 51st resident block started the bookkeeping, which counted every link then
    # (1..51 have a resident child each); so is 52's, to a block placed by that start;
    # 53..60 link to a block of their own store: free, not counted
    assert sorted(gs.kids) == list(range(1, 52))
    assert [h for h, m in gs.meta.items() if m & FREE_LINK] == list(range(53, 61))
    check_bounds(index)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=stream_st, max_blocks=st.integers(1, 12), seed=st.integers(0, 1000))
def test_a_restored_snapshot_goes_on_evicting_as_the_original(
    stream: list[tuple[tuple[str, int], list[KVEvent]]], max_blocks: int, seed: int
) -> None:
    """Snapshots taken at random points (a GPU store's blocks part evicted, say) restore
    the eviction state: the restored index evicts exactly what the original does."""
    original = BlockIndex(blocks_per_chunk=2, max_blocks=max_blocks, gpu_metadata_retention=5)
    restored = BlockIndex(blocks_per_chunk=2, max_blocks=max_blocks, gpu_metadata_retention=5)
    rng = random.Random(seed)
    for (source, rank), evs in stream:
        original.apply(source, rank, KVEventBatch(0.0, evs))
        restored.apply(source, rank, KVEventBatch(0.0, evs))
        if rng.random() < 0.3:
            restored = BlockIndex.restore(restored.snapshot())
        assert held_entries(restored) == held_entries(original)
    assert asdict(restored.stats) == asdict(original.stats)
    assert restored.snapshot() == original.snapshot()


def test_the_eviction_queue_holds_one_item_per_gpu_store() -> None:
    """A GPU store's blocks are queued as one item (taken leaf first), not one per
    block; a store whose blocks have all left is dropped from the queue whole."""
    index = BlockIndex(max_blocks=100)
    for c in range(7):  # 56 resident: the bookkeeping has started
        index.apply("a", 0, KVEventBatch(0.0, [gpu(list(range(100 * c + 1, 100 * c + 9)), None)]))
    assert index._tracking
    before = len(index._qhashes)
    for c in range(7, 12):
        index.apply("a", 0, KVEventBatch(0.0, [gpu(list(range(100 * c + 1, 100 * c + 9)), None)]))
    assert len(index._qhashes) == before + 5
    assert [list(x) for x in index._qhashes[-5:]] == [
        list(range(100 * c + 1, 100 * c + 9)) for c in range(7, 12)
    ]
    # over the cap, the oldest stores go first, each leaf first (the last one in part)
    for c in range(12, 18):
        index.apply("a", 0, KVEventBatch(0.0, [gpu(list(range(100 * c + 1, 100 * c + 9)), None)]))
        check_bounds(index)
    order = [h for c in range(18) for h in range(100 * c + 8, 100 * c, -1)]
    evicted = index.stats.evicted_by_cap
    assert evicted == 18 * 8 - len(index) and evicted % 8
    assert {h for (_, _, h) in held_entries(index)} == set(order[evicted:])


def test_forgotten_hashes_stay_bounded_when_eviction_keeps_the_queue_short() -> None:
    """With a tiny cap, eviction takes the queue as fast as stores fill it, so the queue
    never asks for a compaction; the set of hashes that lost their records (kept until
    the next compaction) must not grow with the stream for that."""
    index = BlockIndex(max_blocks=8, gpu_metadata_retention=0)
    cap = index._feed.cap
    most = 0
    for i in range(5_000):
        index.apply("a", 0, KVEventBatch(0.0, [gpu(list(range(16 * i + 1, 16 * i + 17)), None)]))
        assert len(index) <= 8
        most = max(most, len(cap.forgotten))
    assert index.stats.evicted_by_cap > 70_000  # more hashes forgotten than one qlimit
    assert most <= cap.qlimit + 16
