"""Hypothesis state machines: each cache policy and the manager against simple models.

Properties: capacity is never exceeded; pinned or pending chunks are never evicted;
eviction is atomic (exactly n or nothing); every stored key is announced once and every
evicted key removed once; LRU evicts exactly what an ordered-list model predicts.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvevents.publishers.offload import (
    ARCCachePolicy,
    CachePolicy,
    ChunkStatus,
    CPUOffloadingManager,
    LookupResult,
    LRUCachePolicy,
    OffloadKey,
    ReqContext,
    make_offload_key,
)

UNIVERSE = [make_offload_key(f"k{i}".encode(), i % 2) for i in range(10)]
key_idx = st.integers(0, len(UNIVERSE) - 1)
key_lists = st.lists(key_idx, max_size=5)
# Policies see a smaller universe so that touches and evictions collide often.
pkey_idx = st.integers(0, 5)
pkey_lists = st.lists(pkey_idx, max_size=4)
SETTINGS = settings(
    max_examples=120,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# --- policies -----------------------------------------------------------------------------


class PolicyMachine(RuleBasedStateMachine):
    """Drives a CachePolicy the way the manager does and checks its answers."""

    policy_cls: type[CachePolicy] = LRUCachePolicy
    capacity = 5

    def __init__(self) -> None:
        super().__init__()
        self.policy = self.policy_cls(self.capacity)
        self.ctx = ReqContext("p")
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.order: list[OffloadKey] = []  # LRU model: least recent first
        self.next_chunk = 0

    def _pick(self, data: st.DataObject, want: str) -> OffloadKey | None:
        ok = {
            "pending": lambda c: c.ref_cnt == -1,
            "ready": lambda c: c.ref_cnt >= 0,
            "pinned": lambda c: c.ref_cnt > 0,
        }[want]
        keys = sorted(k for k, c in self.chunks.items() if ok(c))
        return data.draw(st.sampled_from(keys)) if keys else None

    @initialize(n=st.integers(0, 5))
    def prefill(self, n: int) -> None:
        """Start with ``n`` ready keys, so evictions have choices from the first step."""
        for i in range(n):
            self.insert(i, True)

    @precondition(lambda self: len(self.chunks) < self.capacity)
    @rule(i=pkey_idx, ready=st.booleans())
    def insert(self, i: int, ready: bool) -> None:
        key = UNIVERSE[i]
        if key in self.chunks:
            return
        chunk = ChunkStatus(self.next_chunk)
        self.next_chunk += 1
        self.policy.insert(key, chunk, self.ctx)
        self.chunks[key] = chunk
        self.order.append(key)
        if ready:  # the write completes at once
            chunk.ref_cnt = 0
            self.policy.mark_evictable(key)

    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        key = self._pick(data, "pending")
        if key is not None:
            self.chunks[key].ref_cnt = 0
            self.policy.mark_evictable(key)

    @rule(data=st.data())
    def fail_pending(self, data: st.DataObject) -> None:
        key = self._pick(data, "pending")
        if key is not None:
            self.policy.remove(key)
            del self.chunks[key]
            self.order.remove(key)

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        key = self._pick(data, "ready")
        if key is not None:
            chunk = self.chunks[key]
            if chunk.ref_cnt == 0:
                self.policy.mark_non_evictable(key)
            chunk.ref_cnt += 1

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = self._pick(data, "pinned")
        if key is not None:
            chunk = self.chunks[key]
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self.policy.mark_evictable(key)

    @rule(ids=pkey_lists)
    def touch(self, ids: list[int]) -> None:
        keys = [UNIVERSE[i] for i in ids]
        self.policy.touch(keys, self.ctx)
        for key in reversed(keys):
            if key in self.order:
                self.order.remove(key)
                self.order.append(key)

    @rule(n=st.integers(0, 3), protected_ids=st.lists(pkey_idx, max_size=2))
    def evict(self, n: int, protected_ids: list[int]) -> None:
        protected = {UNIVERSE[i] for i in protected_ids}
        eligible = [k for k in self.order if self.chunks[k].ref_cnt == 0 and k not in protected]
        before = sorted(self.policy.keys())
        result = self.policy.evict(n, protected)
        if n > len(eligible):
            assert result is None
            assert sorted(self.policy.keys()) == before  # atomic: nothing changed
            return
        assert result is not None and len(result) == n
        keys = [k for k, _ in result]
        assert len(set(keys)) == n
        for key, chunk in result:
            assert key in eligible  # never pinned, pending or protected
            assert chunk is self.chunks[key]
            assert self.policy.get(key) is None
        self.check_victims(keys, eligible)
        for key in keys:
            del self.chunks[key]
            self.order.remove(key)

    def check_victims(self, victims: list[OffloadKey], eligible: list[OffloadKey]) -> None:
        """Policy-specific victim order (LRU: the least recent eligible keys)."""

    @invariant()
    def membership_matches(self) -> None:
        assert len(self.policy) == len(self.chunks) <= self.capacity
        assert set(self.policy.keys()) == set(self.chunks)
        for key, chunk in self.chunks.items():
            assert self.policy.get(key) is chunk


class LRUMachine(PolicyMachine):
    policy_cls = LRUCachePolicy

    def check_victims(self, victims: list[OffloadKey], eligible: list[OffloadKey]) -> None:
        assert victims == eligible[: len(victims)]

    @invariant()
    def recency_order_matches_model(self) -> None:
        lru = self.policy
        assert isinstance(lru, LRUCachePolicy)
        assert sorted(self.order, key=lambda k: lru.rank(k) or (-1, 0)) == self.order


class ARCMachine(PolicyMachine):
    policy_cls = ARCCachePolicy

    @invariant()
    def arc_lists_are_consistent(self) -> None:
        arc = self.policy
        assert isinstance(arc, ARCCachePolicy)
        t1, t2, b1, b2 = set(arc.t1), set(arc.t2), set(arc.b1), set(arc.b2)
        assert not (t1 & t2) and not (b1 & b2)
        assert not ((t1 | t2) & (b1 | b2))  # ghosts hold no resident key
        assert len(b1) <= self.capacity and len(b2) <= self.capacity
        assert 0.0 <= arc.target_t1_size <= self.capacity
        assert all(arc.t2[k].ref_cnt >= 0 for k in t2)  # only ready keys are promoted


TestLRUPolicy = LRUMachine.TestCase
TestLRUPolicy.settings = SETTINGS
TestARCPolicy = ARCMachine.TestCase
TestARCPolicy.settings = SETTINGS


# --- manager ------------------------------------------------------------------------------


class ManagerMachine(RuleBasedStateMachine):
    """CPUOffloadingManager against a dict model of key states and announced residency."""

    policy = "lru"
    num_chunks = 4

    def __init__(self) -> None:
        super().__init__()
        self.m = CPUOffloadingManager(self.num_chunks, cache_policy=self.policy, enable_events=True)
        self.ref: dict[OffloadKey, int] = {}  # -1 pending, 0 ready, >0 pinned
        self.chunk: dict[OffloadKey, int] = {}
        self.announced: set[OffloadKey] = set()
        self.ctxs = [self._new_ctx(i) for i in range(2)]
        self.serial = 2

    @staticmethod
    def _new_ctx(n: int) -> ReqContext:
        ctx = ReqContext(f"r{n}")
        for j, key in enumerate(UNIVERSE):
            ctx.set_position(key, 16 * (j + 1))
        return ctx

    @rule(ids=key_lists, r=st.integers(0, 1))
    def prepare_store(self, ids: list[int], r: int) -> None:
        offered = list(dict.fromkeys(UNIVERSE[i] for i in ids))
        absent = [k for k in offered if k not in self.ref]
        free = self.num_chunks - len(self.ref)
        evictable = {k for k, c in self.ref.items() if c == 0 and k not in offered}
        out = self.m.prepare_store(offered, self.ctxs[r])
        if not absent:
            assert out is not None and out.keys_to_store == [] and out.evicted_keys == []
            return
        need = len(absent) - free
        if need > len(evictable):
            assert out is None
            return
        assert out is not None
        assert out.keys_to_store == absent
        assert len(out.evicted_keys) == max(need, 0)
        assert set(out.evicted_keys) <= evictable  # never pinned, pending or offered
        for key in out.evicted_keys:
            del self.ref[key]
            del self.chunk[key]
        ids_new = out.store_spec.block_ids.tolist()  # type: ignore[attr-defined]
        assert len(set(ids_new)) == len(ids_new)
        assert all(0 <= c < self.num_chunks for c in ids_new)
        assert not set(ids_new) & set(self.chunk.values())
        for key, c in zip(absent, ids_new):
            self.ref[key] = -1
            self.chunk[key] = c

    def _some(self, data: st.DataObject, pred: Callable[[int], bool]) -> list[OffloadKey]:
        """A list of model keys whose ref count satisfies ``pred`` (maybe with others)."""
        pool = sorted(k for k, c in self.ref.items() if pred(c))
        extra = st.sampled_from(UNIVERSE)  # occasionally a key in another state
        choice = st.one_of(st.sampled_from(pool), extra) if pool else extra
        return data.draw(st.lists(choice, max_size=4))

    @rule(data=st.data(), success=st.booleans(), r=st.integers(0, 1))
    def complete_store(self, data: st.DataObject, success: bool, r: int) -> None:
        keys = self._some(data, lambda c: c == -1)
        self.m.complete_store(keys, self.ctxs[r], success=success)
        for key in dict.fromkeys(keys):
            if self.ref.get(key) == -1:
                if success:
                    self.ref[key] = 0
                else:
                    del self.ref[key]
                    del self.chunk[key]

    @rule(data=st.data(), r=st.integers(0, 1))
    def load(self, data: st.DataObject, r: int) -> None:
        keys = [k for k in self._some(data, lambda c: c >= 0) if self.ref.get(k, -1) >= 0]
        spec = self.m.prepare_load(keys, self.ctxs[r])
        assert spec.block_ids.tolist() == [self.chunk[k] for k in keys]  # type: ignore[attr-defined]
        for key in keys:
            self.ref[key] += 1

    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        keys = [k for k in self._some(data, lambda c: c > 0) if self.ref.get(k, 0) > 0]
        keys = list(dict.fromkeys(keys))
        self.m.complete_load(keys)
        for key in keys:
            self.ref[key] -= 1

    @rule(ids=key_lists)
    def touch(self, ids: list[int]) -> None:
        self.m.touch([UNIVERSE[i] for i in ids])

    @rule(r=st.integers(0, 1))
    def finish_request(self, r: int) -> None:
        self.m.on_request_finished(self.ctxs[r])
        self.ctxs[r] = self._new_ctx(self.serial)
        self.serial += 1

    @rule()
    def take_events(self) -> None:
        for ev in self.m.take_events():
            assert ev.medium == "CPU" and ev.keys
            for key in ev.keys:
                if ev.metadata_only:
                    assert key not in self.announced
                elif ev.removed:
                    assert key in self.announced  # removed once, after its store
                    self.announced.remove(key)
                else:
                    assert key not in self.announced  # announced once
                    self.announced.add(key)
        assert self.announced == {k for k, c in self.ref.items() if c >= 0}

    @rule()
    def reset(self) -> None:
        self.take_events()
        self.m.reset_cache()
        assert self.m.take_events() == []
        self.ref.clear()
        self.chunk.clear()
        self.announced.clear()

    @invariant()
    def model_matches(self) -> None:
        assert len(self.ref) <= self.num_chunks
        assert self.m.num_free_chunks == self.num_chunks - len(self.ref)
        assert self.m.num_evictable_chunks == sum(1 for c in self.ref.values() if c == 0)
        for key in UNIVERSE:
            status = self.m.chunk_status(key)
            if key not in self.ref:
                assert status is None
                continue
            assert status is not None
            assert (status.ref_cnt, status.chunk_id) == (self.ref[key], self.chunk[key])
            expect = LookupResult.HIT if self.ref[key] >= 0 else LookupResult.HIT_PENDING
            assert self.m.lookup(key) == expect


class ARCManagerMachine(ManagerMachine):
    policy = "arc"


MANAGER_SETTINGS = settings(SETTINGS, max_examples=200)
TestLRUManager = ManagerMachine.TestCase
TestLRUManager.settings = MANAGER_SETTINGS
TestARCManager = ARCManagerMachine.TestCase
TestARCManager.settings = MANAGER_SETTINGS
