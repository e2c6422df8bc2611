"""``Router.select`` from the walk's per-slot ends: when one slot in eight or more has a
match, ``select`` prices every slot in C loops instead of building a ``Match`` per
worker.  Differential against ``score(...)[0].worker`` over fleets where most workers
hold the prompt on GPU, CPU and STORAGE, with tier weights that tell the tiers apart,
loads and load weights; each example checks which path was taken."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_router import wire

from kvevents.consumers.index import BlockIndex
from kvevents.consumers.router import Router, TierWeights
from kvevents.consumers.router import router as router_module
from kvevents.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch

BASE = list(range(9000, 9000 + 16 * 12))  # 12 blocks, 6 chunks of 2 blocks
HASHES = wire(BASE)


def hold(index: BlockIndex, worker: tuple[str, int], blocks: int, cpu: int, storage: int,
         keep_gpu: int) -> None:  # fmt: skip
    """``worker`` prefills the first ``blocks`` blocks, offloads its first ``cpu`` chunks
    to CPU and the ``storage`` chunks after them to STORAGE, then keeps ``keep_gpu``
    blocks on GPU."""
    hs = HASHES[:blocks]
    events: list[KVEvent] = [
        BlockStored(hs, None, BASE[: blocks * 16], 16, None, "GPU", None, group_idx=0,
                    kv_cache_spec_kind="full_attention")
    ]  # fmt: skip
    tails = hs[1::2]  # each 2-block chunk is named by its last block
    for i, h in enumerate(tails[: cpu + storage]):
        medium = "CPU" if i < cpu else "STORAGE"
        events.append(BlockStored([h], None, [], 0, None, medium, None, group_idx=0))
    events += [BlockRemoved([h], "GPU", group_idx=0) for h in hs[keep_gpu:]]
    index.apply(worker[0], worker[1], KVEventBatch(0.0, events))


@contextmanager
def slot_pricing_calls() -> Iterator[list[int]]:
    """Count the calls of ``select``'s slot path (``slot_costs``) while inside."""
    calls: list[int] = []
    original = router_module.slot_costs

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(router_module, "slot_costs", counted)
        yield calls


fleet = st.lists(
    st.tuples(
        st.integers(1, 12),  # blocks prefilled
        st.integers(0, 6),  # chunks offloaded to CPU
        st.integers(0, 6),  # chunks after them on STORAGE
        st.integers(1, 4),  # blocks kept on GPU (most workers hold some of the prompt)
    ),
    min_size=1,
    max_size=14,
)
weights = st.sampled_from(
    [
        (TierWeights(), 1.0),
        (TierWeights(1.0, 0.3, 0.9), 0.5),
        (TierWeights(2.0, 1.5, 0.25), 3),
        (TierWeights(1.0, 1.0, 1.0), 0),
        (TierWeights(0.5, 0.8, 0.8), 2.0),
        (TierWeights(1e-18, 1e-18, 1e-18), 1e-18),  # costs that tie when rounded
        (TierWeights(1.0, 0.8, 0.5), -1.0),  # a negative load weight
    ]
)
load_values = st.sampled_from([0, 0.0, 1, 2.5, 16, 64.0, -3.0, 1e-13, float("inf")])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet, weights, st.integers(32, 12 * 16), st.booleans(), st.data())
def test_select_from_slot_ends_is_the_first_of_score(
    workers: list[tuple[int, int, int, int]],
    wts: tuple[TierWeights, float],
    prompt_len: int,
    with_loads: bool,
    data: st.DataObject,
) -> None:
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index, wts[0], load_weight=wts[1])
    for i, (blocks, cpu, storage, keep) in enumerate(workers):
        hold(index, (f"tcp://w{i}:1", i % 2), blocks, cpu, storage, keep)
    loads: dict[Any, float] | None = None
    if with_loads:
        loads = {}
        for wid in [*index.workers(), ("tcp://only-a-load:1", 0)]:
            if data.draw(st.booleans()):
                loads[wid] = data.draw(load_values)
    prompt = BASE[:prompt_len]
    with slot_pricing_calls() as taken:
        ranked = router.score(prompt, loads)
        assert router.select(prompt, loads) == ranked[0].worker
    # the slot path is taken exactly when one slot in eight or more has a match
    matched = len(router.find_matches(prompt))
    assert bool(taken) == (matched * 8 >= index.layout().nslots)


def test_a_fleet_where_few_hold_the_prompt_builds_the_matches() -> None:
    # One worker of twenty holds the prompt: fewer than one slot in eight has a match,
    # so select builds the one Match rather than pricing twenty slots.
    index = BlockIndex(blocks_per_chunk=2)
    hold(index, ("tcp://holder:1", 0), 8, 2, 1, 4)
    for i in range(19):
        other = [i] * 32
        store = BlockStored(wire(other), None, other, 16, None, "GPU", None, group_idx=0)
        index.apply(f"tcp://other{i}:1", 0, KVEventBatch(0.0, [store]))
    router = Router(index)
    with slot_pricing_calls() as taken:
        assert router.select(BASE) == ("tcp://holder:1", 0)
    assert not taken
