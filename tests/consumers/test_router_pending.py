"""The pending overlay: what a router just routed, credited apart from confirmed state,
bounded, expiring, and ended by the worker's events (confirmed) or its request's end
(contradicted)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.consumers.content import prompt_keys
from kvevents.consumers.index import BlockIndex
from kvevents.consumers.router import Match, PendingOverlay, Router
from kvevents.consumers.router.pending import ENTRY_BYTES, KEY_BYTES
from kvevents.errors import ConfigError
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.hashing import hash_request_blocks, to_wire_hash
from kvevents.request import RequestKey

A, B = ("tcp://a:5557", 0), ("tcp://b:5557", 0)
CONTEXT = list(range(7000, 7000 + 512))  # a long shared context: 32 blocks


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def stored(index: BlockIndex, worker: tuple[str, int], tokens: list[int]) -> list[int]:
    """The worker's engine prefilled ``tokens``: its GPU stores, as vLLM publishes them."""
    hs = [to_wire_hash(d) for d in hash_request_blocks(tokens, 16, algo="sha256_cbor")]
    ev = BlockStored(hs, None, tokens[: len(hs) * 16], 16, None, "GPU", None, group_idx=0,
                     kv_cache_spec_kind="full_attention")  # fmt: skip
    index.apply(worker[0], worker[1], KVEventBatch(0.0, [ev]))
    return hs


def sibling(i: int, n: int = 40) -> list[int]:
    """A burst sibling: the shared context, then its own last message."""
    return CONTEXT + [900_000 + 1000 * i + j for j in range(n)]


def test_a_burst_lands_together_and_confirmed_state_takes_over() -> None:
    clock = Clock()
    index = BlockIndex()
    stored(index, B, [1, 2, 3] * 20)  # B is known, holds nothing useful
    ov = PendingOverlay(ttl_s=5.0, clock=clock)
    router = Router(index, pending=ov, pending_weight=0.5)
    loads = {A: 0.0, B: 0.0}
    # the first sibling: nothing anywhere, ties go to A; routed there
    first = sibling(0)
    assert router.select(first, loads) == A
    rid = router.reserve(first, A)
    assert rid is not None and len(ov) == 1
    # the second sibling, before A's events: A is credited the shared context, pending
    ranked = router.score(sibling(1), {A: 0.0, B: 0.0})
    assert ranked[0].worker == A
    assert ranked[0].match == Match() and ranked[0].pending == len(CONTEXT)
    assert ranked[0].cost == pytest.approx(len(sibling(1)) - 0.5 * len(CONTEXT))
    # never as GPU truth: find_matches is confirmed state only
    assert router.find_matches(sibling(1)) == {}
    # A's events arrive: confirmed state takes over, nothing is credited twice
    stored(index, A, first)
    ranked = router.score(sibling(1), loads)
    assert ranked[0].worker == A and ranked[0].match.gpu == len(CONTEXT)
    assert ranked[0].pending == 0
    ov.reconcile(index)
    assert len(ov) == 0 and ov.stats.confirmed == 1 and ov.nbytes == 0


def test_pending_beyond_a_partial_confirmed_prefix_only() -> None:
    index = BlockIndex()
    ov = PendingOverlay()
    router = Router(index, pending=ov, pending_weight=1.0)
    router.reserve(sibling(0), A)
    stored(index, A, CONTEXT[:128])  # the first chunk of A's prefill is published
    (a,) = [c for c in router.score(sibling(1), {A: 0.0}) if c.worker == A]
    assert a.match.gpu == 128 and a.pending == len(CONTEXT) - 128


def test_ttl_expiry_leaves_no_credit() -> None:
    clock = Clock()
    index = BlockIndex()
    ov = PendingOverlay(ttl_s=2.0, clock=clock)
    router = Router(index, pending=ov)
    router.reserve(sibling(0), A)
    assert router.score(sibling(1), {A: 0.0, B: 0.0})[0].pending == len(CONTEXT)
    clock.t += 2.0
    ranked = router.score(sibling(1), {A: 0.0, B: 0.0})
    assert all(c.pending == 0 for c in ranked) and len(ov) == 0
    assert ov.stats.expired == 1 and ov.stats.contradicted == 0


def test_finished_without_stores_is_contradicted_after_the_grace() -> None:
    clock = Clock()
    index = BlockIndex()
    ov = PendingOverlay(ttl_s=30.0, grace_s=0.5, clock=clock)
    router = Router(index, pending=ov)
    rid = router.reserve(sibling(0), A)
    assert rid is not None
    ov.finished(rid, index)
    clock.t += 0.4
    assert router.score(sibling(1), {A: 0.0})[0].pending == len(CONTEXT)
    clock.t += 0.2
    assert router.score(sibling(1), {A: 0.0})[0].pending == 0
    assert ov.stats.contradicted == 1


def test_finished_with_stores_is_confirmed_and_removed_blocks_contradict() -> None:
    clock = Clock()
    index = BlockIndex()
    ov = PendingOverlay(ttl_s=30.0, grace_s=0.5, clock=clock)
    router = Router(index, pending=ov)
    rid = router.reserve(sibling(0), A)
    assert rid is not None
    hs = stored(index, A, sibling(0))
    ov.finished(rid, index)
    assert ov.stats.confirmed == 1 and len(ov) == 0
    # stored, then removed before the request's end was seen: contradicted
    rid = router.reserve(sibling(2), B)
    assert rid is not None
    hs = stored(index, B, sibling(2))
    index.apply(B[0], B[1], KVEventBatch(0.0, [BlockRemoved(hs, "GPU", group_idx=0)]))
    ov.finished(rid, index)
    clock.t += 0.5
    ov.sweep(index)
    assert ov.stats.contradicted == 1 and len(ov) == 0


def test_lora_and_salt_keep_reservations_apart() -> None:
    index = BlockIndex()
    ov = PendingOverlay()
    router = Router(index, pending=ov)
    router.reserve(RequestKey(sibling(0), lora_name="ad1", cache_salt="s"), A)
    same = router.score(RequestKey(sibling(1), lora_name="ad1", cache_salt="s"), {A: 0.0})
    assert same[0].pending == len(CONTEXT)
    for other in (
        RequestKey(sibling(1), lora_name="ad2", cache_salt="s"),
        RequestKey(sibling(1), lora_name="ad1"),
        RequestKey(sibling(1)),
    ):
        assert router.score(other, {A: 0.0})[0].pending == 0
    # keyword arguments build the same key
    assert router.score(sibling(1), {A: 0.0}, lora_name="ad1", cache_salt="s")[0].pending > 0


def test_weight_zero_and_no_overlay_change_nothing() -> None:
    index = BlockIndex()
    stored(index, B, CONTEXT[:64])
    for router in (Router(index), Router(index, pending=PendingOverlay(), pending_weight=0.0)):
        router.reserve(sibling(0), A)
        assert router.select(sibling(1), {A: 0.0, B: 0.0}) == B
        assert all(c.pending == 0 for c in router.score(sibling(1), {A: 0.0, B: 0.0}))
    with pytest.raises(ConfigError):
        Router(index, pending_weight=-1.0)
    with pytest.raises(ConfigError):
        PendingOverlay(ttl_s=0)


def test_pending_never_outweighs_the_same_confirmed_prefix() -> None:
    index = BlockIndex()
    stored(index, B, sibling(0))
    router = Router(index, pending=PendingOverlay(), pending_weight=1.0)
    router.reserve(sibling(0), A)
    # the same tokens confirmed on B and pending on A at full weight: a tie, B by
    # nothing worse; at the default weight, B clearly
    ranked = router.score(sibling(1), {A: 0.0, B: 0.0})
    costs = {c.worker: c.cost for c in ranked}
    assert costs[B] <= costs[A]
    assert Router(index, pending=router.pending).select(sibling(1), {A: 0.0, B: 0.0}) == B


def test_bounds_evict_the_oldest() -> None:
    ov = PendingOverlay(max_entries=3)
    rids = [ov.reserve(A, prompt_keys(sibling(i), 16)) for i in range(5)]
    assert len(ov) == 3 and ov.stats.evicted_for_bound == 2
    assert [r.rid for r in ov.reservations()] == rids[2:]
    per = ENTRY_BYTES + KEY_BYTES * len(prompt_keys(sibling(0), 16))
    small = PendingOverlay(max_bytes=2 * per + 10)
    for i in range(4):
        small.reserve(B, prompt_keys(sibling(i), 16))
    assert len(small) == 2 and small.nbytes <= small.max_bytes
    assert small.reserve(B, list(range(10_000))) is None and small.stats.refused == 1


def test_memory_stays_within_the_bound_under_a_flood() -> None:
    """A flood of unique prompts: what the overlay's tables allocate (traced) stays
    within ``max_bytes``, and the estimate it keeps is an upper bound of it."""
    bound = 2 << 20
    ov = PendingOverlay(max_bytes=bound, max_entries=1_000_000)
    keys = [prompt_keys([i] * 16 + list(range(i * 1000, i * 1000 + 1008)), 16) for i in range(3)]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        peak = 0
        for i in range(3000):
            ks = [k ^ (i << 20) for k in keys[i % 3]]  # unique keys, 64 per prompt
            ov.reserve((f"w{i % 7}", 0), ks)
            del ks
            if i % 100 == 99:
                peak = max(peak, tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    assert ov.nbytes <= bound and ov.stats.evicted_for_bound > 0
    assert peak <= bound, (peak, bound)


# --- differential: the overlay against a plain model ------------------------------------


@dataclass
class _Res:
    rid: int
    worker: tuple[str, int]
    keys: tuple[int, ...]
    deadline: float
    finished: bool = False


@dataclass
class _Model:
    """The contract, written plainly: a list of reservations, oldest first."""

    ttl: float
    grace: float
    max_entries: int
    max_bytes: int
    live: list[_Res] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def due(self, now: float) -> None:
        for r in [r for r in self.live if r.deadline <= now]:
            self.live.remove(r)
            key = "contradicted" if r.finished else "expired"
            self.counts[key] = self.counts.get(key, 0) + 1

    def size(self, r: _Res) -> int:
        return ENTRY_BYTES + KEY_BYTES * len(r.keys)

    def reserve(self, rid: int, worker: tuple[str, int], keys: tuple[int, ...], now: float) -> None:
        self.due(now)
        new = _Res(rid, worker, keys, now + self.ttl)
        while self.live and (
            len(self.live) >= self.max_entries
            or sum(map(self.size, self.live)) + self.size(new) > self.max_bytes
        ):
            self.live.pop(0)
            self.counts["evicted_for_bound"] = self.counts.get("evicted_for_bound", 0) + 1
        self.live.append(new)

    def finish(self, rid: int, now: float) -> None:
        for r in self.live:
            if r.rid == rid and not r.finished:
                r.finished = True
                r.deadline = min(r.deadline, now + self.grace)

    def runs(self, keys: Sequence[int]) -> dict[tuple[str, int], int]:
        out: dict[tuple[str, int], int] = {}
        for r in self.live:
            lcp = 0
            for a, b in zip(keys, r.keys):
                if a != b:
                    break
                lcp += 1
            if lcp:
                out[r.worker] = max(out.get(r.worker, 0), lcp)
        return out


_WORKERS = [("a", 0), ("b", 0), ("b", 1)]
_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("reserve"),
            st.sampled_from(_WORKERS),
            st.lists(st.integers(0, 2), min_size=1, max_size=6),  # blocks, few distinct
        ),
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("tick"), st.sampled_from([0.1, 0.5, 1.0, 3.0])),
        st.tuples(st.just("query"), st.lists(st.integers(0, 2), min_size=1, max_size=7)),
    ),
    max_size=60,
)


def _keys(blocks: Sequence[int]) -> list[int]:
    return prompt_keys([t for b in blocks for t in [b] * 16], 16)


@settings(max_examples=150, deadline=None)
@given(_ops, st.integers(1, 5), st.integers(1, 4))
def test_overlay_matches_a_plain_model(ops: list[tuple], max_entries: int, max_keys: int) -> None:
    clock = Clock()
    max_bytes = max_keys * (ENTRY_BYTES + 3 * KEY_BYTES)
    ov = PendingOverlay(
        ttl_s=2.0, grace_s=0.5, max_entries=max_entries, max_bytes=max_bytes, clock=clock
    )
    model = _Model(2.0, 0.5, max_entries, max_bytes)
    rids: list[int] = []
    for op in ops:
        if op[0] == "reserve":
            ks = tuple(_keys(op[2]))
            rid = ov.reserve(op[1], ks)
            if ENTRY_BYTES + KEY_BYTES * len(ks) > max_bytes:
                assert rid is None
                continue
            assert rid is not None
            rids.append(rid)
            model.reserve(rid, op[1], ks, clock.t)
        elif op[0] == "finish":
            if rids:
                rid = rids[op[1] % len(rids)]
                ov.finished(rid)
                model.finish(rid, clock.t)
        elif op[0] == "tick":
            clock.t += op[1]
        else:
            ov.sweep()
            model.due(clock.t)
            assert ov.pending_runs(_keys(op[1])) == model.runs(_keys(op[1]))
        ov.sweep()
        model.due(clock.t)
        assert [r.rid for r in ov.reservations()] == [r.rid for r in model.live]
        assert len(ov) <= max_entries and ov.nbytes <= max_bytes
        stats = ov.stats.as_dict()
        for name in ("expired", "contradicted", "evicted_for_bound"):
            assert stats[name] == model.counts.get(name, 0), name
    ov.clear()
    assert ov.nbytes == 0 and ov.pending_runs(_keys([0, 1])) == {}


def test_select_uses_the_overlay_only_for_requests_it_holds() -> None:
    index = BlockIndex()
    stored(index, B, [1, 2, 3] * 20)
    ov = PendingOverlay()
    router = Router(index, pending=ov)
    plain = Router(index)
    loads = {A: 0.0, B: 5.0}
    router.reserve(sibling(0), B)
    # a sibling: B holds its context pending, and wins against the idle A
    assert router.select(sibling(1), loads) == B
    assert plain.select(sibling(1), loads) == A
    # another prompt: the overlay holds nothing of it, the answer is the plain router's
    other = list(range(50_000, 50_600))
    assert router.select(other, loads) == plain.select(other, loads) == A


def test_multimodal_inputs_key_the_reservation() -> None:
    from kvevents.request import MMFeature

    index = BlockIndex()
    router = Router(index, pending=PendingOverlay())
    img = [MMFeature("img-a", 4, 8)]
    router.reserve(RequestKey(sibling(0), mm_features=img), A)
    loads = {A: 0.0, B: 0.0}
    assert router.select(RequestKey(sibling(1), mm_features=img), loads) == A
    assert router.score(RequestKey(sibling(1), mm_features=img), loads)[0].pending > 0
    other = [MMFeature("img-b", 4, 8)]
    assert all(
        c.pending == 0 for c in router.score(RequestKey(sibling(1), mm_features=other), loads)
    )
    # an input that starts in the third block: another input there shares the first two
    router.reserve(RequestKey(sibling(2), mm_features=[MMFeature("img-c", 40, 8)]), B)
    late = RequestKey(sibling(3), mm_features=[MMFeature("img-d", 40, 8)])
    pend = {c.worker: c.pending for c in router.score(late, loads)}
    assert pend[B] == 32 and pend[A] == 0
