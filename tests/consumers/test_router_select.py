"""``Router.select`` picks exactly ``score(...)[0].worker``, whatever the fleet, loads and weights.

``select`` finds the cheapest worker without ranking every candidate; ``score`` ranks them
all.  Differential over random fleets (GPU prefixes, CPU chunks, idle and removed workers),
loads (none, some, workers the index has never seen, ties) and weights (the defaults,
zero, negative, integer load weights), including the moments the worker set changes.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_router import serve

from kvevents.consumers.index import BlockIndex
from kvevents.consumers.router import Router, TierWeights

BASE = list(range(7000, 7000 + 16 * 12))  # 12 blocks every worker may hold a prefix of

workers = st.lists(
    st.tuples(
        st.sampled_from(["tcp://a:1", "tcp://b:1", "tcp://c:1", "x", "y"]),
        st.integers(0, 3),
        st.integers(0, 12),  # GPU prefix blocks
        st.booleans(),  # offload to CPU
        st.none() | st.integers(0, 12),  # blocks kept on GPU after offloading
    ),
    max_size=12,
)
weights = st.sampled_from(
    [
        (TierWeights(), 1.0),
        (TierWeights(), 0),
        (TierWeights(), 3),
        (TierWeights(1.0, 1.0, 1.0), 0.5),
        (TierWeights(0.0, 0.0, 0.0), 1.0),
        (TierWeights(1.0, -2.0, 0.5), 1.0),
        (TierWeights(2.0, 0.8, 0.5), -1.0),
        (TierWeights(1e-18, 1e-18, 0.0), 1e-18),  # costs that tie across loads when rounded
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workers,
    weights,
    st.integers(0, 12 * 16),
    st.none()
    | st.dictionaries(
        st.tuples(st.sampled_from(["x", "z"]), st.integers(0, 3)),
        st.sampled_from(
            [0, 0.0, 1, 2.5, 16, 64, 100.0, -3.0, 1e-13, float("inf"), float("-inf"), float("nan")]
        ),
        max_size=6,
    ),
    st.booleans(),
    st.data(),
)
def test_select_is_the_first_of_score(
    fleet: list[Any],
    wts: tuple[TierWeights, float],
    prompt_len: int,
    extra_loads: dict[Any, float] | None,
    remove_one: bool,
    data: st.DataObject,
) -> None:
    index = BlockIndex(blocks_per_chunk=2)
    router = Router(index, wts[0], load_weight=wts[1])
    for source, rank, blocks, offload, keep in fleet:
        if blocks:
            serve(index, (source, rank), BASE[: blocks * 16], offload=offload, keep_gpu=keep)
    prompt = BASE[:prompt_len]
    loads: dict[Any, float] | None = None
    if extra_loads is not None:
        loads = dict(extra_loads)
        for wid in index.workers():  # loads for some of the index's workers
            if data.draw(st.booleans()):
                loads[wid] = data.draw(
                    st.sampled_from([0, 1, 2.0, 16, 0.5, -1.0, 1e-13, float("nan"), float("-inf")])
                )
    for step in range(2):
        ranked = router.score(prompt, loads)
        if not ranked:
            try:
                router.select(prompt, loads)
            except Exception as exc:  # the same error as before
                assert type(exc).__name__ == "ConfigError"
            else:
                raise AssertionError("select found a worker where score has none")
        else:
            assert router.select(prompt, loads) == ranked[0].worker
        if step == 0:  # the worker set changes under the router's cache
            if remove_one and index.workers():
                index.remove_worker(index.workers()[0])
            else:
                serve(index, ("w", 9), BASE[:32])
