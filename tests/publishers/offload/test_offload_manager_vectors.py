"""CONTRACT C§8.4: the CPUOffloadingManager vectors, for both cache policies."""

from __future__ import annotations

import dataclasses

import pytest

from kvevents.errors import OffloadError
from kvevents.publishers.offload import (
    ARCCachePolicy,
    CachePolicy,
    CPUOffloadingManager,
    LookupResult,
    LRUCachePolicy,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    get_cache_policy,
    get_offload_block_hash,
    get_offload_group_idx,
    known_cache_policies,
    make_offload_key,
    register_cache_policy,
)

POLICIES = ["lru", "arc"]
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def K(i: int) -> OffloadKey:
    return make_offload_key(str(i).encode(), 0)


def Ks(*ids: int) -> list[OffloadKey]:
    return [K(i) for i in ids]


def ids_of(keys: list[OffloadKey]) -> list[int]:
    return [int(k[:-4]) for k in keys]


def summarize(events: list[OffloadingEvent]) -> list[tuple[str, str, list[int], bool]]:
    return [
        ("removed" if e.removed else "stored", e.medium, sorted(ids_of(e.keys)), e.metadata_only)
        for e in events
    ]


def store(m: CPUOffloadingManager, ids: list[int], ctx: ReqContext) -> tuple[list[int], list[int]]:
    out = m.prepare_store(Ks(*ids), ctx)
    assert out is not None
    return out.store_spec.block_ids.tolist(), ids_of(out.evicted_keys)


@pytest.mark.parametrize("policy", POLICIES)
def test_contract_script_step_by_step(policy: str) -> None:
    m = CPUOffloadingManager(num_chunks=4, cache_policy=policy, enable_events=True)
    ctx = ReqContext(req_id="script")

    # 1
    out = m.prepare_store(Ks(1, 2), ctx)
    assert out is not None
    assert ids_of(out.keys_to_store) == [1, 2]
    assert out.store_spec.block_ids.tolist() == [0, 1]
    assert out.evicted_keys == []
    # 2
    assert [m.lookup(K(1), ctx), m.lookup(K(2), ctx)] == [PENDING, PENDING]
    assert m.take_events() == []
    # 3
    m.complete_store(Ks(1, 2), ctx)
    assert summarize(m.take_events()) == [("stored", "CPU", [1, 2], False)]
    # 4
    assert [m.lookup(K(i), ctx) for i in (1, 2, 3)] == [HIT, HIT, MISS]
    # 5
    out = m.prepare_store(Ks(2, 3, 4, 5), ctx)
    assert out is not None
    assert ids_of(out.keys_to_store) == [3, 4, 5]
    assert out.store_spec.block_ids.tolist() == [2, 3, 0]
    assert ids_of(out.evicted_keys) == [1]
    assert summarize(m.take_events()) == [("removed", "CPU", [1], False)]
    # 6: needs 2 chunks; only key 2 is evictable (3, 4, 5 pending)
    assert m.prepare_store(Ks(1, 6), ctx) is None
    assert m.stats.store_refusals["no_space"] == 1
    # 7
    m.complete_store(Ks(2, 3, 4, 5), ctx)
    assert [m.lookup(K(i), ctx) for i in (1, 2, 3, 4, 5, 0)] == [MISS, HIT, HIT, HIT, HIT, MISS]
    # 8
    assert m.prepare_load(Ks(2, 3), ctx).block_ids.tolist() == [1, 2]
    # 9: 2 and 3 pinned
    assert m.prepare_store(Ks(6, 7, 8), ctx) is None
    # 10
    m.complete_load(Ks(2, 3), ctx)
    out = m.prepare_store(Ks(6, 7, 8), ctx)
    assert out is not None
    assert ids_of(out.keys_to_store) == [6, 7, 8]
    assert out.store_spec.block_ids.tolist() == [3, 2, 1]
    assert ids_of(out.evicted_keys) == [2, 3, 4]
    # 11
    m.complete_store(Ks(6, 7, 8), ctx)
    m.touch(Ks(5, 6, 7), ctx)
    # 12
    assert store(m, [9], ctx) == ([1], [8])
    # 13
    m.complete_store(Ks(7, 9), ctx, success=False)
    assert [m.lookup(K(7), ctx), m.lookup(K(9), ctx)] == [HIT, MISS]
    # 14
    assert summarize(m.take_events()) == [
        ("stored", "CPU", [3, 4, 5], False),
        ("removed", "CPU", [2, 3, 4], False),
        ("stored", "CPU", [6, 7, 8], False),
        ("removed", "CPU", [8], False),
        ("removed", "CPU", [9], True),
    ]
    assert m.take_events() == []

    if policy == "arc":
        arc = m.policy
        assert isinstance(arc, ARCCachePolicy)
        assert ids_of(list(arc.t1)) == []
        assert ids_of(list(arc.t2)) == [7, 6, 5]  # 5 is MRU
        assert ids_of(list(arc.b1)) == [2, 3, 4, 8]
        assert ids_of(list(arc.b2)) == []
        assert arc.target_t1_size == 0.0


@pytest.mark.parametrize("policy", POLICIES)
def test_offered_key_already_stored_is_not_evicted_by_its_own_offer(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    ctx = ReqContext()
    store(m, [1, 2], ctx)
    m.complete_store(Ks(1, 2), ctx)
    m.touch([K(1)], ctx)
    out = m.prepare_store(Ks(2, 3, 4, 5), ctx)
    assert out is not None
    assert ids_of(out.keys_to_store) == [3, 4, 5]
    assert out.store_spec.block_ids.tolist() == [2, 3, 0]
    assert ids_of(out.evicted_keys) == [1]
    assert m.lookup(K(2)) == HIT


@pytest.mark.parametrize("policy", POLICIES)
def test_load_spec_follows_key_order(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    assert store(m, [0, 1, 2], ReqContext()) == ([0, 1, 2], [])
    m.complete_store(Ks(0, 1, 2))
    assert m.prepare_load(Ks(1, 2, 0)).block_ids.tolist() == [1, 2, 0]


@pytest.mark.parametrize("policy", POLICIES)
def test_store_threshold_two(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy, store_threshold=2)
    ctx = ReqContext()
    out = m.prepare_store(Ks(1, 2, 3), ctx)
    assert out is not None and out.keys_to_store == []
    assert m.stats.stores_skipped == 3
    out = m.prepare_store(Ks(1, 2), ctx)
    assert out is not None
    assert ids_of(out.keys_to_store) == [1, 2]
    assert out.store_spec.block_ids.tolist() == [0, 1]


@pytest.mark.parametrize("touch", [True, False])
def test_lru_touch_makes_first_key_most_recent(touch: bool) -> None:
    m = CPUOffloadingManager(3, cache_policy="lru")
    store(m, [1, 2, 3], ReqContext())
    m.complete_store(Ks(1, 2, 3))
    if touch:
        m.touch(Ks(1, 2, 3))
    out = m.prepare_store([K(4)])
    assert out is not None
    assert ids_of(out.evicted_keys) == ([3] if touch else [1])


def test_lru_request_ranks_finished_request_tail_goes_first() -> None:
    m = CPUOffloadingManager(3, cache_policy="lru")
    r1 = ReqContext(req_id="r1")
    for i, pos in zip((1, 2, 3), (16, 32, 48)):
        r1.set_position(K(i), pos)
    store(m, [1, 2, 3], r1)
    m.complete_store(Ks(1, 2, 3), r1)
    m.on_request_finished(r1)
    out = m.prepare_store([K(4)], ReqContext(req_id="r2"))
    assert out is not None
    assert ids_of(out.evicted_keys) == [3]


def test_lru_finished_request_head_outlives_older_request() -> None:
    # Request ranks order requests: a later request's chunks outlive an earlier one's.
    m = CPUOffloadingManager(4, cache_policy="lru")
    r1, r2 = ReqContext(req_id="r1"), ReqContext(req_id="r2")
    for ctx, ids in ((r1, [1, 2]), (r2, [3, 4])):
        for n, i in enumerate(ids):
            ctx.set_position(K(i), 16 * (n + 1))
        store(m, ids, ctx)
        m.complete_store(Ks(*ids), ctx)
    out = m.prepare_store(Ks(5, 6), ReqContext(req_id="r3"))
    assert out is not None
    assert ids_of(out.evicted_keys) == [2, 1]  # r1 first, its tail before its head


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_store_is_metadata_only_and_filtered_after_reallocation(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    m.prepare_store([K(1)])
    m.complete_store([K(1)], success=False)
    assert summarize(m.take_events()) == [("removed", "CPU", [1], True)]

    m.prepare_store([K(1)])
    m.complete_store([K(1)], success=False)
    m.prepare_store([K(1)])  # a retry owns the key again before the drain
    assert m.take_events() == []
    assert m.stats.metadata_keys_filtered == 1
    assert m.lookup(K(1)) == PENDING


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_emits_nothing_and_forgets_everything(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    store(m, [1, 2], ReqContext())
    m.complete_store(Ks(1, 2))
    m.take_events()
    m.reset_cache()
    assert m.take_events() == []
    assert m.lookup(K(1)) == MISS
    assert m.num_free_chunks == 4
    assert store(m, [3], ReqContext()) == ([0], [])  # fresh ids again


def test_arc_adaptation_vector() -> None:
    m = CPUOffloadingManager(2, cache_policy="arc")
    arc = m.policy
    assert isinstance(arc, ARCCachePolicy)
    ctx = ReqContext()
    store(m, [1, 2], ctx)
    m.complete_store(Ks(1, 2), ctx)
    assert ids_of(list(arc.t1)) == [1, 2] and arc.target_t1_size == 0.0
    # 1
    assert store(m, [3], ctx) == ([0], [1])
    assert ids_of(list(arc.b1)) == [1]
    m.complete_store([K(3)], ctx)
    # 2: B1 ghost hit
    m.touch([K(1)], ctx)
    assert arc.target_t1_size == 1.0
    # 3
    m.touch([K(2)], ctx)
    assert ids_of(list(arc.t1)) == [3] and ids_of(list(arc.t2)) == [2]
    # 4: |T1| = 1 >= int(p) = 1, so T1's 3 goes
    assert store(m, [4], ctx)[1] == [3]
    assert ids_of(list(arc.b1)) == [1, 3]


def test_events_off_by_default() -> None:
    m = CPUOffloadingManager(2)
    store(m, [1, 2], ReqContext())
    m.complete_store(Ks(1, 2))
    assert m.take_events() == []


def test_unknown_policy_lists_known_names() -> None:
    with pytest.raises(OffloadError, match=r"unknown cache policy 'fifo'.*arc, lru"):
        CPUOffloadingManager(4, cache_policy="fifo")
    assert {"lru", "arc"} <= set(known_cache_policies())


def test_user_policy_can_be_registered() -> None:
    class NewestFirst(LRUCachePolicy):
        """LRU variant registered under its own name."""

    register_cache_policy("newest-first-test", NewestFirst)
    assert get_cache_policy("newest-first-test") is NewestFirst
    m = CPUOffloadingManager(2, cache_policy="newest-first-test")
    assert isinstance(m.policy, NewestFirst)
    with pytest.raises(OffloadError, match="already registered"):
        register_cache_policy("lru", NewestFirst)
    with pytest.raises(OffloadError, match="not a CachePolicy"):
        register_cache_policy("bad", dict)  # type: ignore[arg-type]
    assert issubclass(get_cache_policy("arc"), CachePolicy)


def test_policy_from_module_path() -> None:
    cls = get_cache_policy("ARCCachePolicy", "kvevents.publishers.offload.policies.arc")
    assert cls is ARCCachePolicy
    with pytest.raises(OffloadError, match="cannot import"):
        get_cache_policy("X", "kvevents.no_such_module")


@pytest.mark.parametrize("policy", POLICIES)
def test_misuse_raises_and_changes_nothing(policy: str) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    store(m, [1, 2], ReqContext())
    m.complete_store([K(1)])
    with pytest.raises(OffloadError, match="still being written"):
        m.prepare_load(Ks(1, 2))
    with pytest.raises(OffloadError, match="not on this tier"):
        m.prepare_load(Ks(1, 9))
    status = m.chunk_status(K(1))
    assert status is not None and status.ref_cnt == 0  # nothing was pinned
    with pytest.raises(OffloadError, match="not pinned"):
        m.complete_load([K(1)])
    m.prepare_load([K(1)])
    with pytest.raises(OffloadError, match="not pinned 2"):
        m.complete_load(Ks(1, 1))
    assert status.ref_cnt == 1


def test_offload_key_layout_and_accessors() -> None:
    key = make_offload_key(b"\x01\x02\x03", 7)
    assert key == b"\x01\x02\x03\x00\x00\x00\x07"
    assert get_offload_block_hash(key) == b"\x01\x02\x03"
    assert get_offload_group_idx(key) == 7
    assert get_offload_group_idx(make_offload_key(b"h", 2**32 - 1)) == 2**32 - 1
    with pytest.raises(OffloadError, match="4 unsigned bytes"):
        make_offload_key(b"h", 2**32)
    with pytest.raises(OffloadError, match="too short"):
        get_offload_group_idx(b"\x00\x00\x00\x01")


def test_offloading_event_shape_has_no_block_size() -> None:
    # C§9.11: (keys, medium, removed, locality, ownership, removal_expected, metadata_only)
    assert [f.name for f in dataclasses.fields(OffloadingEvent)] == [
        "keys",
        "medium",
        "removed",
        "locality",
        "ownership",
        "removal_expected",
        "metadata_only",
    ]
    ev = OffloadingEvent([K(1)], "CPU", removed=False)
    assert (ev.locality, ev.ownership, ev.removal_expected, ev.metadata_only) == (
        None,
        None,
        False,
        False,
    )


# --- what a request's finish hands to the policy (C§5.4 prepare_store steps 2 and 5) ---


def test_arc_ready_key_offered_for_storing_counts_as_reused_at_finish() -> None:
    # prepare_store step 2: an offered key that is present and ready is *reused*, so at
    # the request's finish ARC promotes it to T2 just as it would a loaded key.
    m = CPUOffloadingManager(num_chunks=4, cache_policy="arc")
    first = ReqContext(req_id="first")
    m.prepare_store(Ks(1), first)
    m.complete_store(Ks(1), first)
    m.on_request_finished(first)
    policy = m.policy
    assert isinstance(policy, ARCCachePolicy)
    assert K(1) in policy.t1

    second = ReqContext(req_id="second")
    out = m.prepare_store(Ks(1, 2), second)
    assert out is not None and ids_of(out.keys_to_store) == [2]
    m.complete_store(Ks(2), second)
    m.on_request_finished(second)
    assert list(policy.t2) == [K(1)]
    assert list(policy.t1) == [K(2)]


def test_lru_finish_does_not_touch_a_key_another_request_is_still_writing() -> None:
    # prepare_store records only its store candidates and the ready keys it reuses; a key
    # offered while another request's write of it is in flight is neither, so this
    # request's finish leaves its recency alone.
    m = CPUOffloadingManager(num_chunks=2, cache_policy="lru")
    writer = ReqContext(req_id="writer")
    m.prepare_store(Ks(1), writer)
    reader = ReqContext(req_id="reader")
    reader.set_position(K(1), 16)
    reader.set_position(K(2), 32)
    out = m.prepare_store(Ks(1, 2), reader)
    assert out is not None and ids_of(out.keys_to_store) == [2]
    m.complete_store(Ks(1), writer)
    m.complete_store(Ks(2), reader)
    m.on_request_finished(writer)
    m.on_request_finished(reader)
    # The reader's finish made K(2) the most recent; K(1) was last touched by the writer.
    assert store(m, [3], ReqContext(req_id="next")) == ([0], [1])


def _two_group_request() -> tuple[ReqContext, list[OffloadKey]]:
    """A hybrid request: group 1 (16-token chunks) is offered before group 0 (32)."""
    ctx = ReqContext(req_id="hybrid")
    g1 = [make_offload_key(f"g1-{p}".encode(), 1) for p in (16, 32, 48, 64)]
    g0 = [make_offload_key(f"g0-{p}".encode(), 0) for p in (32, 64)]
    for key, pos in zip(g1, (16, 32, 48, 64)):
        ctx.set_position(key, pos)
    for key, pos in zip(g0, (32, 64)):
        ctx.set_position(key, pos)
    return ctx, g1 + g0


def _label(key: OffloadKey) -> str:
    return get_offload_block_hash(key).decode()


# C§5.5: at a request's finish the policy walks *all* of the request's keys tail to head
# (one order over every KV group, by token position; groups by index, then first seen,
# when positions are missing), so the head ends most recent whatever its group.
HEAD_TO_TAIL = ["g1-16", "g0-32", "g1-32", "g1-48", "g0-64", "g1-64"]


def test_lru_finish_orders_a_hybrid_request_by_position_across_groups() -> None:
    m = CPUOffloadingManager(num_chunks=6, cache_policy="lru")
    ctx, keys = _two_group_request()
    m.prepare_store(keys[:4], ctx)
    m.prepare_store(keys[4:], ctx)
    m.complete_store(keys, ctx)
    m.on_request_finished(ctx)
    evicted: list[str] = []
    for i in range(6):
        out = m.prepare_store([K(100 + i)], ReqContext(req_id=f"n{i}"))
        assert out is not None
        evicted += [_label(k) for k in out.evicted_keys]
    assert evicted == HEAD_TO_TAIL[::-1]


def test_arc_finish_orders_a_hybrid_request_by_position_across_groups() -> None:
    m = CPUOffloadingManager(num_chunks=6, cache_policy="arc")
    ctx, keys = _two_group_request()
    m.prepare_store(keys[:4], ctx)
    m.prepare_store(keys[4:], ctx)
    m.complete_store(keys, ctx)
    m.on_request_finished(ctx)
    policy = m.policy
    assert isinstance(policy, ARCCachePolicy)
    assert [_label(k) for k in policy.t1] == HEAD_TO_TAIL[::-1]  # LRU end first


def test_lru_request_rank_is_drawn_afresh_after_a_reset() -> None:
    # A request that spans reset_cache() gets a new request rank: its later stores are
    # as recent as the stores of requests that started after the reset.
    m = CPUOffloadingManager(num_chunks=2, cache_policy="lru")
    long_running = ReqContext(req_id="long")
    long_running.set_position(K(1), 16)
    long_running.set_position(K(3), 32)
    store(m, [1], long_running)
    m.complete_store(Ks(1), long_running)
    m.reset_cache()
    newcomer = ReqContext(req_id="new")
    store(m, [2], newcomer)
    store(m, [3], long_running)
    m.complete_store(Ks(2), newcomer)
    m.complete_store(Ks(3), long_running)
    assert store(m, [4], ReqContext(req_id="next")) == ([0], [2])


def test_constructor_takes_vllm_arguments_by_name() -> None:
    # C§5.4: CPUOffloadingManager(num_chunks, cache_policy, cache_policy_module_path,
    # enable_events, store_threshold, max_tracker_size, info).
    info = {"tier": "cpu", "bytes": 1 << 20}
    m = CPUOffloadingManager(
        num_chunks=2,
        cache_policy="arc",
        cache_policy_module_path=None,
        enable_events=True,
        store_threshold=1,
        max_tracker_size=10,
        info=info,
    )
    assert m.info == info
    assert m.config_info() == info
    assert CPUOffloadingManager(2).config_info() == {}
