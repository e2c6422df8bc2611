"""Minimal reproductions of where the manager once decided differently from vLLM 0.33.

Each test is one short call sequence whose outcome vLLM 0.33's ``CPUOffloadingManager``
and its policies decide; the expected values come from vLLM's rules (the manager's
``_record_request_cache_access`` / ``take_events``, LRU's ``on_request_access``), not
from this project's code.  The long random sequences live in
``test_offload_differential.py``.
"""

from __future__ import annotations

import pytest

from kvevents.publishers.offload import (
    ARCCachePolicy,
    CPUOffloadingManager,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    make_offload_key,
)


def K(name: str) -> OffloadKey:
    return make_offload_key(name.encode(), 0)


def events(m: CPUOffloadingManager) -> list[tuple[str, list[str], bool]]:
    def kind(e: OffloadingEvent) -> str:
        return "removed" if e.removed else "stored"

    return [(kind(e), [k[:-4].decode() for k in e.keys], e.metadata_only) for e in m.take_events()]


def evicted(m: CPUOffloadingManager, name: str, ctx: ReqContext) -> list[str]:
    out = m.prepare_store([K(name)], ctx)
    assert out is not None
    m.complete_store([K(name)], ctx)
    return [k[:-4].decode() for k in out.evicted_keys]


def positioned(req_id: str, **positions: int) -> ReqContext:
    ctx = ReqContext(req_id=req_id)
    for name, pos in positions.items():
        ctx.set_position(K(name), pos)
    return ctx


# --- cause 1: a failed store's key is reported iff it is absent when events are drained ---


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_failed_key_stored_and_evicted_before_the_drain_is_still_reported(policy: str) -> None:
    # The reproduction: vLLM keeps the metadata_only key because A is absent from
    # the policy at the drain, whatever happened to it in between.
    m = CPUOffloadingManager(1, cache_policy=policy, enable_events=True)
    ctx = ReqContext(req_id="r")
    m.prepare_store([K("A")], ctx)
    m.complete_store([K("A")], ctx, success=False)
    m.prepare_store([K("A")], ctx)
    m.complete_store([K("A")], ctx)
    m.prepare_store([K("B")], ctx)
    assert events(m) == [
        ("removed", ["A"], True),
        ("stored", ["A"], False),
        ("removed", ["A"], False),
    ]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_key_failing_twice_before_the_drain_is_reported_in_both_events(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy, enable_events=True)
    ctx = ReqContext(req_id="r")
    for _ in range(2):
        m.prepare_store([K("A")], ctx)
        m.complete_store([K("A")], ctx, success=False)
    assert events(m) == [("removed", ["A"], True), ("removed", ["A"], True)]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_failed_keys_pending_report_survive_a_cache_reset(policy: str) -> None:
    # reset_cache emits nothing and drops no undrained event: after it the failed key is
    # absent, so its metadata_only release is still reported.
    m = CPUOffloadingManager(2, cache_policy=policy, enable_events=True)
    ctx = ReqContext(req_id="r")
    m.prepare_store([K("A"), K("B")], ctx)
    m.complete_store([K("A")], ctx)
    m.complete_store([K("B")], ctx, success=False)
    m.reset_cache()
    assert events(m) == [("stored", ["A"], False), ("removed", ["B"], True)]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_failed_key_present_again_at_the_drain_is_dropped(policy: str) -> None:
    m = CPUOffloadingManager(2, cache_policy=policy, enable_events=True)
    ctx = ReqContext(req_id="r")
    m.prepare_store([K("A"), K("B")], ctx)
    m.complete_store([K("A"), K("B")], ctx, success=False)
    m.prepare_store([K("A")], ctx)
    assert events(m) == [("removed", ["B"], True)]
    assert m.stats.metadata_keys_filtered == 1


# --- cause 2: loads raise recency; a request raises each key once ---------------------


def test_lru_a_load_raises_the_key_to_the_loading_requests_rank() -> None:
    m = CPUOffloadingManager(2, cache_policy="lru")
    r1 = positioned("r1", A=16)
    evicted(m, "A", r1)
    m.on_request_finished(r1)  # A: a fresh rank
    r2 = positioned("r2", B=16)
    evicted(m, "B", r2)  # r2 ranks after A's touch
    r3 = positioned("r3", A=16)
    m.prepare_load([K("A")], r3)  # r3's rank is newer than r2's: A is raised above B
    m.complete_load([K("A")], r3)
    assert evicted(m, "C", ReqContext(req_id="r4")) == ["B"]


def test_lru_a_request_raises_a_reused_key_only_on_its_first_access() -> None:
    m = CPUOffloadingManager(2, cache_policy="lru")
    r0 = positioned("r0", A=16)
    r1 = positioned("r1", A=16, E=32)
    r2 = ReqContext(req_id="r2")
    evicted(m, "A", r0)  # r0's rank (the oldest): A = (r0, -16)
    out = m.prepare_store([K("A")], r1)  # r1 reuses A: raised to (r1, -16)
    assert out is not None and out.keys_to_store == []
    assert evicted(m, "B", r2) == []
    assert evicted(m, "C", r2) == ["A"]
    assert evicted(m, "A", r0) == ["B"]  # r0 re-stores A at (r0, -16)
    # r1 offers A again: r1 has seen A already, so vLLM does not raise it a second time.
    out = m.prepare_store([K("E"), K("A")], r1)
    assert out is not None and [k[:-4] for k in out.evicted_keys] == [b"C"]
    m.complete_store([K("E")], r1)
    # A = (r0, -16) ranks below E = (r1, -32).
    assert evicted(m, "D", ReqContext(req_id="r3")) == ["A"]


# --- cause 3: a key the request inserted is not *reused* when it loads it ----------------


def test_arc_a_key_inserted_then_loaded_by_the_same_request_is_insertion_only() -> None:
    m = CPUOffloadingManager(4, cache_policy="arc")
    ctx = ReqContext(req_id="r")
    m.prepare_store([K("A")], ctx)
    m.complete_store([K("A")], ctx)
    m.prepare_load([K("A")], ctx)
    m.complete_load([K("A")], ctx)
    m.on_request_finished(ctx)
    arc = m.policy
    assert isinstance(arc, ARCCachePolicy)
    assert list(arc.t1) == [K("A")] and list(arc.t2) == []


def test_arc_a_key_loaded_before_the_request_inserts_it_again_is_reused() -> None:
    m = CPUOffloadingManager(1, cache_policy="arc")
    first, second = ReqContext(req_id="first"), ReqContext(req_id="second")
    evicted(m, "A", first)
    m.prepare_load([K("A")], second)
    m.complete_load([K("A")], second)
    assert evicted(m, "B", first) == ["A"]
    assert evicted(m, "A", second) == ["B"]  # inserted after its reuse: stays reused
    m.on_request_finished(second)
    arc = m.policy
    assert isinstance(arc, ARCCachePolicy)
    assert list(arc.t2) == [K("A")]


# --- cause 4: LRU takes the request's rank on every access, raised key or not ------------


def test_lru_request_rank_is_taken_by_an_access_that_raises_nothing() -> None:
    m = CPUOffloadingManager(2, cache_policy="lru")
    r0 = ReqContext(req_id="r0")
    m.prepare_store([K("X1"), K("X2")], r0)  # pending: nothing is evictable
    r1 = positioned("r1", A=16)
    assert m.prepare_store([K("A")], r1) is None  # r1's rank is taken here
    m.complete_store([K("X1"), K("X2")], r0)
    assert evicted(m, "Y", ReqContext(req_id="r2")) == ["X1"]  # Y ranks after r1
    assert evicted(m, "A", r1) == ["X2"]  # A = (r1, -16), older than Y
    assert evicted(m, "Z", ReqContext(req_id="r3")) == ["A"]
