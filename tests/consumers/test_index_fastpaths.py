"""Batches and single events, packed and wide records: one index, whatever the feeding.

The index applies a batch (``BlockIndex.apply``) and a single event
(``BlockIndex.apply_event``) by the same rules, and its records are packed ints unless a
block carries wide fields (token ids kept, LoRA names, extra keys), when they are
tuples; plain GPU stores also link their blocks freely for the memory cap.  The
reference index is fed event by event and keeps token ids, so its records are all
tuples and it never links freely.  Random streams (duplicates, unknown hashes, orphans,
placeholders before and after their GPU store, clears, several groups, tiny caps so
that LRU eviction and metadata trimming run) must leave identical counters, summaries,
block info (but the token ids) and matches.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.consumers.index import BlockIndex
from kvevents.consumers.router import Router
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch

# four 128-token sequences sharing their first 64 tokens pairwise; hash of block i of
# sequence s: HASHES[s][i] (16-token blocks)
SEQS = [
    list(range(1, 129)),
    list(range(1, 65)) + list(range(500, 564)),
    list(range(2000, 2128)),
    list(range(2000, 2064)) + list(range(3000, 3064)),
]
HASHES = [[1000 * (s + 1) + i for i in range(8)] for s in range(4)]
ALL = [h for hs in HASHES for h in hs]
WORKERS = [("a", 0), ("b", 0)]


@st.composite
def events(draw: st.DrawFn) -> KVEvent:
    kind = draw(st.sampled_from(["store", "store", "gpu_rm", "gpu_rm", "place", "rm", "clear"]))
    group = draw(st.sampled_from([0, 0, 1, None]))
    if kind == "store":
        seq = draw(st.integers(0, 3))
        hashes = HASHES[seq]
        start = draw(st.integers(0, 7))
        stop = draw(st.integers(start + 1, 8))
        parent = hashes[start - 1] if start else None
        if draw(st.integers(0, 5)) == 0:
            parent = 99  # an orphan: its parent's record is unknown
        return BlockStored(hashes[start:stop], parent, SEQS[seq][start * 16 : stop * 16], 16, None,
                           draw(st.sampled_from(["GPU", "GPU", None])), None, group_idx=group,
                           kv_cache_spec_kind=draw(st.sampled_from(["full_attention", None])))  # fmt: skip
    if kind == "gpu_rm":
        hs = draw(st.lists(st.sampled_from([*ALL, 77]), min_size=1, max_size=2))
        return BlockRemoved(hs, draw(st.sampled_from(["GPU", None])), group_idx=group)  # type: ignore[arg-type]
    tier = draw(st.sampled_from(["CPU", "STORAGE"]))
    hs = draw(st.lists(st.sampled_from([*ALL[1::2], 77]), min_size=1, max_size=2))
    if kind == "place":
        return BlockStored(hs, None, [], 0, None, tier, None, group_idx=group)  # type: ignore[arg-type]
    if kind == "rm":
        return BlockRemoved(hs, tier, group_idx=group)  # type: ignore[arg-type]
    return AllBlocksCleared()


@settings(max_examples=150, deadline=None)
@given(
    stream=st.lists(
        st.tuples(st.sampled_from(WORKERS), st.lists(events(), min_size=1, max_size=6)),
        max_size=25,
    ),
    max_blocks=st.sampled_from([3, 8, 1000]),
    retention=st.sampled_from([0, 2, 1000]),
    bpc=st.sampled_from([2, None]),
)
def test_batches_and_single_events_leave_the_same_index(
    stream: list[tuple[tuple[str, int], list[KVEvent]]],
    max_blocks: int,
    retention: int,
    bpc: int | None,
) -> None:
    def make(keep: bool) -> BlockIndex:
        return BlockIndex(blocks_per_chunk=bpc, max_blocks=max_blocks, keep_token_ids=keep,
                          gpu_metadata_retention=retention, max_pending=3)  # fmt: skip

    fast, slow = make(False), make(True)
    for worker, evs in stream:
        fast.apply(worker[0], worker[1], KVEventBatch(0.0, evs))
        for ev in evs:
            slow.apply_event(worker, ev)
        slow.stats.batches += 1  # apply_event does not count batches
        assert asdict(fast.stats) == asdict(slow.stats)
        assert fast.resident_count == slow.resident_count
        assert fast.pending_count == slow.pending_count
    assert fast.summary() == slow.summary()
    for worker in WORKERS:
        for group in (0, 1):
            for h in [*ALL, 77, 99]:
                info = slow.block_info(worker, group, h)
                want = None if info is None else replace(info, token_ids=None)
                assert fast.block_info(worker, group, h) == want
    for tokens in SEQS:
        for n in (128, 100, 48):
            got = Router(fast).find_matches(tokens[:n])
            assert got == Router(slow).find_matches(tokens[:n])


def test_a_block_stored_again_leaves_the_retirement_order() -> None:
    """GPU metadata is trimmed oldest-retired first: a block that became resident again
    (here through a CPU placeholder) and was retired later is not the oldest any more."""
    h0, a, b, c = HASHES[0][:4]
    for feed in ("batch", "events"):
        index = BlockIndex(blocks_per_chunk=2, gpu_metadata_retention=2)
        evs: list[KVEvent] = [
            BlockStored(HASHES[0][:4], None, SEQS[0][:64], 16, None, "GPU", None, group_idx=0),
            BlockRemoved([a], "GPU", group_idx=0),  # a retired
            BlockStored([a], None, [], 0, None, "CPU", None, group_idx=0),  # a resident again
            BlockRemoved([h0], "GPU", group_idx=0),  # h0 retired
            BlockRemoved([a], "CPU", group_idx=0),  # a retired again, after h0
            BlockRemoved([b], "GPU", group_idx=0),  # b retired: one too many
        ]
        if feed == "batch":
            index.apply("a", 0, KVEventBatch(0.0, evs))
        else:
            for ev in evs:
                index.apply_event(("a", 0), ev)
        kept = {h for h in HASHES[0][:4] if index.block_info(("a", 0), 0, h) is not None}
        assert kept == {a, b, c}, feed
        assert index.stats.metadata_evicted == 1
