"""The index's state, byte for byte: fixed streams leave fixed snapshot bytes.

A snapshot is the index's whole state, so its bytes pin everything the index keeps:
records, refcounts, counted marks, the pending table, retained metadata, the memory
cap's children counts, deferred entries and eviction queue, learned settings and every
counter.  Each case below feeds a fixed, seeded stream (every event shape: GPU stores
with and without LoRA names, extra keys and lookahead ids, partial tails, sliding-window
and non-indexable groups, placeholders before and after their GPU store,
self-describing chunks, legacy bytes hashes, removals of known and unknown hashes,
clears, resets and removed workers) into an index with a small cap, and compares the
SHA-256 of the snapshot's state and schema (the header's kvevents version left out)
with the value recorded before the index's code was restructured.  A change to any rule
of the index changes these digests; a change that only moves code must not.
"""

from __future__ import annotations

import hashlib
import random

import msgspec
import pytest

from kvevents.consumers import BlockIndex
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch

BS = 16
NSEQ = 6
NBLK = 10
WORKERS = [("a", 0), ("a", 1), ("b", 0)]


def _tokens(seq: int) -> list[int]:
    """Sequence ``seq``'s tokens: pairs of sequences share their first four blocks."""
    shared = list(range(1 + 1000 * (seq // 2), 1 + 1000 * (seq // 2) + 4 * BS))
    return shared + list(range(50_000 + 997 * seq, 50_000 + 997 * seq + (NBLK - 4) * BS))


TOKENS = [_tokens(s) for s in range(NSEQ)]
HASHES = [[10_000 * (s + 1) + i for i in range(NBLK)] for s in range(NSEQ)]
ALL = [h for hs in HASHES for h in hs]


def _gpu_store(rng: random.Random) -> BlockStored:
    seq = rng.randrange(NSEQ)
    start = rng.randrange(NBLK)
    stop = rng.randrange(start + 1, NBLK + 1)
    hashes = HASHES[seq][start:stop]
    parent: int | None = HASHES[seq][start - 1] if start else None
    if rng.random() < 0.1:
        parent = 77  # an orphan
    toks = TOKENS[seq][start * BS : stop * BS]
    lora = extra = la = None
    shape = rng.random()
    if shape < 0.12:
        lora = "ad"
        extra = [("ad",)] * len(hashes)
    elif shape < 0.2:
        extra = [None] * len(hashes)
        extra[0] = (("img", 0),)
    elif shape < 0.26:
        la = [[TOKENS[seq][(i + 1) * BS % len(TOKENS[seq])]] for i in range(start, stop)]
    size = BS
    if rng.random() < 0.05:
        size = BS // 2  # a partial tail at finer granularity
        toks = toks[: len(hashes) * size]
    return BlockStored(hashes, parent, toks, size, None, rng.choice(["GPU", "GPU", None]),
                       lora, extra, group_idx=rng.choice([0, 0, 0, 1]),
                       kv_cache_spec_kind=rng.choice(["full_attention", None, None]),
                       lookahead_token_ids=la)  # fmt: skip


def _event(rng: random.Random) -> KVEvent:
    r = rng.random()
    if r < 0.35:
        return _gpu_store(rng)
    if r < 0.6:
        hs = rng.sample([*ALL, 55], rng.choice([1, 1, 1, 2]))
        return BlockRemoved(hs, rng.choice(["GPU", None]), group_idx=rng.choice([0, 0, 1, None]))
    tier = rng.choice(["CPU", "STORAGE"])
    group = rng.choice([0, 0, 1])
    if r < 0.78:
        hs = rng.sample([*ALL[1::2], 55], rng.choice([1, 1, 2]))
        return BlockStored(hs, None, [], 0, None, tier, None, group_idx=group)
    if r < 0.83:  # a self-describing chunk of two blocks
        seq = rng.randrange(NSEQ)
        i = 2 * rng.randrange(NBLK // 2)
        parent = HASHES[seq][i - 1] if i else None
        return BlockStored(HASHES[seq][i : i + 2], parent, TOKENS[seq][i * BS : (i + 2) * BS],
                           BS, None, tier, None, group_idx=group)  # fmt: skip
    if r < 0.85:  # vLLM <= 0.23: bytes hashes, no group
        h = rng.choice(ALL).to_bytes(8, "big")
        if rng.random() < 0.5:
            return BlockStored([h], None, [], 0, None, tier, None)
        return BlockRemoved([h], tier)
    if r < 0.98:
        hs = rng.sample([*ALL[1::2], 55], rng.choice([1, 1, 2]))
        return BlockRemoved(hs, tier, group_idx=group)
    return AllBlocksCleared()


def _feed(index: BlockIndex, seed: int, batches: int) -> None:
    rng = random.Random(seed)
    for _ in range(batches):
        r = rng.random()
        worker = rng.choice(WORKERS)
        if r < 0.01:
            index.reset_worker(worker)
        elif r < 0.015:
            index.remove_worker(worker)
        else:
            events = [_event(rng) for _ in range(rng.randrange(1, 6))]
            index.apply(worker[0], worker[1], KVEventBatch(0.0, events))


def _digest(index: BlockIndex) -> str:
    header, state = msgspec.msgpack.decode(index.snapshot(), type=tuple[dict, msgspec.Raw])
    h = hashlib.sha256(bytes(state))
    h.update(msgspec.msgpack.encode([header["format"], header["schema"]]))
    return h.hexdigest()[:24]


CASES = {
    "random, cap 40": (dict(max_blocks=40, gpu_metadata_retention=30, max_pending=5), 1, 400),
    "random, cap 12, bpc 2": (
        dict(max_blocks=12, gpu_metadata_retention=8, max_pending=3, blocks_per_chunk=2),
        2,
        400,
    ),
    "random, token ids kept": (
        dict(max_blocks=25, gpu_metadata_retention=10, keep_token_ids=True, lookahead_tokens=1),
        3,
        300,
    ),
    "random, no cap pressure": (dict(max_pending=4), 4, 300),
    "random, eagle, retention 0": (
        dict(max_blocks=30, gpu_metadata_retention=0, blocks_per_chunk=2, eagle_drop=True),
        5,
        400,
    ),
}
PINNED = {
    "random, cap 40": "cf63040bc46e8002c7218f10",
    "random, cap 12, bpc 2": "e5290eec9d740eb011273ded",
    "random, token ids kept": "77568c9ab30639685443632d",
    "random, no cap pressure": "65d5801d6c9f279807ac7eba",
    "random, eagle, retention 0": "36d7c50309c90fd72a7fb5c2",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_fixed_random_stream_leaves_fixed_snapshot_bytes(case: str) -> None:
    kwargs, seed, batches = CASES[case]
    index = BlockIndex(**kwargs)  # type: ignore[arg-type]
    _feed(index, seed, batches)
    assert len(index) > 0
    assert _digest(index) == PINNED[case]
