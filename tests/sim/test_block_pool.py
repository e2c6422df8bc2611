"""The simulated GPU pool emits vLLM's GPU events (C§4.3) with vLLM's hashes (C§8.3)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.hashing import hash_request_blocks, to_wire_hash
from kvevents.sim import (
    KVCacheGroupSpec,
    RequestHasher,
    SimEngine,
    SimEngineConfig,
    SimRequest,
)


class Collect:
    """Keeps the batches an engine publishes (the transport is not under test here)."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def events(self) -> list[object]:
        return [e for b in self.batches for e in b.events]


def req(rid: str, prompt: list[int], output: list[int] | None = None) -> SimRequest:
    return SimRequest(rid, 0, 0, 0, tuple(prompt), tuple(output or ()))


def engine(
    block_sizes: tuple[int, ...] = (16,), blocks: int = 64, **kw: object
) -> tuple[SimEngine, Collect]:
    sink = Collect()
    cfg = SimEngineConfig(
        groups=tuple(KVCacheGroupSpec(b) for b in block_sizes),
        num_gpu_blocks=blocks,
        **kw,  # type: ignore[arg-type]
    )
    return SimEngine(cfg, sink), sink


def run(e: SimEngine, *reqs: SimRequest) -> None:
    for r in reqs:
        e.add_request(r)
    e.run_until_idle()


def test_gpu_hashes_equal_the_contract_vectors_block_4() -> None:
    e, sink = engine((4,), blocks=8)
    run(e, req("a", list(range(1, 10))))
    (stored,) = sink.events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [9561501211280363793, 15292913576410714033]
    assert stored.parent_block_hash is None
    assert stored.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (stored.block_size, stored.group_idx, stored.medium) == (4, 0, "GPU")
    assert stored.kv_cache_spec_kind == "full_attention"


def test_gpu_hashes_equal_the_contract_vectors_block_16() -> None:
    e, sink = engine((16,), blocks=8)
    run(e, req("a", list(range(100, 165))))
    (stored,) = sink.events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [
        10428775992902877628,
        8101442038445348984,
        9222808348315984622,
        10472129487708613277,
    ]


def test_pickle_algorithm_and_extra_keys_match_the_contract_vectors() -> None:
    e, sink = engine((4,), blocks=8, hash_algo="sha256")
    run(e, req("a", list(range(1, 10))))
    assert sink.events()[0].block_hashes == [1882140585328457242, 15284023028817948126]  # type: ignore[attr-defined]
    h = RequestHasher(4, extra_keys=(("lora", "my-lora", "/p"), ("cache_salt", "s")))
    assert to_wire_hash(h.extend([1, 2, 3, 4])[0]) == 9577358887296308044


def test_a_shared_prefix_is_reused_and_only_new_blocks_are_announced() -> None:
    e, sink = engine((4,), blocks=16)
    run(e, req("a", list(range(1, 14))))
    sink.batches.clear()
    run(e, req("b", [*range(1, 13), 90, 91, 92, 93, 94]))
    (stored,) = sink.events()
    assert isinstance(stored, BlockStored)
    full = [to_wire_hash(d) for d in hash_request_blocks([*range(1, 13), 90, 91, 92, 93], 4)]
    assert stored.parent_block_hash == full[2]
    assert stored.block_hashes == [full[3]]
    assert stored.token_ids == [90, 91, 92, 93]
    (res_a, res_b) = e.results
    assert (res_a.gpu_hit_tokens, res_b.gpu_hit_tokens) == (0, 12)
    assert res_b.computed_tokens == 17 - 12


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    e, _ = engine((4,), blocks=16)
    run(e, req("a", list(range(1, 9))), req("b", list(range(1, 9))))
    assert e.results[1].gpu_hit_tokens == 4


def test_eviction_is_lazy_tail_first_and_one_event_per_hash() -> None:
    e, sink = engine((4,), blocks=4)
    run(e, req("a", list(range(1, 17))))  # 4 full blocks, all cached, then freed
    a_hashes = sink.events()[0].block_hashes  # type: ignore[attr-defined]
    sink.batches.clear()
    e.pool.allocate(0)
    assert sink.events() == []  # freed blocks stay stored until reused
    run(e, req("b", list(range(50, 58))))  # needs 2 blocks: evicts a's two tail blocks
    removed = [ev for ev in sink.events() if isinstance(ev, BlockRemoved)]
    assert [r.block_hashes for r in removed] == [[a_hashes[3]], [a_hashes[2]]]
    assert all(r.medium == "GPU" and r.group_idx == 0 for r in removed)
    first = sink.events().index(removed[0])
    assert isinstance(sink.events()[-1], BlockStored) and first < len(sink.events()) - 1


def test_reset_clears_when_idle_and_refuses_while_blocks_are_in_use() -> None:
    e, sink = engine((4,), blocks=8, decode_tokens_per_step=2)
    e.add_request(req("a", list(range(1, 9)), [5, 6, 7, 8, 9]))
    e.step()
    assert e.reset_prefix_cache() is False
    assert e.pool.stats.resets_refused["blocks_in_use"] == 1
    e.run_until_idle()
    sink.batches.clear()
    assert e.reset_prefix_cache() is True
    assert sink.events() == [AllBlocksCleared()]
    run(e, req("b", list(range(1, 9))))
    assert e.results[-1].gpu_hit_tokens == 0


def test_hybrid_groups_use_gcd_hashes_and_emit_per_group() -> None:
    e, sink = engine((16, 32), blocks=16)
    run(e, req("a", list(range(100, 165))))
    g0, g1 = sink.events()
    assert isinstance(g0, BlockStored) and isinstance(g1, BlockStored)
    assert (g0.group_idx, g0.block_size, g1.group_idx, g1.block_size) == (0, 16, 1, 32)
    assert g1.block_hashes == [g0.block_hashes[1], g0.block_hashes[3]]
    assert len(g1.token_ids) == 64


def test_lora_requests_carry_name_and_event_extra_keys() -> None:
    e, sink = engine((4,), blocks=8)
    run(e, SimRequest("a", 0, 0, 0, (1, 2, 3, 4, 5), (), lora_name="my-lora"))
    (stored,) = sink.events()
    assert isinstance(stored, BlockStored)
    assert stored.lora_name == "my-lora" and stored.extra_keys == [("my-lora",)]
    assert stored.block_hashes != [9561501211280363793]


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=40), min_size=1, max_size=12),
    blocks=st.integers(12, 40),
    sizes=st.sampled_from([(4,), (2, 4), (4, 8)]),
)
def test_the_event_stream_mirrors_the_pool_contents(
    prompts: list[list[int]], blocks: int, sizes: tuple[int, ...]
) -> None:
    """Applying the stream (store +1 per block, remove -1) leaves exactly the pool's
    cached (hash, group) entries: nothing is removed before it was stored."""
    e, sink = engine(sizes, blocks=blocks, max_running=3, decode_tokens_per_step=3)
    for i, p in enumerate(prompts):
        e.add_request(req(f"r{i}", p, p[:5]))
    e.run_until_idle()
    held: Counter[tuple[int, int]] = Counter()
    for ev in sink.events():
        if isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                held[(int(h), ev.group_idx or 0)] += 1
        elif isinstance(ev, BlockRemoved):
            (h,) = ev.block_hashes
            key = (int(h), ev.group_idx or 0)
            assert held[key] > 0
            held[key] -= 1
    live = +held
    pool_keys = Counter(
        (to_wire_hash(k[0]), k[1]) for b in range(e.pool.num_blocks) for k in e.pool.block_keys(b)
    )
    assert live == pool_keys


def test_a_hybrid_hit_is_pinned_in_every_group_before_allocation() -> None:
    """Allocating group 0's new blocks must not evict group 1's hit blocks, even when
    those sit at the head of the free queue (least recently freed)."""
    e, sink = engine((4, 8), blocks=23)
    prefix = list(range(1, 17))  # 4 blocks of 4, 2 blocks of 8
    run(e, req("a", [*prefix, 99]))  # caches the prefix in both groups, then frees it
    run(e, req("d", list(range(500, 540))))  # other content fills the rest of the pool
    a_g1 = next(ev for ev in sink.events() if isinstance(ev, BlockStored) and ev.group_idx == 1)
    sink.batches.clear()
    run(e, req("b", [*prefix, *range(200, 217)]))  # needs new blocks in both groups
    assert e.results[-1].gpu_hit_tokens == 16
    removed = {h for ev in sink.events() if isinstance(ev, BlockRemoved) for h in ev.block_hashes}
    assert not removed & set(a_g1.block_hashes)
    stored_b = [ev for ev in sink.events() if isinstance(ev, BlockStored)]
    assert [ev.group_idx for ev in stored_b] == [0, 1]
    assert stored_b[1].parent_block_hash == a_g1.block_hashes[1]
