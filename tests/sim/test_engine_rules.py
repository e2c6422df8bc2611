"""The simulated engine reuses what vLLM 0.33 reuses: one test per rule of its lookup
(``get_computed_blocks``, the hybrid coordinator, the sliding-window manager, EAGLE,
``_lookup_complete_chunks``) and of what its events carry."""

from __future__ import annotations

import hashlib

import pytest

from kvevents.errors import ConfigError
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.request import MMFeature
from kvevents.sim import KVCacheGroupSpec, SimEngine, SimEngineConfig, SimRequest
from kvevents.sim.block_pool import NULL_BLOCK, RequestHasher, group_block_hashes
from kvevents.sim.keys import SimKey, event_extra_keys, hash_extra_keys


class Collect:
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def stored(self, medium: str = "GPU") -> list[BlockStored]:
        return [
            e
            for b in self.batches
            for e in b.events
            if isinstance(e, BlockStored) and e.medium == medium
        ]


def engine(*groups: KVCacheGroupSpec, blocks: int = 64, **kw: object) -> tuple[SimEngine, Collect]:
    sink = Collect()
    cfg = SimEngineConfig(
        groups=groups or (KVCacheGroupSpec(16),),
        num_gpu_blocks=blocks,
        transfers=False,
        **kw,  # type: ignore[arg-type]
    )
    return SimEngine(cfg, sink), sink


def req(rid: str, prompt: list[int], output: list[int] | None = None, **kw: object) -> SimRequest:
    return SimRequest(rid, 0, 0, 0, tuple(prompt), tuple(output or ()), **kw)  # type: ignore[arg-type]


def run(e: SimEngine, *reqs: SimRequest) -> list[tuple[int, int]]:
    """Run requests one after the other; each one's (gpu, cpu) reuse."""
    out = []
    for r in reqs:
        e.add_request(r)
        e.run_until_idle()
        a = e.admissions[-1]
        assert a.request_id == r.request_id
        out.append((a.gpu_hit_tokens, a.cpu_hit_tokens))
    return out


P64 = list(range(100, 164))


def test_the_last_prompt_token_is_never_reused() -> None:
    e, _ = engine()
    assert run(e, req("a", P64), req("b", P64)) == [(0, 0), (48, 0)]
    # one token more: the whole 64 are reusable
    assert run(e, req("c", [*P64, 7])) == [(64, 0)]


def test_eagle_drop_mode_drops_the_last_matched_block() -> None:
    e, _ = engine(eagle_drop=True)
    assert run(e, req("a", [*P64, 1]), req("b", [*P64, 2])) == [(0, 0), (48, 0)]


def test_lookahead_hashing_covers_the_next_token_and_skips_the_prompt_tail() -> None:
    e, sink = engine(lookahead_tokens=1)
    run(e, req("a", P64))
    (ev,) = sink.stored()
    assert len(ev.block_hashes) == 3  # the last block waits for a 65th token
    assert ev.lookahead_token_ids == [[116], [132], [148]]
    # same 48 tokens, a different next token: the third block is another block
    assert run(e, req("b", [*P64[:48], 5, *P64[49:]])) == [(32, 0)]
    assert run(e, req("c", P64)) == [(48, 0)]


def test_extra_keys_separate_lora_salt_and_images() -> None:
    e, sink = engine()
    run(e, req("plain", P64))
    assert run(e, req("lora", P64, lora_name="ad")) == [(0, 0)]
    assert run(e, req("salt", P64, cache_salt="s")) == [(0, 0)]
    img = (MMFeature("img-a", 20, 8),)
    assert run(e, req("img", P64, mm_features=img)) == [(16, 0)]  # block 0 has no image
    other = (MMFeature("img-b", 20, 8),)
    assert run(e, req("img-b", P64, mm_features=other)) == [(16, 0)]
    assert run(e, req("img-again", P64, mm_features=img)) == [(48, 0)]
    by_lora = {ev.lora_name: ev for ev in sink.stored()}
    assert by_lora["ad"].extra_keys == [("ad",)] * 4
    assert by_lora["ad"].lora_id is not None
    salted = [ev for ev in sink.stored() if ev.extra_keys and ev.extra_keys[0] == ("s",)]
    assert salted[0].extra_keys == [("s",), None, None, None]
    # plain requests: one None per block, as vLLM's cache_full_blocks lists them
    assert sink.stored()[0].extra_keys == [None] * 4


def test_hash_side_keys_are_tagged_and_event_side_untagged() -> None:
    key = SimKey("ad", "s", (MMFeature("m", 4, 20),), (b"\x01",) * 32)
    digest = hashlib.sha256(b"\x01" * 16).digest()
    assert hash_extra_keys(key, 0, 16) == (
        ("lora", "ad", "/loras/ad"),
        ("mm", "m", 4),
        ("cache_salt", "s"),
        ("prompt_embeds", digest),
    )
    assert event_extra_keys(key, 0, 16) == ("ad", ("m", 4), "s", digest)
    assert event_extra_keys(key, 16, 32) == ("ad", ("m", -12), digest)


def test_two_full_attention_groups_align_the_hit_to_their_lcm() -> None:
    e, sink = engine(KVCacheGroupSpec(16), KVCacheGroupSpec(32))
    prompt = list(range(1, 81))  # 80 tokens: 5 blocks of 16, 2 of 32
    assert run(e, req("a", prompt), req("b", prompt)) == [(0, 0), (64, 0)]
    g0, g1, partial = sink.stored()[:3]
    assert (g0.group_idx, g0.block_size, len(g0.block_hashes)) == (0, 16, 5)
    assert (g1.group_idx, g1.block_size, len(g1.block_hashes)) == (1, 32, 2)
    # the prompt ends inside group 1's third block: vLLM registers that boundary as a
    # partial-tail entry, one 16-token hash (the raw hash at token 80) in group 1
    assert (partial.group_idx, partial.block_size) == (1, 16)
    assert partial.block_hashes == [g0.block_hashes[4]]
    assert partial.parent_block_hash == g0.block_hashes[3]
    assert partial.token_ids == prompt[64:80]


def test_sliding_window_blocks_leave_the_window_and_the_hit_needs_them() -> None:
    fa, sw = KVCacheGroupSpec(16), KVCacheGroupSpec(16, "sliding_window", sliding_window=32)
    e, sink = engine(fa, sw, blocks=40, decode_tokens_per_step=16)
    prompt = list(range(1, 65))
    run(e, req("a", prompt, list(range(500, 564))))
    sw_events = [ev for ev in sink.stored() if ev.group_idx == 1]
    assert {(ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window) for ev in sw_events} == {
        ("sliding_window", 32)
    }
    # the full prompt is cached in both groups: a 65-token prompt reuses 64
    assert run(e, req("b", [*prompt, 9])) == [(64, 0)]
    # fill the pool with another prefix: the freed (out-of-window) blocks go first
    run(e, req("c", list(range(1000, 1280))))
    removed = [ev for b in sink.batches for ev in b.events if isinstance(ev, BlockRemoved)]
    assert removed
    gpu, _ = run(e, req("d", [*prompt, 9]))[0]
    assert gpu < 64


def _sw_block(e: SimEngine, prompt: list[int], index: int) -> int:
    """The pool block holding block ``index`` of ``prompt`` in group 1."""
    raw = RequestHasher(16).extend(prompt)
    block = e.pool.cached_block(group_block_hashes(raw, 16, 16)[index], 1)
    assert block is not None
    return block


def test_sliding_window_lookup_needs_the_window_at_the_hit_end() -> None:
    fa, sw = KVCacheGroupSpec(16), KVCacheGroupSpec(16, "sliding_window", sliding_window=32)
    prompt = list(range(1, 98))  # 6 full blocks; the window needs 2 at the hit end
    e, _ = engine(fa, sw)
    run(e, req("a", prompt))
    e.pool._evict(_sw_block(e, prompt, 1))  # outside the window of a 96-token hit
    assert run(e, req("b", prompt)) == [(96, 0)]
    e, _ = engine(fa, sw)
    run(e, req("a", prompt))
    e.pool._evict(_sw_block(e, prompt, 4))  # inside it: the hit moves back to 64
    assert run(e, req("b", prompt)) == [(64, 0)]


def test_cpu_tier_credits_whole_chunks_only() -> None:
    # bpc 4: one chunk is 64 tokens.  "a" stores chunk 0; "evict" reuses 7 of the 8
    # GPU blocks, leaving a's first block: the GPU hit is 16 and chunk 0 would add only
    # 48 tokens, less than a chunk, so vLLM loads nothing
    prompt = [*P64, 1]
    e, _ = engine(blocks=8, num_cpu_chunks=8, blocks_per_chunk=4)
    run(e, req("a", prompt), req("evict", list(range(2000, 2112))))
    assert run(e, req("b", prompt)) == [(16, 0)]
    # with every GPU block of "a" gone the whole chunk is credited
    e, _ = engine(blocks=8, num_cpu_chunks=8, blocks_per_chunk=4)
    run(e, req("a", prompt), req("evict", list(range(2000, 2128))))
    assert run(e, req("b", prompt)) == [(0, 64)]


def test_preempted_requests_are_looked_up_again_with_their_output() -> None:
    e, _ = engine(blocks=12, preemption=True, decode_tokens_per_step=16, max_running=4)
    for i in range(4):
        e.add_request(req(f"r{i}", list(range(i * 1000, i * 1000 + 40)), list(range(7, 71))))
    e.run_until_idle()
    assert e.stats.preemptions > 0
    again = [a for a in e.admissions if a.attempt > 0]
    assert any(a.num_tokens > 40 for a in again)  # prompt plus the output so far
    assert len(e.results) == 4


def test_configs_vllm_cannot_have_are_refused() -> None:
    with pytest.raises(ConfigError):
        SimEngineConfig(lookahead_tokens=1, eagle_drop=True).validate()
    with pytest.raises(ConfigError):
        KVCacheGroupSpec(16, "sliding_window")
    with pytest.raises(ConfigError):  # modelled for one group only
        SimEngineConfig(
            groups=(KVCacheGroupSpec(16), KVCacheGroupSpec(32)), eagle_drop=True
        ).validate()
    assert NULL_BLOCK < 0


class _Stored:
    """A CPU manager holding every chunk key but ``missing`` (the rule under test is the
    counting, not the manager)."""

    def __init__(self, missing: set[bytes]) -> None:
        self.missing = missing

    def lookup(self, key: bytes, ctx: object) -> object:
        from kvevents.publishers.offload import LookupResult

        return LookupResult.MISS if bytes(key) in self.missing else LookupResult.HIT


@pytest.mark.parametrize(
    ("gpu", "num_tokens", "missing", "cpu"),
    [
        (0, 97, [], 96),
        (0, 97, [(1, 4)], 64),  # the window (2 chunks) must end at the bound
        (0, 97, [(1, 5)], 80),
        (0, 97, [(0, 2)], 32),  # full attention needs the prefix
        (48, 97, [], 48),
        (48, 97, [(1, 3)], 48),  # a window needs no chunk before it
        (0, 96, [], 95),  # with a window the bound starts one token short
        (16, 97, [(0, 1), (1, 1)], 0),  # the chunk holding the GPU hit's end is missing
    ],
)
def test_cpu_lookup_with_a_sliding_window_group(
    gpu: int, num_tokens: int, missing: list[tuple[int, int]], cpu: int
) -> None:
    fa, sw = KVCacheGroupSpec(16), KVCacheGroupSpec(16, "sliding_window", sliding_window=32)
    e, _ = engine(fa, sw, num_cpu_chunks=8)
    off = e.offload
    assert off is not None and off.window_chunks == [None, 2]
    raw = RequestHasher(16).extend(list(range(1, num_tokens + 1)))
    off.manager = _Stored({off.key(raw, g, c) for g, c in missing})
    assert off.lookup(raw, gpu, num_tokens) == cpu


def test_cpu_lookup_checks_an_earlier_window_again_at_a_lower_bound() -> None:
    # full attention + windows of 3 and 5 chunks; the GPU hit ends at chunk 9.  Pass 1:
    # full attention reaches chunk 16 (bound 256), window 3 finds chunks 13-15, window 5
    # only 10-14 (bound 240).  Window 3 is checked again below 240: no 3 consecutive
    # chunks end there, only the 2 chunks right after the GPU hit (bound 176)
    fa = KVCacheGroupSpec(16)
    w3 = KVCacheGroupSpec(16, "sliding_window", sliding_window=48)
    w5 = KVCacheGroupSpec(16, "sliding_window", sliding_window=80)
    e, _ = engine(fa, w3, w5, num_cpu_chunks=8)
    off = e.offload
    assert off is not None and off.window_chunks == [None, 3, 5]
    raw = RequestHasher(16).extend(list(range(1, 296)))
    held = {
        0: set(range(16)),
        1: set(range(6, 11)) | set(range(13, 16)),
        2: set(range(4, 15)),
    }
    missing = {off.key(raw, g, c) for g in held for c in range(18) if c not in held[g]}
    off.manager = _Stored(missing)
    assert off.lookup(raw, 144, 295) == 32
