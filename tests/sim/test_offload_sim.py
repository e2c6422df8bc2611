"""The simulator's CPU tier: placeholder events (C§5.8) that join the GPU ones in the
index (C§8.6), and CPU hits that load back the bytes that were stored."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.sim import (
    KVCacheGroupSpec,
    SimEngine,
    SimEngineConfig,
    SimRequest,
    WorkloadConfig,
    generate_workload,
)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class Collect:
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)


def engine(
    sizes: tuple[int, ...] = (4,), *, gpu: int = 64, cpu: int = 16, bpc: int = 2, **kw: object
) -> tuple[SimEngine, Collect]:
    sink = Collect()
    cfg = SimEngineConfig(
        groups=tuple(KVCacheGroupSpec(s) for s in sizes),
        num_gpu_blocks=gpu,
        num_cpu_chunks=cpu,
        blocks_per_chunk=bpc,
        **kw,  # type: ignore[arg-type]
    )
    return SimEngine(cfg, sink), sink


def req(rid: str, prompt: list[int], output: list[int] | None = None) -> SimRequest:
    return SimRequest(rid, 0, 0, 0, tuple(prompt), tuple(output or ()))


def stores(sink: Collect, medium: str) -> list[tuple[int, BlockStored]]:
    return [
        (i, e)
        for i, b in enumerate(sink.batches)
        for e in b.events
        if isinstance(e, BlockStored) and e.medium == medium
    ]


def test_cpu_placeholders_name_the_chunk_tail_and_trail_the_gpu_store() -> None:
    e, sink = engine((4,), bpc=2)
    e.add_request(req("a", list(range(1, 18))))  # 4 full blocks = 2 chunks of 8 tokens
    e.run_until_idle()
    (gpu_batch, gpu), *rest = stores(sink, "GPU")
    assert rest == []
    cpu = stores(sink, "CPU")
    assert [ev.block_hashes for _, ev in cpu] == [[gpu.block_hashes[1]], [gpu.block_hashes[3]]]
    for batch_no, ev in cpu:
        assert batch_no > gpu_batch  # the store completes a step later (C§2.5)
        assert (ev.parent_block_hash, ev.token_ids, ev.block_size) == (None, [], 0)
        assert ev.group_idx == 0 and ev.lora_name is None


def test_cpu_events_join_the_gpu_metadata_in_the_index() -> None:
    from kvevents.consumers import BlockIndex

    e, sink = engine((16,), gpu=48, cpu=24, bpc=4)
    for r in generate_workload(WorkloadConfig(num_requests=60, num_tenants=2, seed=5)):
        e.add_request(r)
    e.run_until_idle()
    index = BlockIndex(blocks_per_chunk=4)
    for b in sink.batches:
        index.apply("tcp://sim:1", 0, b)
    n_cpu = len(stores(sink, "CPU"))
    assert n_cpu > 20
    assert index.stats.joined == n_cpu
    assert not index.stats.unjoined and not index.stats.unknown_removals
    (summary,) = index.summary().values()
    cpu = summary.tiers["CPU"]
    assert 0 < cpu.entries <= 24
    assert cpu.tokens == cpu.entries * 4 * 16


def test_a_cpu_hit_loads_back_the_stored_bytes() -> None:
    pytest.importorskip("torch")  # the byte check needs the real transfers
    e, sink = engine((4,), gpu=12, cpu=16, bpc=2, decode_tokens_per_step=4)
    shared = list(range(1, 33))  # 8 blocks, 4 chunks
    e.add_request(req("a", [*shared, 99], [1, 2, 3]))
    e.run_until_idle()
    e.add_request(req("b", list(range(200, 245)), [1]))  # 12 blocks: evicts all of a
    e.run_until_idle()
    e.add_request(req("c", [*shared, 7, 7], [1]))
    e.run_until_idle()
    res = {r.request_id: r for r in e.results}
    assert res["c"].gpu_hit_tokens == 0
    assert res["c"].cpu_hit_tokens == 32
    assert e.offload is not None and e.offload.stats.blocks_copied_to_device == 8
    assert e.stats.load_mismatches == 0
    # The loaded blocks are cached on the GPU again, announced with the same hashes.
    gpu_stores = [ev for _, ev in stores(sink, "GPU")]
    assert gpu_stores[-1].block_hashes[:8] == gpu_stores[0].block_hashes[:8]


def test_hybrid_groups_key_their_own_chunk_tails() -> None:
    from kvevents.consumers import BlockIndex

    e, sink = engine((4, 8), gpu=64, cpu=32, bpc=2)
    e.add_request(req("a", list(range(1, 34))))  # 32 full tokens
    e.run_until_idle()
    gpu = {ev.group_idx: ev for _, ev in stores(sink, "GPU")}
    cpu: dict[int, list[int]] = {}
    for _, ev in stores(sink, "CPU"):
        cpu.setdefault(ev.group_idx or 0, []).extend(int(h) for h in ev.block_hashes)
    # group 0: 4-token blocks, chunks of 8 tokens; group 1: 8-token blocks, chunks of 16.
    assert cpu[0] == [gpu[0].block_hashes[i] for i in (1, 3, 5, 7)]
    assert cpu[1] == [gpu[1].block_hashes[i] for i in (1, 3)]
    index = BlockIndex(blocks_per_chunk=2, canonical_block_size=4)
    for b in sink.batches:
        index.apply("tcp://sim:1", 0, b)
    assert index.stats.joined == 6 and not index.stats.unjoined


def test_cpu_evictions_are_announced_per_group() -> None:
    e, sink = engine((4,), gpu=16, cpu=2, bpc=2)
    e.add_request(req("a", list(range(1, 18))))
    e.run_until_idle()
    e.add_request(req("b", list(range(100, 117))))
    e.run_until_idle()
    removed = [
        ev
        for b in sink.batches
        for ev in b.events
        if isinstance(ev, BlockRemoved) and ev.medium == "CPU"
    ]
    first = [ev.block_hashes[0] for _, ev in stores(sink, "CPU")][:2]
    assert sorted(h for ev in removed for h in ev.block_hashes) == sorted(first)
    assert all(ev.group_idx == 0 for ev in removed)


def test_events_do_not_depend_on_byte_transfers() -> None:
    def run(transfers: bool) -> list[object]:
        e, sink = engine((16,), gpu=40, cpu=16, bpc=2, transfers=transfers)
        for r in generate_workload(WorkloadConfig(num_requests=25, seed=2)):
            e.add_request(r)
        e.run_until_idle()
        if not transfers:
            assert e.offload is not None
            assert e.offload.stats.transfers_skipped["disabled"] > 0
        return [ev for b in sink.batches for ev in b.events]

    with_bytes, without = run(True), run(False)
    assert with_bytes == without
    assert Counter(type(ev).__name__ for ev in with_bytes)["BlockStored"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA device")
def test_a_cuda_kv_cache_round_trips_through_pinned_host_chunks() -> None:
    def run(device: str) -> tuple[list[object], SimEngine]:
        e, sink = engine((16,), gpu=40, cpu=32, bpc=2, device=device)
        for r in generate_workload(WorkloadConfig(num_requests=40, seed=6)):
            e.add_request(r)
        e.run_until_idle()
        return [ev for b in sink.batches for ev in b.events], e

    on_cpu, _ = run("cpu")
    on_gpu, e = run("cuda")
    assert on_gpu == on_cpu
    assert e.offload is not None and e.offload.worker.is_cuda
    assert e.offload.stats.blocks_copied_to_device > 0
    assert e.stats.load_mismatches == 0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    sizes=st.sampled_from([(16,), (16, 32), (8, 16)]),
    gpu=st.integers(70, 160),
    cpu=st.integers(1, 40),
    bpc=st.integers(1, 4),
    policy=st.sampled_from(["lru", "arc"]),
)
def test_the_index_fed_the_stream_holds_what_the_engine_holds(
    seed: int, sizes: tuple[int, ...], gpu: int, cpu: int, bpc: int, policy: str
) -> None:
    from kvevents.consumers import BlockIndex

    e, sink = engine(sizes, gpu=gpu, cpu=cpu, bpc=bpc, cpu_cache_policy=policy, transfers=False)
    for r in generate_workload(
        WorkloadConfig(
            num_requests=12,
            num_tenants=2,
            concurrent_sessions=3,
            system_prompt_tokens=(32, 96),
            turns_per_session=(1, 3),
            seed=seed,
        )
    ):
        e.add_request(r)
    e.run_until_idle()
    index = BlockIndex(blocks_per_chunk=bpc, canonical_block_size=min(sizes))
    for b in sink.batches:
        index.apply("tcp://sim:1", 0, b)
    assert not index.stats.unjoined and not index.stats.unknown_removals
    (summary,) = index.summary().values()
    assert summary.tiers["GPU"].entries == e.pool.num_cached
    assert e.offload is not None
    m = e.offload.manager
    assert summary.tiers["CPU"].entries == m.num_chunks - m.num_free_chunks
