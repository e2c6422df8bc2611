"""The router's Match is what vLLM 0.33 would reuse, rule by rule.

Events are built the way vLLM's ``BlockPool.cache_full_blocks`` emits them: engine hashes
chained over the hash-side extra keys and lookahead tokens, per-block event-side
``extra_keys`` (``to_event_extra_keys``: LoRA name on every block, ``(identifier,
offset)`` for every multimodal input a block overlaps, the salt on the block at token 0,
the prompt-embeds digest), ``lookahead_token_ids`` with lookahead hashing, the group's
kind and window.  Every expectation is worked out by hand from the vLLM function named
beside it.
"""

from __future__ import annotations

import hashlib

import pytest

from kvevents import MMFeature, RequestKey
from kvevents.codec import decode_batch, encode_batch
from kvevents.consumers.index import BlockIndex
from kvevents.consumers.router import Match, Router
from kvevents.errors import ConfigError
from kvevents.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvevents.hashing import hash_block_tokens, to_wire_hash
from kvevents.request import block_extra_keys

W = ("engine", 0)


def engine_hashes(key: RequestKey, unit: int, lookahead: int = 0, path: str = "/p") -> list[int]:
    """vLLM's request block hashes at ``unit`` tokens (get_request_block_hasher): each
    block chains on its parent and mixes in its extra keys (the LoRA path too, which the
    event does not carry) and, with lookahead hashing, the next ``lookahead`` tokens; a
    block is hashed only once those tokens exist."""
    toks = list(key.tokens)
    out: list[int] = []
    parent: bytes | None = None
    for i in range((len(toks) - lookahead) // unit):
        s, e = i * unit, (i + 1) * unit
        extra = block_extra_keys(key, s, e)
        if key.lora_name is not None:
            extra = (path, *(extra or ()))
        if lookahead:
            extra = (*(extra or ()), *toks[e : e + lookahead])
        parent = hash_block_tokens(parent, toks[s:e], extra)
        out.append(to_wire_hash(parent))
    return out


def stored(
    key: RequestKey,
    size: int,
    *,
    group: int = 0,
    kind: str = "full_attention",
    window: int | None = None,
    unit: int = 16,
    lookahead: int = 0,
    start: int = 0,
    stop: int | None = None,
    path: str = "/p",
) -> BlockStored:
    """The BlockStored of blocks ``[start, stop)`` of a ``size``-token group."""
    raw = engine_hashes(key, unit, lookahead, path)
    hs = raw[size // unit - 1 :: size // unit]
    stop = len(hs) if stop is None else stop
    blocks = range(start, stop)
    extras = [block_extra_keys(key, i * size, (i + 1) * size) for i in blocks]
    la = [list(key.tokens[(i + 1) * size : (i + 1) * size + lookahead]) for i in blocks]
    return BlockStored(
        hs[start:stop],
        hs[start - 1] if start else None,
        list(key.tokens[start * size : stop * size]),
        size,
        1 if key.lora_name else None,
        "GPU",
        key.lora_name,
        extra_keys=extras if any(e is not None for e in extras) else None,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
        lookahead_token_ids=la if lookahead else None,
    )


def group_hashes(key: RequestKey, size: int, unit: int = 16, lookahead: int = 0) -> list[int]:
    raw = engine_hashes(key, unit, lookahead)
    return raw[size // unit - 1 :: size // unit]


def feed(index: BlockIndex, *events: KVEvent, worker: tuple[str, int] = W) -> None:
    """Through real wire bytes, as a subscriber delivers them."""
    batch = decode_batch(encode_batch(KVEventBatch(1.0, list(events), worker[1])))
    index.apply(worker[0], worker[1], batch)


def toks(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


# --------------------------------------------------------------------- the last token


def test_the_last_prompt_token_is_never_reused() -> None:
    # KVCacheManager.get_computed_blocks: max_cache_hit_length = num_tokens - 1, and
    # FullAttentionManager counts whole blocks below it
    index = BlockIndex()
    router = Router(index)
    feed(index, stored(RequestKey(toks(80)), 16))
    assert router.find_matches(toks(64)) == {W: Match(48, 0, 0)}
    assert router.find_matches(toks(65)) == {W: Match(64, 0, 0)}
    assert router.find_matches(toks(16)) == {}  # 15 reusable tokens: no whole block
    assert router.find_matches(toks(17)) == {W: Match(16, 0, 0)}


# --------------------------------------------------------------------- request keys


def test_lora_blocks_match_only_lora_requests_of_that_adapter() -> None:
    lora = RequestKey(toks(80), lora_name="my-lora")
    index = BlockIndex()
    router = Router(index)
    ev = stored(lora, 16)
    assert ev.extra_keys == [("my-lora",)] * 5  # to_event_extra_keys: name on every block
    feed(index, ev)
    assert router.find_matches(toks(65), lora_name="my-lora") == {W: Match(64, 0, 0)}
    assert router.find_matches(RequestKey(toks(65), lora_name="my-lora")) == {W: Match(64, 0, 0)}
    assert router.find_matches(toks(65)) == {}
    assert router.find_matches(toks(65), lora_name="other") == {}
    assert router.select(toks(65), {("idle", 0): 0.0}, lora_name="my-lora") == W


def test_a_salted_copy_of_an_unsalted_prompt_gets_nothing() -> None:
    # generate_block_hash_extra_keys: the salt keys the block at token 0, and every later
    # block chains on it
    index = BlockIndex()
    router = Router(index)
    feed(index, stored(RequestKey(toks(80)), 16))
    assert router.find_matches(toks(65), cache_salt="s") == {}
    salted = BlockIndex()
    ev = stored(RequestKey(toks(80), cache_salt="s"), 16)
    assert ev.extra_keys is not None and ev.extra_keys[:2] == [("s",), None]
    feed(salted, ev)
    r2 = Router(salted)
    assert r2.find_matches(toks(65)) == {}
    assert r2.find_matches(toks(65), cache_salt="t") == {}
    assert r2.find_matches(toks(65), cache_salt="s") == {W: Match(64, 0, 0)}


def test_multimodal_inputs_key_the_blocks_they_overlap() -> None:
    # _gen_mm_extra_hash_keys: (identifier, offset - block start) for every block an input
    # overlaps; an image on tokens [20, 40)
    img = [MMFeature("img-a", 20, 20)]
    index = BlockIndex()
    router = Router(index)
    ev16 = stored(RequestKey(toks(80), mm_features=img), 16)
    assert ev16.extra_keys == [None, (("img-a", 4),), (("img-a", -12),), None, None]
    feed(index, ev16)
    feed(index, stored(RequestKey(toks(80), mm_features=img), 32), worker=("e32", 0))
    assert router.find_matches(toks(65), mm_features=img) == {
        W: Match(64, 0, 0),
        ("e32", 0): Match(64, 0, 0),
    }
    # another image at the same place: only the block before it is shared
    other = [MMFeature("img-b", 20, 20)]
    assert router.find_matches(toks(65), mm_features=other) == {W: Match(16, 0, 0)}
    # the same image two tokens later: the block holding it differs
    moved = [MMFeature("img-a", 22, 20)]
    assert router.find_matches(toks(65), mm_features=moved) == {W: Match(16, 0, 0)}
    # no image at all: the plain tokens share only the first block
    assert router.find_matches(toks(65)) == {W: Match(16, 0, 0)}


def test_prompt_embeddings_key_blocks_by_their_digest() -> None:
    # _gen_prompt_embeds_extra_hash_keys: sha256 of the block's slice of the embeddings
    rows = [i.to_bytes(4, "little") * 8 for i in range(80)]
    index = BlockIndex()
    router = Router(index)
    ev = stored(RequestKey(toks(80), prompt_embeds=rows), 16)
    assert ev.extra_keys is not None
    assert ev.extra_keys[1] == (hashlib.sha256(b"".join(rows[16:32])).digest(),)
    feed(index, ev)
    assert router.find_matches(toks(65), prompt_embeds=rows[:65]) == {W: Match(64, 0, 0)}
    changed = [*rows[:40], b"\x00" * 32, *rows[41:65]]
    assert router.find_matches(toks(65), prompt_embeds=changed) == {W: Match(32, 0, 0)}
    assert router.find_matches(toks(65)) == {}
    # a digest callable serves the same keys
    digest = lambda s, e: hashlib.sha256(b"".join(rows[s:e])).digest()  # noqa: E731
    assert router.find_matches(toks(65), prompt_embeds=digest) == {W: Match(64, 0, 0)}


# --------------------------------------------------------------------- hybrid models


def test_hybrid_hit_is_aligned_to_the_lcm_of_the_block_sizes() -> None:
    # HybridKVCacheCoordinator: hits are multiples of lcm(16, 32) = 32
    key = RequestKey(toks(128))
    index = BlockIndex()
    router = Router(index)
    feed(index, stored(key, 16, group=0, stop=3), stored(key, 32, group=1))
    assert router.find_matches(toks(100)) == {W: Match(32, 0, 0)}  # group 0: 48 -> 32
    feed(index, stored(key, 16, group=0, start=3, stop=4))
    assert router.find_matches(toks(100)) == {W: Match(64, 0, 0)}


def test_full_plus_sliding_window_needs_the_window_at_the_hit_end() -> None:
    # SlidingWindowManager.find_longest_cache_hit: cdiv(window - 1, block) = 2 contiguous
    # blocks ending at the hit, searched from the right; the hybrid lookup shrinks the
    # hit until full attention and the window agree
    key = RequestKey(toks(160))
    sw = stored(key, 16, group=1, kind="sliding_window", window=32)
    index = BlockIndex()
    router = Router(index)
    feed(index, stored(key, 16, group=0), sw)
    assert router.find_matches(toks(129)) == {W: Match(128, 0, 0)}
    hs = group_hashes(key, 16)
    feed(index, *[BlockRemoved([hs[i]], "GPU", group_idx=1) for i in (5, 6)])
    # window blocks end at 128 (block 7 alone), then 80 (blocks 3 and 4): hit 80
    assert router.find_matches(toks(129)) == {W: Match(80, 0, 0)}
    feed(
        index, *[BlockRemoved([h], "GPU", group_idx=1) for i, h in enumerate(hs) if i not in (5, 6)]
    )
    assert router.find_matches(toks(129)) == {}


def test_chunked_local_attention_only_needs_the_current_chunk() -> None:
    # ChunkedLocalAttentionManager: blocks before the attention chunk holding the hit end
    # count as computed; within it, the blocks must be cached
    key = RequestKey(toks(160))
    index = BlockIndex()
    router = Router(index)
    local = {"group": 1, "kind": "chunked_local_attention", "window": 32}
    feed(index, stored(key, 16, group=0), stored(key, 16, stop=6, **local))  # type: ignore[arg-type]
    # local blocks cached up to 96: a hit ending on a chunk boundary (128) needs none
    assert router.find_matches(toks(129)) == {W: Match(128, 0, 0)}
    # 120 reusable tokens: full attention offers 112, whose chunk starts at 96 and needs
    # block 6 (96..112), absent: the hit shrinks to 96
    assert router.find_matches(toks(121)) == {W: Match(96, 0, 0)}
    feed(index, stored(key, 16, start=6, **local))  # type: ignore[arg-type]
    assert router.find_matches(toks(121)) == {W: Match(112, 0, 0)}


def test_groups_vllm_cannot_reuse_are_never_credited() -> None:
    key = RequestKey(toks(80))
    index = BlockIndex(blocks_per_chunk=1)
    feed(index, stored(key, 16, group=0))
    feed(index, stored(key, 16, group=1, kind="mamba"))
    assert Router(index).find_matches(toks(65)) == {}
    assert index.stats.skipped["kind:mamba"] == 5


def test_partial_tail_stores_do_not_change_the_group_block_size() -> None:
    # BlockPool.cache_partial_block: one hash at hash granularity into a coarser group
    key = RequestKey(toks(128))
    raw = engine_hashes(key, 16)
    index = BlockIndex()
    router = Router(index)
    feed(index, stored(key, 16, group=0, stop=5), stored(key, 32, group=1, stop=2))
    partial = BlockStored([raw[4]], raw[3], key.tokens[64:80], 16, None, "GPU", None,
                          group_idx=1, kv_cache_spec_kind="full_attention")  # fmt: skip
    feed(index, partial)
    info = index.block_info(W, 1, raw[4])
    assert info is not None and not info.indexed
    assert index.stats.skipped["partial_tail"] == 1
    # group 1 still has 32-token blocks: 64 tokens, not 80
    assert router.find_matches(toks(100)) == {W: Match(64, 0, 0)}
    feed(index, BlockRemoved([raw[4]], "GPU", group_idx=1))  # promotion removes it
    assert index.stats.unknown_removals.total() == 0
    assert router.find_matches(toks(100)) == {W: Match(64, 0, 0)}


def test_a_partial_tail_seen_first_is_unkeyed_when_full_blocks_arrive() -> None:
    key = RequestKey(toks(128))
    raw = engine_hashes(key, 16)
    index = BlockIndex()
    partial = BlockStored([raw[0]], None, key.tokens[:16], 16, None, "GPU", None,
                          group_idx=1, kv_cache_spec_kind="full_attention")  # fmt: skip
    feed(index, stored(key, 16, group=0), partial, stored(key, 32, group=1, stop=1))
    assert index.block_info(W, 1, raw[0]).indexed is False  # type: ignore[union-attr]
    assert Router(index).find_matches(toks(33)) == {W: Match(32, 0, 0)}


# --------------------------------------------------------------------- content marks


def test_two_engine_blocks_with_one_content_are_two_references() -> None:
    # one adapter name with two paths: vLLM hashes the path, the event only the name
    key = RequestKey(toks(80), lora_name="a")
    first, second = stored(key, 16, path="/v1"), stored(key, 16, path="/v2")
    assert first.block_hashes != second.block_hashes
    index = BlockIndex()
    router = Router(index)
    feed(index, first, second)
    assert router.find_matches(toks(65), lora_name="a") == {W: Match(64, 0, 0)}
    feed(index, *[BlockRemoved([h], "GPU", group_idx=0) for h in first.block_hashes])
    assert router.find_matches(toks(65), lora_name="a") == {W: Match(64, 0, 0)}
    feed(index, *[BlockRemoved([h], "GPU", group_idx=0) for h in second.block_hashes])
    assert router.find_matches(toks(65), lora_name="a") == {}


# --------------------------------------------------------------------- speculative decoding


def test_lookahead_hashing_keys_a_block_with_the_next_token() -> None:
    # num_hash_lookahead_tokens = 1: a block's hash covers the token after it, so a
    # prompt's last block is never hashed and a different next token is another block
    longer = RequestKey(toks(81))
    index = BlockIndex()
    router = Router(index)
    ev = stored(longer, 16, lookahead=1)
    assert ev.lookahead_token_ids == [[1016], [1032], [1048], [1064], [1080]]
    feed(index, ev)
    assert router.find_matches(toks(64)) == {W: Match(48, 0, 0)}  # block 3 needs token 64
    assert router.find_matches(toks(65)) == {W: Match(64, 0, 0)}
    assert router.find_matches(toks(49)) == {W: Match(48, 0, 0)}
    other_next = [*toks(48), 7, *toks(20, 1049)]
    assert router.find_matches(other_next) == {W: Match(32, 0, 0)}
    # configured instead of learned: the same answers
    cfg = BlockIndex(lookahead_tokens={W: 1})
    feed(cfg, ev)
    assert Router(cfg).find_matches(toks(65)) == {W: Match(64, 0, 0)}


def test_eagle_drop_mode_drops_the_last_matched_block() -> None:
    # FullAttentionManager.find_longest_cache_hit with use_eagle: pop the last hit block
    index = BlockIndex(eagle_drop={"eagle": True})
    router = Router(index)
    key = RequestKey(toks(80))
    feed(index, stored(key, 16), worker=("eagle", 0))
    feed(index, stored(key, 16), worker=("plain", 0))
    assert router.find_matches(toks(65)) == {
        ("eagle", 0): Match(48, 0, 0),
        ("plain", 0): Match(64, 0, 0),
    }
    assert router.find_matches(toks(20)) == {("plain", 0): Match(16, 0, 0)}


# --------------------------------------------------------------------- CPU: _lookup_complete_chunks


def placeholder(h: int, group: int = 0, medium: str = "CPU") -> BlockStored:
    return BlockStored([h], None, [], 0, None, medium, None, group_idx=group)


def test_cpu_counts_whole_chunks_from_the_one_holding_the_gpu_hit() -> None:
    key = RequestKey(toks(128))
    hs = group_hashes(key, 16)
    index = BlockIndex(blocks_per_chunk=2)  # 32-token chunks
    router = Router(index)
    feed(index, stored(key, 16), *[placeholder(hs[i]) for i in (1, 3, 5)])
    feed(index, *[BlockRemoved([h], "GPU", group_idx=0) for h in hs[1:]])
    # GPU 16; chunks 0-2 end at 96: the CPU adds 80
    assert router.find_matches(toks(128)) == {W: Match(16, 80, 0)}
    # the CPU bound starts at the request length (no windowed group): a 96-token prompt
    # takes its last chunk from the CPU, though the GPU could never reuse token 95
    assert router.find_matches(toks(96)) == {W: Match(16, 80, 0)}
    # only chunk 0: 16 more tokens, less than a chunk: nothing
    feed(index, BlockRemoved([hs[3]], "CPU", group_idx=0))
    assert router.find_matches(toks(128)) == {W: Match(16, 0, 0)}


def test_hybrid_cpu_bound_is_not_rounded_to_the_lcm() -> None:
    # groups of 16 and 32 tokens, 2 blocks per chunk: chunks of 32 and 64 tokens.  Group 0
    # bounds the hit at 160 (five chunks); group 1's chunks reach 192; vLLM loads 160,
    # not a multiple of group 1's chunk
    key = RequestKey(toks(200))
    g0, g1 = group_hashes(key, 16), group_hashes(key, 32)
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index)
    feed(index, stored(key, 16, group=0), stored(key, 32, group=1))
    feed(index, *[placeholder(g0[2 * c + 1], 0) for c in range(5)])
    feed(index, *[placeholder(g1[2 * c + 1], 1) for c in range(3)])
    feed(index, *[BlockRemoved([h], "GPU", group_idx=0) for h in g0])
    feed(index, *[BlockRemoved([h], "GPU", group_idx=1) for h in g1])
    assert router.find_matches(toks(200)) == {W: Match(0, 160, 0)}
    # when group 0 bounds the hit at 32, less than one of group 1's 64-token chunks: 0
    feed(index, BlockRemoved([g0[3]], "CPU", group_idx=0))
    assert router.find_matches(toks(200)) == {}


def test_cpu_with_a_sliding_window_group() -> None:
    # the bound starts one short of the request; the window group needs its last
    # cdiv(window, chunk) = 1 chunk at the bound
    key = RequestKey(toks(128))
    f, s = group_hashes(key, 16), group_hashes(key, 16)
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index)
    feed(
        index, stored(key, 16, group=0), stored(key, 16, group=1, kind="sliding_window", window=32)
    )
    feed(index, *[placeholder(f[i], 0) for i in (1, 3, 5, 7)], placeholder(s[3], 1))
    feed(index, *[BlockRemoved([h], "GPU", group_idx=g) for g in (0, 1) for h in f])
    # full: bound min(127, 128) -> chunks to 128 -> 127 (one short); window group: among
    # chunks 0..3 its last held run is chunk 1 (ends at 64): hit 64
    assert router.find_matches(toks(128)) == {W: Match(0, 64, 0)}
    feed(index, placeholder(s[7], 1))
    # now its chunk 3 (ending at 128) is held: the run ends past the bound, which stays
    # at 127 (vLLM loads the chunks and recomputes the last token)
    assert router.find_matches(toks(128)) == {W: Match(0, 127, 0)}


def test_a_request_key_and_keyword_arguments_do_not_mix() -> None:
    router = Router(BlockIndex())
    with pytest.raises(ConfigError):
        router.find_matches(RequestKey(toks(20)), lora_name="a")
    # a RequestKey without extras is plain tokens
    index = BlockIndex()
    feed(index, stored(RequestKey(toks(80)), 16))
    assert Router(index).find_matches(RequestKey(toks(65))) == {W: Match(64, 0, 0)}
    assert Router(index).score(RequestKey(toks(65)))[0].match == Match(64, 0, 0)


def test_cpu_lookup_checks_an_earlier_window_again_at_a_lower_bound() -> None:
    # full attention + windows of 32 and 64 tokens (1 and 2 of the 32-token chunks).
    # _lookup_complete_chunks runs until the bound is stable: when a windowed group lowers
    # it after another windowed group, the windowed groups are checked again
    key = RequestKey(toks(128))
    hs = group_hashes(key, 16)
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index)
    feed(
        index,
        stored(key, 16, group=0),
        stored(key, 16, group=1, kind="sliding_window", window=32),
        stored(key, 16, group=2, kind="sliding_window", window=64),
    )
    feed(index, *[BlockRemoved([h], "GPU", group_idx=g) for g in (0, 1, 2) for h in hs])
    feed(
        index,
        *[placeholder(hs[2 * c + 1], 0) for c in range(4)],  # full: every chunk
        *[placeholder(hs[2 * c + 1], 1) for c in (0, 3)],  # window 32: chunks 0 and 3
        *[placeholder(hs[2 * c + 1], 2) for c in (0, 1)],  # window 64: chunks 0 and 1
    )
    # first pass: bound 127; full keeps 127; window 32 finds chunk 3 (ends at 128): 127;
    # window 64 needs two chunks: 0-1, bound 64.  Second pass, windowed groups at 64:
    # window 32 scans chunks 1, 0 -> chunk 0, bound 32; window 64 at 32 has chunk 0 only,
    # a run reaching the first chunk counts: 32.  Third pass is not needed (the last
    # lowering came from the first windowed group of the pass).  One pass would say 64.
    assert router.find_matches(toks(128)) == {W: Match(0, 32, 0)}
    # without window 32's chunk 0 the second pass finds nothing: nothing is loaded
    feed(index, BlockRemoved([hs[1]], "CPU", group_idx=1))
    assert router.find_matches(toks(128)) == {}


def test_eagle_window_groups_drop_a_chunk_only_in_the_first_pass() -> None:
    # EAGLE drop mode, nothing annotated: every group is an EAGLE group, and
    # _lookup_complete_chunks lets each drop its trailing chunk once (eagle_verified is
    # cleared only when a non-EAGLE group lowers the bound): the windowed groups checked
    # again neither look one chunk further nor drop one
    key = RequestKey(toks(256))
    hs = group_hashes(key, 16)
    index = BlockIndex(blocks_per_chunk=2, eagle_drop=True)
    router = Router(index)
    feed(
        index,
        stored(key, 16, group=0),
        stored(key, 16, group=1, kind="sliding_window", window=32),
        stored(key, 16, group=2, kind="sliding_window", window=64),
    )
    feed(index, *[BlockRemoved([h], "GPU", group_idx=g) for g in (0, 1, 2) for h in hs])
    feed(
        index,
        *[placeholder(hs[2 * c + 1], 0) for c in range(8)],  # full: every chunk
        *[placeholder(hs[2 * c + 1], 1) for c in (0, 5, 6)],  # window 32 (1 chunk)
        *[placeholder(hs[2 * c + 1], 2) for c in (0, 1, 2)],  # window 64 (2 chunks)
    )
    # first pass, bound 255: full holds chunks 0-7, drops one: 224.  Window 32 looks to
    # 256 for 1 + 1 chunks: 5-6, drops one: 192.  Window 64 looks to 224 for 2 + 1: 0-2,
    # drops one: 64.  Second pass at 64, plain: window 32 scans chunks 1, 0 -> chunk 0:
    # 32; window 64 at 32: chunk 0, a run reaching the first chunk: 32.  (One pass would
    # say 64; dropping again in the second pass would leave window 32 nothing: 0.)
    assert router.find_matches(toks(256)) == {W: Match(0, 32, 0)}
