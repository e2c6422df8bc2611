"""BlockIndex: the GPU/CPU join (C§5.3, C§8.5, C§8.6) and the orderings of C§2.5.

Events are vLLM-shaped and carry real vLLM wire hashes (sha256_cbor over the tokens), and
most batches travel through real msgspec bytes before they reach the index.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvevents.codec import decode_batch, encode_batch
from kvevents.consumers.index import BlockIndex
from kvevents.consumers.router import Match, Router
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvevents.hashing import hash_request_blocks, to_wire_hash

W = ("tcp://engine-a:5557", 0)
TOKENS = list(range(100, 164))  # C§8.5 scenario A/B tokens 100..163
H = [10428775992902877628, 8101442038445348984, 9222808348315984622, 10472129487708613277]
# vLLM never reuses a prompt's last token (KVCacheManager.get_computed_blocks caps the hit
# at num_tokens - 1, in whole blocks): the 64-token prompt held entirely on GPU reuses 48.
HELD = 48


def wire(tokens: Sequence[int], size: int, algo: str = "sha256_cbor") -> list[int]:
    return [to_wire_hash(d) for d in hash_request_blocks(tokens, size, algo=algo)]


def gpu_store(
    hashes: list[int],
    tokens: Sequence[int],
    size: int,
    *,
    start: int = 0,
    stop: int | None = None,
    group: int = 0,
    kind: str | None = "full_attention",
    lora: str | None = None,
    window: int | None = None,
) -> BlockStored:
    stop = len(hashes) if stop is None else stop
    # vLLM's BlockPool puts the adapter name in every block's extra keys
    # (to_event_extra_keys), besides lora_name
    return BlockStored(
        hashes[start:stop],
        hashes[start - 1] if start else None,
        list(tokens[start * size : stop * size]),
        size,
        None,
        "GPU",
        lora,
        extra_keys=[(lora,)] * (stop - start) if lora is not None else None,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def placeholder(h: int, medium: str = "CPU", group: int = 0) -> BlockStored:
    return BlockStored([h], None, [], 0, None, medium, None, group_idx=group)


def gpu_removed(hashes: list[int], group: int = 0) -> list[KVEvent]:
    return [BlockRemoved([h], "GPU", group_idx=group) for h in hashes]


def feed(index: BlockIndex, *events: KVEvent, worker: tuple[str, int] = W) -> None:
    """Send events through real wire bytes, as a subscriber would deliver them."""
    batch = decode_batch(encode_batch(KVEventBatch(1.0, list(events), worker[1])))
    index.apply(worker[0], worker[1], batch)


def test_scenario_a_hashes_are_the_contract_vectors() -> None:
    assert wire(TOKENS, 16) == H


def test_scenario_a_placeholders_join_and_give_whole_chunks() -> None:
    index = BlockIndex(keep_token_ids=True)
    router = Router(index)
    feed(index, gpu_store(H, TOKENS, 16), placeholder(H[1]), placeholder(H[3]))
    assert index.stats.joined == 2 and index.stats.pending == 0
    assert index.blocks_per_chunk(W) == 2  # learned: tails at blocks 2 and 4
    assert router.find_matches(TOKENS) == {W: Match(HELD, 0, 0)}
    feed(index, *gpu_removed(H))
    # each chunk is exactly blocks_per_chunk x block_size = 32 tokens
    assert router.find_matches(TOKENS) == {W: Match(0, 64, 0)}
    assert router.find_matches(TOKENS[:63]) == {W: Match(0, 32, 0)}
    info = index.block_info(W, 0, H[3])
    assert info is not None and info.block_size == 16 and info.tiers == {"CPU"}
    assert info.chunk is not None
    assert info.chunk.hashes == (H[2], H[3]) and (info.chunk.start, info.chunk.end) == (32, 64)
    assert info.chunk.tokens == 32
    chunk_tokens = [t for h in info.chunk.hashes for t in index.block_info(W, 0, h).token_ids]  # type: ignore[union-attr]
    assert chunk_tokens == list(range(132, 164))
    # removal of both tails, as the tracker sends it: one BlockRemoved per group
    feed(index, BlockRemoved([H[1], H[3]], "CPU", group_idx=0))
    assert router.find_matches(TOKENS) == {}
    assert index.stats.unknown_removals.total() == 0


def test_cpu_credit_counts_from_the_chunk_holding_the_gpu_end() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index)
    feed(index, gpu_store(H, TOKENS, 16), placeholder(H[1]), placeholder(H[3]))
    feed(index, *gpu_removed(H[1:]))
    # GPU holds block 0 (16 tokens); chunks 0 and 1 on CPU end at 64: adds 48
    assert router.find_matches(TOKENS) == {W: Match(16, 48, 0)}
    # with only chunk 0 on CPU the CPU would add 16 tokens, less than one chunk: 0
    feed(index, BlockRemoved([H[3]], "CPU", group_idx=0))
    assert router.find_matches(TOKENS) == {W: Match(16, 0, 0)}


def test_scenario_a_self_describing_needs_no_gpu_events() -> None:
    index = BlockIndex(keep_token_ids=True)
    router = Router(index)
    sd = [
        BlockStored(H[:2], None, TOKENS[:32], 16, None, "CPU", None, group_idx=0,
                    kv_cache_spec_kind="full_attention"),
        BlockStored(H[2:], H[1], TOKENS[32:], 16, None, "CPU", None, group_idx=0,
                    kv_cache_spec_kind="full_attention"),
    ]  # fmt: skip
    feed(index, *sd)
    assert index.stats.self_describing == 2 and index.stats.pending == 0
    assert router.find_matches(TOKENS) == {W: Match(0, 64, 0)}
    info = index.block_info(W, 0, H[2])
    assert info is not None and info.token_ids == tuple(range(132, 148))
    # fan-out removal of every constituent hash (C§5.8): tails drop, the rest is harmless
    feed(index, BlockRemoved(H, "CPU", group_idx=0))
    assert router.find_matches(TOKENS) == {}
    assert index.stats.unknown_removals.total() == 0
    assert index.stats.skipped["removed_non_tail"] == 2


def test_scenario_b_hybrid_groups_join_in_one_batch() -> None:
    raw = wire(TOKENS, 4)  # r0..r15 at tokens_per_hash = 4
    g0 = raw[3::4]  # full attention, block size 16
    g1 = raw[1::2]  # sliding window, block size 8
    index = BlockIndex(canonical_block_size=4, keep_token_ids=True)
    router = Router(index)
    feed(
        index,
        gpu_store(g0, TOKENS, 16, group=0),
        gpu_store(g1, TOKENS, 8, group=1, kind="sliding_window", window=16),
        # the tracker's stored event [g0c0, g0c1, g1c0, g1c1] (C§8.5 B, g0 as placeholders)
        placeholder(raw[3], group=0),
        placeholder(raw[7], group=0),
        placeholder(raw[1], group=1),
        placeholder(raw[3], group=1),
    )
    assert index.stats.joined == 4
    # r3 keys both groups: each join recovers its own group's block
    b0 = index.block_info(W, 0, raw[3])
    b1 = index.block_info(W, 1, raw[3])
    assert b0 is not None and b1 is not None
    assert (b0.block_size, b0.token_ids) == (16, tuple(range(100, 116)))
    assert (b1.block_size, b1.token_ids) == (8, tuple(range(108, 116)))
    assert b1.kind == "sliding_window" and not b1.indexed and b0.indexed
    # HybridKVCacheCoordinator: the full group reuses 48 of the 63 reusable tokens
    # (aligned to lcm(16, 8)); the sliding-window group holds the two 8-token blocks its
    # window of 16 needs before token 48, so the hit stays 48
    assert router.find_matches(TOKENS) == {W: Match(48, 0, 0)}
    feed(index, *gpu_removed(g0, 0), *gpu_removed(g1, 1))
    # _lookup_complete_chunks (bpc learned = 1): the full group's chunks end at 32, then
    # the sliding-window group's last run of cdiv(16, 8) = 2 chunks ends at 16
    assert router.find_matches(TOKENS) == {W: Match(0, 16, 0)}
    feed(index, BlockRemoved([raw[3], raw[7]], "CPU", group_idx=0))
    feed(index, BlockRemoved([raw[1], raw[3]], "CPU", group_idx=1))
    assert router.find_matches(TOKENS) == {}
    assert index.stats.unknown_removals.total() == 0


def test_hybrid_full_attention_groups_with_different_block_sizes_take_the_minimum() -> None:
    raw = wire(TOKENS, 16)
    g1 = raw[1::2]  # a coarser 32-token group keys the raw hash at its last boundary
    index = BlockIndex(blocks_per_chunk=1)
    router = Router(index)
    feed(index, gpu_store(raw, TOKENS, 16, stop=3, group=0),
         gpu_store(g1, TOKENS, 32, group=1))  # fmt: skip
    assert router.find_matches(TOKENS) == {
        W: Match(32, 0, 0)
    }  # min(48, 64), in whole blocks of both groups
    # CPU chunks in both groups (bpc = 1): 48..64 in group 0, 32..64 in group 1
    feed(index, placeholder(raw[3], group=0))  # pending: group 0 never stored raw[3]
    assert index.pending_count == 1
    feed(index, gpu_store(raw, TOKENS, 16, start=3, group=0))
    assert index.stats.joined_late == 1
    feed(index, placeholder(g1[1], group=1), *gpu_removed(raw[3:], 0), *gpu_removed(g1[1:], 1))
    # GPU 32 (group 1 holds one 32-token block); CPU: group 1 chunk 1 ends at 64,
    # group 0 would need chunk 2 (32..48) which is not on CPU: no CPU credit
    assert router.find_matches(TOKENS) == {W: Match(32, 0, 0)}
    feed(index, placeholder(raw[2], group=0))
    assert router.find_matches(TOKENS) == {W: Match(32, 32, 0)}


def test_end_to_end_chunks_of_blocks_per_chunk_times_block_size() -> None:
    bpc, size = 4, 16
    tokens = list(range(1000, 1256))  # 16 blocks, 4 chunks
    hs = wire(tokens, size)
    index = BlockIndex(keep_token_ids=True)  # bpc learned from where tails fall
    router = Router(index)
    feed(index, gpu_store(hs, tokens, size))
    feed(index, *[placeholder(hs[(c + 1) * bpc - 1]) for c in range(4)])
    assert index.blocks_per_chunk(W) == bpc
    feed(index, *gpu_removed(hs))
    for c in range(4):
        info = index.block_info(W, 0, hs[(c + 1) * bpc - 1])
        assert info is not None and info.chunk is not None
        assert info.chunk.tokens == bpc * size
        assert info.chunk.hashes == tuple(hs[c * bpc : (c + 1) * bpc])
        got = [t for h in info.chunk.hashes for t in index.block_info(W, 0, h).token_ids]  # type: ignore[union-attr]
        assert got == tokens[c * bpc * size : (c + 1) * bpc * size]
    for n in (63, 64, 100, 128, 255, 256, 300):
        expect = (min(n, 256) // 64) * 64
        assert router.find_matches(tokens[:n] + [7] * max(0, n - 256)).get(W, Match()) == Match(
            0, expect, 0
        )
    # a STORAGE copy of the first two chunks comes after the CPU ones
    feed(index, BlockRemoved([hs[11], hs[15]], "CPU", group_idx=0))
    feed(index, placeholder(hs[7], "STORAGE"), placeholder(hs[11], "STORAGE"))
    assert router.find_matches(tokens) == {W: Match(0, 128, 64)}


# --- orderings of C§2.5 ---------------------------------------------------------------


def test_cpu_store_after_gpu_removal_in_the_same_and_a_later_batch() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index)
    feed(index, gpu_store(H, TOKENS, 16), *gpu_removed(H[:2]), placeholder(H[1]))
    feed(index, *gpu_removed(H[2:]))
    feed(index, placeholder(H[3]))
    assert index.stats.joined == 2 and index.stats.unjoined.total() == 0
    assert router.find_matches(TOKENS) == {W: Match(0, 64, 0)}


def test_cpu_store_before_gpu_store_waits_then_joins() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index)
    feed(index, placeholder(H[1]), placeholder(H[1], "STORAGE"))
    assert index.pending_count == 1 and index.stats.pending == 2
    assert router.find_matches(TOKENS) == {}
    feed(index, gpu_store(H, TOKENS, 16, stop=2))
    assert index.pending_count == 0 and index.stats.joined_late == 2
    feed(index, *gpu_removed(H[:2]))
    assert router.find_matches(TOKENS) == {W: Match(0, 32, 0)}
    feed(index, BlockRemoved([H[1]], "CPU", group_idx=0))
    assert router.find_matches(TOKENS) == {W: Match(0, 0, 32)}


def test_never_joined_stores_are_counted_not_guessed() -> None:
    index = BlockIndex(blocks_per_chunk=1, max_pending=2)
    feed(index, placeholder(11), placeholder(12), placeholder(13))
    assert index.stats.unjoined["pending_overflow"] == 1 and index.pending_count == 2
    feed(index, BlockRemoved([12], "CPU", group_idx=0))
    assert index.stats.unjoined["removed_while_pending"] == 1
    feed(index, AllBlocksCleared())
    assert index.stats.unjoined["cleared_while_pending"] == 1 and index.pending_count == 0
    assert Router(index).find_matches(TOKENS) == {}


def test_duplicate_stores_are_refcounted_per_tier() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index)
    feed(index, gpu_store(H, TOKENS, 16), gpu_store(H, TOKENS, 16, stop=2))
    feed(index, *gpu_removed(H))
    assert router.find_matches(TOKENS) == {W: Match(32, 0, 0)}
    feed(index, *gpu_removed(H[:2]))
    assert router.find_matches(TOKENS) == {}
    feed(index, placeholder(H[1]), placeholder(H[1]))
    feed(index, BlockRemoved([H[1]], "CPU", group_idx=0))
    assert router.find_matches(TOKENS) == {W: Match(0, 32, 0)}
    feed(index, BlockRemoved([H[1]], "CPU", group_idx=0))
    assert router.find_matches(TOKENS) == {}


def test_removals_of_unknown_hashes_are_counted_and_harmless() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index)
    feed(index, gpu_store(H, TOKENS, 16))
    feed(index, BlockRemoved([123], "GPU", group_idx=0), BlockRemoved([456], "CPU", group_idx=0),
         BlockRemoved([H[0]], "GPU", group_idx=7))  # fmt: skip
    assert index.stats.unknown_removals == {"GPU": 2, "CPU": 1}
    assert router.find_matches(TOKENS) == {W: Match(HELD, 0, 0)}


def test_all_blocks_cleared_drops_every_tier_but_keeps_join_metadata() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index)
    feed(index, gpu_store(H, TOKENS, 16), placeholder(H[1]), placeholder(H[3], "STORAGE"))
    feed(index, AllBlocksCleared())
    assert router.find_matches(TOKENS) == {} and index.resident_count == 0
    # an offload that completes after the clear still joins
    feed(index, placeholder(H[1]))
    assert index.stats.pending == 0
    assert router.find_matches(TOKENS) == {W: Match(0, 32, 0)}


def test_reset_worker_forgets_metadata_and_remove_worker_frees_it() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index)
    other = ("tcp://engine-b:5557", 1)
    feed(index, gpu_store(H, TOKENS, 16))
    feed(index, gpu_store(H, TOKENS, 16, stop=1), worker=other)
    index.reset_worker(W)
    assert router.find_matches(TOKENS) == {other: Match(16, 0, 0)}
    feed(index, placeholder(H[1]))
    assert index.pending_count == 1  # no metadata survived the reset
    index.remove_worker(other)
    assert index.workers() == [W] and router.find_matches(TOKENS) == {}
    feed(index, gpu_store(H, TOKENS, 16))  # joins the pending placeholder
    assert router.find_matches(TOKENS) == {W: Match(HELD, 0, 0)}
    assert index.stats.joined_late == 1


def test_metadata_retention_is_bounded_and_counted() -> None:
    index = BlockIndex(blocks_per_chunk=2, gpu_metadata_retention=2, max_pending=10)
    feed(index, gpu_store(H, TOKENS, 16), *gpu_removed(H))
    assert index.stats.metadata_evicted == 2
    feed(index, placeholder(H[1]), placeholder(H[3]))
    assert index.stats.joined == 1 and index.pending_count == 1  # H[1] was forgotten


def test_max_blocks_cap_evicts_and_never_over_credits() -> None:
    index = BlockIndex(max_blocks=8, blocks_per_chunk=1)
    router = Router(index)
    seqs = [[s * 1000 + t for t in range(64)] for s in range(3)]
    for s in seqs:
        feed(index, gpu_store(wire(s, 16), s, 16))
    assert index.resident_count <= 8 and index.stats.evicted_by_cap >= 4
    for s in seqs:
        m = router.find_matches(s).get(W, Match())
        held = sum(1 for h in wire(s, 16) if "GPU" in _tiers(index, h))
        assert m.gpu <= held * 16


def _tiers(index: BlockIndex, h: int) -> frozenset[str]:
    info = index.block_info(W, 0, h)
    return info.tiers if info is not None else frozenset()


def test_legacy_bytes_hash_cpu_events_without_group() -> None:
    digests = hash_request_blocks(TOKENS, 16, algo="sha256_cbor")
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index)
    feed(index, gpu_store(H, TOKENS, 16), *gpu_removed(H))
    # vLLM 0.20-0.23: raw digest bytes, block_size 0, no group_idx, one event for all keys
    feed(index, BlockStored([digests[1], digests[3], b"\x00" * 32], None, [], 0, None, "CPU", None))
    assert index.stats.joined == 2 and index.stats.unjoined["legacy_unknown_hash"] == 1
    assert router.find_matches(TOKENS) == {W: Match(0, 64, 0)}
    feed(index, BlockRemoved([digests[3]], "CPU"))
    assert router.find_matches(TOKENS) == {W: Match(0, 32, 0)}


def test_engines_with_different_block_sizes_and_hash_algorithms_share_one_index() -> None:
    a, b = ("a", 0), ("b", 0)
    index = BlockIndex()
    router = Router(index)
    feed(index, gpu_store(wire(TOKENS, 16), TOKENS, 16), worker=a)
    feed(index, gpu_store(wire(TOKENS, 32, "sha256"), TOKENS, 32), worker=b)
    # the last token is recomputed: 63 reusable tokens are 3 blocks of 16 or 1 of 32
    assert router.find_matches(TOKENS) == {a: Match(48, 0, 0), b: Match(32, 0, 0)}
    assert router.find_matches(TOKENS[:49]) == {a: Match(48, 0, 0), b: Match(32, 0, 0)}
    assert router.find_matches(TOKENS[:48]) == {a: Match(32, 0, 0), b: Match(32, 0, 0)}
    assert router.find_matches([*TOKENS[:16], 9, *TOKENS[17:]]) == {a: Match(16, 0, 0)}


def test_lora_and_extra_keys_separate_content() -> None:
    index = BlockIndex()
    router = Router(index)
    feed(index, gpu_store(H, TOKENS, 16, lora="adapter-x"))
    assert router.find_matches(TOKENS) == {}
    assert router.find_matches(TOKENS, lora_name="adapter-x") == {W: Match(HELD, 0, 0)}
    assert router.find_matches(TOKENS, lora_name="adapter-y") == {}
    salted = BlockStored(H[:1], None, TOKENS[:16], 16, None, "GPU", None,
                         extra_keys=[("salt",)], group_idx=0)  # fmt: skip
    index2 = BlockIndex()
    feed(index2, salted)
    assert Router(index2).find_matches(TOKENS) == {}
    info = index2.block_info(W, 0, H[0])
    assert info is not None and info.extra_keys == ("salt",)


def test_kindless_groups_are_indexable_only_when_alone() -> None:
    index = BlockIndex()
    router = Router(index)
    feed(index, gpu_store(H, TOKENS, 16, kind=None))
    assert router.find_matches(TOKENS) == {W: Match(HELD, 0, 0)}
    feed(index, gpu_store(H, TOKENS, 16, kind=None, group=1))
    assert router.find_matches(TOKENS) == {}


def test_unmatchable_block_sizes_and_unknown_parents_are_skipped_with_reasons() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index)
    h8 = wire(TOKENS, 8)
    feed(index, gpu_store(h8, TOKENS, 8), placeholder(h8[3]))
    assert index.stats.skipped["block_size_not_multiple_of_canonical"] == 8
    assert index.stats.joined == 1 and router.find_matches(TOKENS) == {}
    other = ("o", 0)
    feed(index, gpu_store(H, TOKENS, 16, start=2), worker=other)  # its parent was never seen
    assert index.stats.skipped["unknown_parent"] == 2
    assert router.find_matches(TOKENS) == {}
    # the prefix arrives later: re-announcing the blocks heals them
    feed(index, gpu_store(H, TOKENS, 16), worker=other)
    assert router.find_matches(TOKENS) == {other: Match(HELD, 0, 0)}


def test_unknown_medium_is_skipped_and_summary_reports_tiers() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    feed(index, gpu_store(H, TOKENS, 16), placeholder(H[1]), placeholder(H[3], "TAPE"))
    assert index.stats.skipped["unknown_medium"] == 1
    s = index.summary()[W]
    assert s.tiers["GPU"].entries == 4 and s.tiers["GPU"].tokens == 64
    assert s.tiers["CPU"].entries == 1 and s.tiers["CPU"].tokens == 32
    assert s.blocks_per_chunk == 2


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_configuration_is_rejected(bad: int) -> None:
    from kvevents.errors import ConfigError

    with pytest.raises(ConfigError):
        BlockIndex(canonical_block_size=bad)
    with pytest.raises(ConfigError):
        BlockIndex(blocks_per_chunk=bad)


def test_blocks_per_chunk_configured_per_engine() -> None:
    a, b = ("tcp://a:1", 0), ("tcp://b:1", 3)
    index = BlockIndex(blocks_per_chunk={"tcp://a:1": 2, b: 1, "*": 4})
    assert index.blocks_per_chunk(a) == 2 and index.blocks_per_chunk(b) == 1
    assert index.blocks_per_chunk(("other", 0)) == 4
    router = Router(index)
    for w in (a, b):
        feed(index, gpu_store(H, TOKENS, 16), placeholder(H[1]), *gpu_removed(H), worker=w)
    # the same tail is a 2-block chunk on a, a 1-block chunk (block 1 only) on b
    assert router.find_matches(TOKENS) == {a: Match(0, 32, 0)}
    feed(index, placeholder(H[0]), worker=b)
    assert router.find_matches(TOKENS) == {a: Match(0, 32, 0), b: Match(0, 32, 0)}


def test_self_describing_partial_tail_joins_its_last_hash() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    feed(index, gpu_store(H, TOKENS, 16))
    raw4 = wire(TOKENS[:32], 4)
    # a partial tail at tokens_per_hash = 4 granularity whose last raw hash is not a GPU block
    feed(index, BlockStored(raw4[4:6], raw4[3], TOKENS[16:24], 4, None, "CPU", None, group_idx=0))
    assert index.stats.skipped["self_describing_partial"] == 1
    assert index.pending_count == 1  # waits for a GPU store of that hash; never guessed
    assert Router(index).find_matches(TOKENS) == {W: Match(HELD, 0, 0)}


def test_legacy_hash_keying_two_groups_goes_to_each_group_once() -> None:
    digests = hash_request_blocks(TOKENS, 16, algo="sha256_cbor")
    index = BlockIndex(blocks_per_chunk=1)
    feed(index, gpu_store(H, TOKENS, 16, group=0), gpu_store(H[1::2], TOKENS, 32, group=1))
    feed(index, *gpu_removed(H, 0), *gpu_removed(H[1::2], 1))
    # H[1] keys both groups (a 32-token boundary is also a 16-token one, C§5.3)
    feed(index, BlockStored([digests[1], digests[1], digests[0]], None, [], 0, None, "CPU", None))
    assert index.stats.joined == 3
    for g, h in ((0, H[1]), (1, H[1]), (0, H[0])):
        info = index.block_info(W, g, h)
        assert info is not None and info.tiers == {"CPU"}
    assert Router(index).find_matches(TOKENS) == {W: Match(0, 32, 0)}


def test_malformed_stores_are_counted_and_lose_nothing_else() -> None:
    index = BlockIndex()
    feed(
        index,
        BlockStored([1], None, [1, 2], 16, None, "GPU", None, group_idx=0),  # too few tokens
        BlockStored([2], None, [], -1, None, "GPU", None, group_idx=0),  # bad size
        gpu_store(H, TOKENS, 16),
    )
    assert index.stats.skipped["short_token_ids"] == 1
    assert index.stats.skipped["bad_block_size"] == 1
    assert Router(index).find_matches(TOKENS) == {W: Match(HELD, 0, 0)}
    assert index.stats.applied == 3 and index.stats.batches == 1


def test_hybrid_cpu_credit_checks_each_group_against_its_own_chunk() -> None:
    raw = wire(TOKENS, 16)
    g1 = raw[1::2]
    index = BlockIndex(blocks_per_chunk=2)  # chunks of 32 tokens (group 0) and 64 (group 1)
    feed(index, gpu_store(raw, TOKENS, 16, group=0), gpu_store(g1, TOKENS, 32, group=1))
    feed(index, placeholder(raw[1], group=0), placeholder(g1[1], group=1))
    feed(index, *gpu_removed(raw, 0), *gpu_removed(g1, 1))
    # _lookup_complete_chunks: group 0's chunks bound the hit at 32 tokens, which leaves
    # less than one of group 1's 64-token chunks: nothing is loaded
    assert Router(index).find_matches(TOKENS) == {}
    # a longer prompt: both groups hold chunk 0 on CPU, and group 0 also its chunk 1
    longer = TOKENS + list(range(164, 228))
    feed(index, placeholder(raw[3], group=0))
    assert Router(index).find_matches(longer) == {W: Match(0, 64, 0)}
    feed(index, BlockRemoved([g1[1]], "CPU", group_idx=1))
    assert Router(index).find_matches(longer) == {}


@pytest.mark.parametrize(
    ("medium", "want"),
    [("CPU_PINNED", Match(0, 64, 0)), ("FS", Match(0, 0, 64)), ("DISK", Match(0, 0, 64))],
)
def test_other_producers_tier_names_map_to_cpu_and_storage(medium: str, want: Match) -> None:
    """vLLM 0.26's FS/OBJ and other producers' host/storage media are offload tiers too."""
    index = BlockIndex()
    feed(index, gpu_store(H, TOKENS, 16), placeholder(H[1], medium), placeholder(H[3], medium))
    feed(index, *gpu_removed(H))
    assert Router(index).find_matches(TOKENS) == {W: want}
    assert index.stats.skipped["unknown_medium"] == 0
    feed(index, BlockRemoved([H[1], H[3]], medium, group_idx=0))
    assert Router(index).find_matches(TOKENS) == {}


def test_cap_eviction_while_joining_a_pending_store_does_not_raise() -> None:
    """Regression (found by the fast-path property test): with a tiny ``max_blocks``, the
    GPU store that joins a pending CPU placeholder can see its own entry dropped by the
    cap mid-apply; apply must go on, not raise KeyError."""
    toks = list(range(1, 33))

    def store(hashes: list[int], group: int) -> BlockStored:
        return BlockStored(hashes, 99, toks[: 16 * len(hashes)], 16, None, "GPU", None,
                           group_idx=group, kv_cache_spec_kind="full_attention")  # fmt: skip

    def rm(h: int) -> BlockRemoved:
        return BlockRemoved([h], "GPU", group_idx=0)

    index = BlockIndex(blocks_per_chunk=2, max_blocks=3, gpu_metadata_retention=0, max_pending=3)
    b, a = ("b", 0), ("a", 0)
    stream = [
        (b, [store([1000], 1), rm(1000), store([1000], 0), store([1000], 0), store([1000], 0), store([1000], 0)]),
        (a, [rm(1002)]),
        (a, [rm(1000), store([1000], 0), store([1000], 0), store([1000], 0), store([1000], 0), store([1000], 1)]),
        (b, [rm(1000), store([1000], 0), BlockStored([1001], None, [], 0, None, "CPU", None, group_idx=1),
             store([1000], 0), store([1000], 0), store([1000, 1001], 1)]),
    ]  # fmt: skip
    for worker, evs in stream:
        index.apply(worker[0], worker[1], KVEventBatch(0.0, evs))
    assert index.resident_count <= 3
    assert index.stats.evicted_by_cap > 0
