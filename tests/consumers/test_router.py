"""Router: the worker a prompt should go to, from the joined index."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvevents.consumers.index import BlockIndex
from kvevents.consumers.router import Match, Router, TierWeights
from kvevents.errors import ConfigError
from kvevents.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvevents.hashing import hash_request_blocks, to_wire_hash

A, B, C = ("tcp://a:5557", 0), ("tcp://b:5557", 0), ("tcp://b:5557", 1)
SYSTEM = list(range(5000, 5256))  # a 256-token shared system prompt


def wire(tokens: Sequence[int], size: int = 16) -> list[int]:
    return [to_wire_hash(d) for d in hash_request_blocks(tokens, size, algo="sha256_cbor")]


def serve(index: BlockIndex, worker: tuple[str, int], tokens: list[int], *, offload: bool = False,
          keep_gpu: int | None = None, medium: str = "CPU") -> None:  # fmt: skip
    """The worker prefills ``tokens`` (GPU stores); optionally offloads every 2-block chunk
    and then keeps only the first ``keep_gpu`` blocks on GPU."""
    hs = wire(tokens)
    events: list[KVEvent] = [
        BlockStored(hs, None, tokens[: len(hs) * 16], 16, None, "GPU", None, group_idx=0,
                    kv_cache_spec_kind="full_attention")
    ]  # fmt: skip
    if offload:
        events += [BlockStored([h], None, [], 0, None, medium, None, group_idx=0) for h in hs[1::2]]
    if keep_gpu is not None:
        events += [BlockRemoved([h], "GPU", group_idx=0) for h in hs[keep_gpu:]]
    index.apply(worker[0], worker[1], KVEventBatch(0.0, events))


def prompt(suffix: int, n: int = 64) -> list[int]:
    return SYSTEM + [suffix * 100_000 + i for i in range(n)]


def test_long_shared_gpu_prefix_wins() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    serve(index, A, SYSTEM[:64])
    serve(index, B, prompt(1))
    serve(index, C, SYSTEM[:128])
    router = Router(index)
    p = prompt(1, 200)
    assert router.find_matches(p) == {A: Match(64), B: Match(320), C: Match(128)}
    assert router.select(p) == B
    # another user's turn shares only the system prompt, which B holds whole
    assert router.find_matches(prompt(2)) == {A: Match(64), B: Match(256), C: Match(128)}
    index.reset_worker(B)
    assert router.select(prompt(2)) == C


def test_cpu_credit_ranks_below_gpu_as_the_weights_say() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    serve(index, A, SYSTEM[:128])  # 128 tokens on GPU
    serve(index, B, SYSTEM, offload=True, keep_gpu=0)  # 256 tokens on CPU only
    serve(index, C, SYSTEM[:128], offload=True, keep_gpu=0)  # 128 tokens on CPU only
    p = prompt(3)
    default = Router(index)
    assert default.find_matches(p) == {A: Match(128), B: Match(0, 256), C: Match(0, 128)}
    # same length: GPU beats CPU; longer CPU prefix: 320 - 0.8*256 < 320 - 128
    ranked = default.score(p)
    assert [c.worker for c in ranked] == [B, A, C]
    assert ranked[0].cost == pytest.approx(len(p) - 0.8 * 256)
    # if CPU tokens are worth little, the GPU worker wins
    cheap_cpu = Router(index, weights=TierWeights(cpu=0.4))
    assert cheap_cpu.select(p) == A


def test_storage_ranks_below_cpu() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    serve(index, A, SYSTEM, offload=True, keep_gpu=0, medium="STORAGE")
    serve(index, B, SYSTEM, offload=True, keep_gpu=0)
    router = Router(index)
    assert router.find_matches(SYSTEM) == {A: Match(0, 0, 256), B: Match(0, 256, 0)}
    assert router.select(SYSTEM) == B


def test_loads_add_to_the_cost() -> None:
    index = BlockIndex()
    serve(index, A, SYSTEM[:128])
    serve(index, B, SYSTEM[:128])
    router = Router(index, load_weight=10.0)
    assert router.select(SYSTEM, loads={A: 5, B: 1}) == B
    # a worker the index has never seen can still be chosen when it is idle enough
    idle = ("tcp://idle:5557", 0)
    assert router.select(SYSTEM, loads={A: 50, B: 50, idle: 0}) == idle


def test_ties_are_broken_deterministically_by_worker_id() -> None:
    index = BlockIndex()
    for w in (C, A, B):
        serve(index, w, SYSTEM[:64])
    router = Router(index)
    assert {router.select(SYSTEM) for _ in range(5)} == {A}
    ranked = router.score(SYSTEM)
    assert [c.worker for c in ranked] == [A, B, C]
    assert len({c.cost for c in ranked}) == 1


def test_select_without_workers_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no workers"):
        Router(BlockIndex()).select(SYSTEM)


def test_prompt_shorter_than_a_unit_matches_nothing() -> None:
    index = BlockIndex()
    serve(index, A, SYSTEM[:64])
    assert Router(index).find_matches(SYSTEM[:15]) == {}
    assert Router(index).select(SYSTEM[:15]) == A


def test_a_removed_stale_worker_that_comes_back_is_scored_and_selected() -> None:
    index = BlockIndex(blocks_per_chunk=2)
    serve(index, A, SYSTEM[:64])
    index.set_stale(A)
    index.remove_worker(A)
    assert index.stale_workers == frozenset()
    # The worker comes back under the same id: matched, scored and selectable alike.
    serve(index, A, SYSTEM[:64])
    router = Router(index)
    assert router.find_matches(SYSTEM[:64])[A].gpu == 48
    assert [c.worker for c in router.score(SYSTEM[:64])] == [A]
    assert router.select(SYSTEM[:64]) == A
