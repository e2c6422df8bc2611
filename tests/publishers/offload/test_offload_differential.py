"""Differential test: the CPU offload manager against a small model of vLLM 0.33's rules.

The model below is written from vLLM 0.33's ``CPUOffloadingManager`` and its LRU / ARC
policies as the contract describes them, independently of ``kvevents``' own code: plain
dicts and lists, linear scans and sorts instead of heaps and lazy invalidation, no
shared helpers.  A seeded generator drives both with long random sequences (stores that
fail, partial completions, loads, lookups, touches, request finishes, cache resets,
events drained at random points) and every returned value, every ``OffloadingEvent`` and
every KV event the translator makes of them must be equal.

Run directly for longer sequences and an agreement count::

    python tests/publishers/offload/test_offload_differential.py --ops 18000 --seeds 4
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from kvevents.publishers.offload import (
    CPULoadStoreSpec,
    CPUOffloadingManager,
    OffloadEventTranslator,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
)

Key = OffloadKey

# --- the model: vLLM 0.33's rules, written plainly --------------------------------------


@dataclass
class _Req:
    """What the model knows of a request: its id and its keys' end-token positions."""

    req_id: str
    positions: dict[Key, int]


@dataclass
class _Slot:
    chunk_id: int
    ref_cnt: int = -1  # -1 pending, 0 idle, >0 pinned by loads


def _group(key: Key) -> int:
    return int.from_bytes(key[-4:], "big")


def _head_to_tail(groups: Sequence[Sequence[Key]], req: _Req) -> list[Key]:
    """The groups concatenated; sorted by position (stably) when every key has one."""
    keys = [k for g in groups for k in g]
    if all(k in req.positions for k in keys):
        keys = sorted(keys, key=lambda k: req.positions[k])
    return keys


class _LRUModel:
    """Logical ranks; the smallest (rank, key) among idle, unprotected keys goes first."""

    def __init__(self, capacity: int) -> None:
        self.slots: dict[Key, _Slot] = {}
        self.rank: dict[Key, tuple[int, int]] = {}
        self.counter = 0
        self.request_rank: dict[str, int] = {}  # forgotten by clear()

    def _draw(self) -> int:
        self.counter += 1
        return self.counter

    def _request(self, req: _Req) -> int:
        if req.req_id not in self.request_rank:
            self.request_rank[req.req_id] = self._draw()
        return self.request_rank[req.req_id]

    def insert(self, key: Key, slot: _Slot, req: _Req) -> None:
        self.slots[key] = slot
        if key in req.positions:
            self.rank[key] = (self._request(req), -req.positions[key])
        else:
            self.rank[key] = (self._draw(), 0)

    def remove(self, key: Key) -> None:
        del self.slots[key]
        del self.rank[key]

    def touch(self, keys: Sequence[Key], req: _Req) -> None:
        for key in reversed(keys):
            if key in self.slots:
                self.rank[key] = (self._draw(), 0)

    def on_store_miss(self, keys: Sequence[Key], req: _Req) -> None:
        self.touch(keys, req)

    def on_request_access(self, keys: Sequence[Key], req: _Req) -> None:
        mine = self._request(req)  # taken even if no key is raised
        for key in keys:
            if key in self.slots and key in req.positions:
                self.rank[key] = max(self.rank[key], (mine, -req.positions[key]))

    def on_request_finished(
        self, groups: Sequence[Sequence[Key]], only_inserted: set[Key], reused: set[Key], req: _Req
    ) -> None:
        self.touch(_head_to_tail(groups, req), req)

    def evict(self, n: int, protected: set[Key]) -> list[tuple[Key, _Slot]] | None:
        if n == 0:
            return []
        idle = sorted(
            (self.rank[k], k)
            for k, s in self.slots.items()
            if s.ref_cnt == 0 and k not in protected
        )
        if len(idle) < n:
            return None
        out = [(k, self.slots[k]) for _, k in idle[:n]]
        for k, _ in out:
            self.remove(k)
        return out

    def clear(self) -> None:
        self.slots.clear()
        self.rank.clear()
        self.request_rank.clear()


class _ARCModel:
    """T1/T2 (resident) and B1/B2 (ghosts) as lists, least recent first; target p."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.slots: dict[Key, _Slot] = {}
        self.t1: list[Key] = []
        self.t2: list[Key] = []
        self.b1: list[Key] = []
        self.b2: list[Key] = []
        self.p = 0.0

    @staticmethod
    def _to_end(lst: list[Key], key: Key) -> None:
        lst.remove(key)
        lst.append(key)

    def insert(self, key: Key, slot: _Slot, req: _Req) -> None:
        self.slots[key] = slot
        self.t1.append(key)
        for ghost in (self.b1, self.b2):
            if key in ghost:
                ghost.remove(key)

    def remove(self, key: Key) -> None:
        del self.slots[key]
        (self.t1 if key in self.t1 else self.t2).remove(key)

    def _ghost_hit(self, key: Key) -> None:
        if key in self.b1:
            self.p = min(self.p + max(1.0, len(self.b2) / len(self.b1)), float(self.capacity))
            self._to_end(self.b1, key)
        elif key in self.b2:
            self.p = max(self.p - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            self._to_end(self.b2, key)

    def touch(self, keys: Sequence[Key], req: _Req) -> None:
        for key in reversed(keys):
            if key in self.t1:
                if self.slots[key].ref_cnt >= 0:
                    self.t1.remove(key)
                    self.t2.append(key)
                else:
                    self._to_end(self.t1, key)
            elif key in self.t2:
                self._to_end(self.t2, key)
            else:
                self._ghost_hit(key)

    def on_store_miss(self, keys: Sequence[Key], req: _Req) -> None:
        for key in reversed(keys):
            if key not in self.slots:
                self._ghost_hit(key)

    def on_request_access(self, keys: Sequence[Key], req: _Req) -> None:
        pass  # ARC keeps the base no-op

    def on_request_finished(
        self, groups: Sequence[Sequence[Key]], only_inserted: set[Key], reused: set[Key], req: _Req
    ) -> None:
        for key in reversed(_head_to_tail(groups, req)):
            if key in reused:
                if key in self.t1:
                    self.t1.remove(key)
                    self.t2.append(key)
                elif key in self.t2:
                    self._to_end(self.t2, key)
            elif key in only_inserted:
                for lst in (self.t1, self.t2):
                    if key in lst:
                        self._to_end(lst, key)

    def evict(self, n: int, protected: set[Key]) -> list[tuple[Key, _Slot]] | None:
        picks: list[tuple[Key, bool]] = []
        t1_size = len(self.t1)

        def first_idle(lst: list[Key]) -> Key | None:
            for k in lst:
                taken = any(k == p for p, _ in picks)
                if self.slots[k].ref_cnt == 0 and k not in protected and not taken:
                    return k
            return None

        for _ in range(n):
            from_t1_first = t1_size >= int(self.p)
            order = [(self.t1, True), (self.t2, False)]
            if not from_t1_first:
                order.reverse()
            for lst, is_t1 in order:
                k = first_idle(lst)
                if k is not None:
                    picks.append((k, is_t1))
                    t1_size -= is_t1
                    break
            else:
                return None
        out = []
        for k, is_t1 in picks:
            out.append((k, self.slots.pop(k)))
            (self.t1 if is_t1 else self.t2).remove(k)
            (self.b1 if is_t1 else self.b2).append(k)
        for ghost in (self.b1, self.b2):
            del ghost[: max(0, len(ghost) - self.capacity)]
        return out

    def clear(self) -> None:
        self.slots.clear()
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.p = 0.0


@dataclass
class _Access:
    """One request's record since the last reset (vLLM's ``_RequestCacheAccess``)."""

    generation: int
    groups: dict[int, list[Key]] = field(default_factory=dict)
    seen: set[Key] = field(default_factory=set)
    inserted: set[Key] = field(default_factory=set)
    reused: set[Key] = field(default_factory=set)
    store_missed: set[Key] = field(default_factory=set)
    finished: bool = False


# A manager event as (keys, removed, metadata_only); the medium is always CPU.
_Event = tuple[list[Key], bool, bool]


class _ManagerModel:
    def __init__(self, policy: str, num_chunks: int) -> None:
        self.policy: Any = _LRUModel(num_chunks) if policy == "lru" else _ARCModel(num_chunks)
        self.num_chunks = num_chunks
        self.fresh = 0  # chunk ids 0..fresh-1 have been handed out
        self.free: list[int] = []  # freed ids, reused last-freed first
        self.events: list[_Event] = []
        self.generation = 0
        self.access: dict[str, _Access] = {}

    def _slot(self, key: Key) -> _Slot | None:
        return self.policy.slots.get(key)

    def _state(self, req: _Req) -> _Access:
        st = self.access.get(req.req_id)
        if st is None or st.generation != self.generation:
            st = self.access[req.req_id] = _Access(self.generation)
        return st

    def _record(self, req: _Req, keys: Iterable[Key], reused: Iterable[Key] = ()) -> None:
        st = self._state(req)
        new = []
        for key in keys:
            if key not in st.seen:
                st.seen.add(key)
                st.groups.setdefault(_group(key), []).append(key)
                new.append(key)
        st.reused |= {k for k in reused if k not in st.inserted}
        if new:
            self.policy.on_request_access(new, req)

    def lookup(self, key: Key) -> str:
        slot = self._slot(key)
        if slot is None:
            return "MISS"
        return "HIT_PENDING" if slot.ref_cnt == -1 else "HIT"

    def prepare_load(self, keys: Sequence[Key], req: _Req) -> list[int]:
        ids = []
        for key in keys:
            slot = self._slot(key)
            assert slot is not None and slot.ref_cnt >= 0
            slot.ref_cnt += 1
            ids.append(slot.chunk_id)
        self._record(req, keys, reused=keys)
        return ids

    def complete_load(self, keys: Sequence[Key]) -> None:
        for key in keys:
            slot = self._slot(key)
            assert slot is not None and slot.ref_cnt > 0
            slot.ref_cnt -= 1

    def touch(self, keys: Sequence[Key], req: _Req) -> None:
        self.policy.touch(keys, req)

    def prepare_store(
        self, keys: Sequence[Key], req: _Req
    ) -> tuple[list[Key], list[int], list[Key]] | None:
        to_store = [k for k in keys if self._slot(k) is None]
        ready = [k for k in keys if (s := self._slot(k)) is not None and s.ref_cnt >= 0]
        st = self._state(req)
        misses = [k for k in to_store if k not in st.store_missed]
        if misses:
            self.policy.on_store_miss(misses, req)
            st.store_missed |= set(misses)
        self._record(req, [k for k in keys if k in to_store or k in ready], reused=ready)
        if not to_store:
            return [], [], []
        need = len(to_store) - (len(self.free) + self.num_chunks - self.fresh)
        evicted: list[Key] = []
        if need > 0:
            idle = sum(1 for s in self.policy.slots.values() if s.ref_cnt == 0)
            if need > idle:
                return None
            out = self.policy.evict(need, set(keys))
            if out is None:
                return None
            for key, slot in out:
                self.free.append(slot.chunk_id)
                evicted.append(key)
            self.events.append((evicted, True, False))
        ids = []
        for key in to_store:
            if self.fresh < self.num_chunks:
                ids.append(self.fresh)
                self.fresh += 1
            else:
                ids.append(self.free.pop())
            self.policy.insert(key, _Slot(ids[-1]), req)
        st.inserted |= set(to_store)
        return to_store, ids, evicted

    def complete_store(self, keys: Sequence[Key], success: bool) -> None:
        done = []
        for key in keys:
            slot = self._slot(key)
            if slot is None or slot.ref_cnt != -1:
                continue
            if success:
                slot.ref_cnt = 0
            else:
                self.policy.remove(key)
                self.free.append(slot.chunk_id)
            done.append(key)
        if done:
            self.events.append((done, not success, not success))

    def on_request_finished(self, req: _Req) -> None:
        st = self.access.get(req.req_id)
        if st is None or st.generation != self.generation or st.finished:
            return
        st.finished = True
        groups = []
        for g in sorted(st.groups):
            keys = st.groups[g]
            if all(k in req.positions for k in keys):
                keys = sorted(keys, key=lambda k: req.positions[k])
            groups.append(keys)
        self.policy.on_request_finished(groups, st.inserted - st.reused, set(st.reused), req)

    def reset_cache(self) -> None:
        self.policy.clear()
        self.fresh = 0
        self.free = []
        self.generation += 1

    def take_events(self) -> list[_Event]:
        out = []
        for keys, removed, metadata_only in self.events:
            if metadata_only:
                keys = [k for k in keys if self._slot(k) is None]
                if not keys:
                    continue
            out.append((keys, removed, metadata_only))
        self.events = []
        return out


def _model_kv_events(events: list[_Event]) -> list[dict[str, Any]]:
    """vLLM's placeholder translation (int hashes: the digest's last 8 bytes)."""

    def wire(key: Key) -> int:
        return int.from_bytes(key[:-4], "big") & (2**64 - 1)

    out: list[dict[str, Any]] = []
    for keys, removed, metadata_only in events:
        if metadata_only:
            continue
        if not removed:
            for k in keys:
                out.append(
                    {
                        "type": "BlockStored",
                        "block_hashes": [wire(k)],
                        "parent_block_hash": None,
                        "token_ids": [],
                        "block_size": 0,
                        "lora_id": None,
                        "medium": "CPU",
                        "lora_name": None,
                        "group_idx": _group(k),
                    }
                )
            continue
        by_group: dict[int, list[int]] = {}
        for k in keys:
            by_group.setdefault(_group(k), []).append(wire(k))
        for g, hashes in by_group.items():
            out.append(
                {"type": "BlockRemoved", "block_hashes": hashes, "medium": "CPU", "group_idx": g}
            )
    return out


# --- the driver ------------------------------------------------------------------------


class Divergence(AssertionError):
    """The manager and the model answered differently."""


@dataclass
class Agreement:
    operations: int = 0
    events: int = 0
    kv_events: int = 0
    counts: dict[str, int] = field(default_factory=dict)


def _kv_dicts(kv: Iterable[Any]) -> list[dict[str, Any]]:
    out = []
    for ev in kv:
        d = {"type": type(ev).__name__}
        d.update({k: v for k, v in msgspec.structs.asdict(ev).items() if v is not None})
        out.append(d)
    return out


def _model_kv_dicts(events: list[_Event]) -> list[dict[str, Any]]:
    return [{k: v for k, v in d.items() if v is not None} for d in _model_kv_events(events)]


def _event_tuple(ev: OffloadingEvent) -> tuple[Any, ...]:
    return (list(ev.keys), ev.medium, ev.removed, ev.metadata_only, ev.locality, ev.ownership)


def _build_documents(rng: random.Random) -> list[tuple[list[Key], list[Key]]]:
    """Token streams as chunk keys: group 0 every 16 tokens, group 1 every 8.

    Documents share prefixes (a key is the chained hash, so a shared prefix shares keys).
    """

    def key(group: int) -> Key:
        # The key layout (digest + 4-byte big-endian group) built by hand.
        return OffloadKey(rng.randbytes(rng.choice((8, 16, 32))) + group.to_bytes(4, "big"))

    docs: list[tuple[list[Key], list[Key]]] = []
    for _ in range(8):
        g0 = [key(0) for _ in range(10)]
        g1 = [key(1) for _ in range(20)]
        if docs and rng.random() < 0.7:
            base0, base1 = rng.choice(docs)
            shared = rng.randint(1, 6)
            g0[:shared] = base0[:shared]
            g1[: 2 * shared] = base1[: 2 * shared]
        docs.append((g0, g1))
    return docs


@dataclass
class _Request:
    ctx: ReqContext
    req: _Req
    keys: list[Key]  # head to tail (mixed groups)


def run_sequence(
    policy: str,
    seed: int,
    n_ops: int,
    num_chunks: int,
    make_manager: Callable[..., CPUOffloadingManager] = CPUOffloadingManager,
) -> Agreement:
    """Drive the manager and the model with ``n_ops`` random operations.

    Raises :class:`Divergence` at the first answer that differs, naming the operation.
    """
    rng = random.Random(seed)
    docs = _build_documents(rng)
    manager = make_manager(num_chunks, cache_policy=policy, enable_events=True)
    translator = OffloadEventTranslator(int_hashes=True)
    model = _ManagerModel(policy, num_chunks)
    agreement = Agreement()
    active: list[_Request] = []
    store_jobs: list[list[Key]] = []
    load_jobs: list[list[Key]] = []
    trace: list[str] = []
    n_requests = 0

    def check(what: str, got: Any, want: Any) -> None:
        if got != want:
            recent = "\n  ".join(trace[-12:])
            raise Divergence(
                f"{policy} seed={seed} op #{len(trace)} {what}:\n  manager: {got!r}\n"
                f"  model:   {want!r}\n recent operations:\n  {recent}"
            )

    def new_request() -> None:
        nonlocal n_requests
        n_requests += 1
        g0, g1 = rng.choice(docs)
        n0 = rng.randint(1, len(g0))
        ctx = ReqContext(req_id=f"r{n_requests}")
        keys: list[tuple[int, int, Key]] = []
        for i, k in enumerate(g0[:n0]):
            keys.append((16 * (i + 1), 0, k))
        for i, k in enumerate(g1[: 2 * n0]):
            keys.append((8 * (i + 1), 1, k))
        keys.sort()
        no_positions = rng.random() < 0.15
        for pos, _, k in keys:
            if not no_positions and rng.random() > 0.05:
                ctx.set_position(k, pos)
        req = _Req(ctx.req_id, dict(ctx.offload_key_positions))
        active.append(_Request(ctx, req, [k for _, _, k in keys]))

    def pick_keys(r: _Request, cap: int) -> list[Key]:
        if rng.random() < 0.6:  # a contiguous run, as a scheduler offers chunks
            start = rng.randrange(len(r.keys))
            keys = r.keys[start : start + rng.randint(1, cap)]
        else:
            keys = rng.sample(r.keys, min(len(r.keys), rng.randint(1, cap)))
        if rng.random() < 0.3:
            rng.shuffle(keys)
        return keys

    ops = [
        "new_request",
        "prepare_store",
        "complete_store",
        "prepare_load",
        "complete_load",
        "finish",
        "lookup",
        "touch",
        "take_events",
        "reset_cache",
        "empty_calls",
    ]
    weights = [6, 30, 20, 10, 10, 5, 8, 2, 8, 0.3, 0.5]
    for _ in range(n_ops):
        op = rng.choices(ops, weights)[0]
        if op != "new_request" and not active:
            op = "new_request"
        if op == "new_request":
            if len(active) >= 8:
                op = "finish"
            else:
                new_request()
                trace.append(f"new_request {active[-1].req.req_id}")
                continue
        r = rng.choice(active)
        if op == "prepare_store":
            keys = pick_keys(r, 6)
            trace.append(f"prepare_store {r.req.req_id} {len(keys)} keys")
            got = manager.prepare_store(keys, r.ctx)
            want = model.prepare_store(keys, r.req)
            got_out: tuple[list[Key], list[int], list[Key]] | None = None
            if got is not None:
                spec = got.store_spec
                assert isinstance(spec, CPULoadStoreSpec)
                got_out = (got.keys_to_store, spec.block_ids.tolist(), got.evicted_keys)
            check("prepare_store", got_out, want)
            if want is not None and want[0]:
                store_jobs.append(list(want[0]))
        elif op == "complete_store" and store_jobs:
            job = rng.choice(store_jobs)
            split = rng.randint(1, len(job)) if rng.random() < 0.3 else len(job)
            keys, rest = job[:split], job[split:]
            store_jobs.remove(job)
            if rest:
                store_jobs.append(rest)
            success = rng.random() < 0.85
            trace.append(f"complete_store {len(keys)} keys success={success}")
            manager.complete_store(keys, r.ctx, success=success)
            model.complete_store(keys, success)
            check("complete_store", None, None)
        elif op == "prepare_load":
            hits = [k for k in r.keys if model.lookup(k) == "HIT"]
            if not hits:
                continue
            keys = rng.sample(hits, min(len(hits), rng.randint(1, 4)))
            trace.append(f"prepare_load {r.req.req_id} {len(keys)} keys")
            got_ids = manager.prepare_load(keys, r.ctx).block_ids.tolist()
            check("prepare_load", got_ids, model.prepare_load(keys, r.req))
            load_jobs.append(keys)
        elif op == "complete_load" and load_jobs:
            keys = load_jobs.pop(rng.randrange(len(load_jobs)))
            trace.append(f"complete_load {len(keys)} keys")
            manager.complete_load(keys, r.ctx)
            model.complete_load(keys)
            check("complete_load", None, None)
        elif op == "finish":
            active.remove(r)
            trace.append(f"finish {r.req.req_id}")
            manager.on_request_finished(r.ctx)
            model.on_request_finished(r.req)
            check("on_request_finished", None, None)
        elif op == "lookup":
            key = rng.choice(rng.choice(docs)[rng.randrange(2)])
            trace.append("lookup")
            check("lookup", manager.lookup(key, r.ctx).name, model.lookup(key))
        elif op == "touch":
            keys = pick_keys(r, 4)
            trace.append(f"touch {len(keys)} keys")
            manager.touch(keys, r.ctx)
            model.touch(keys, r.req)
            check("touch", None, None)
        elif op == "take_events":
            trace.append("take_events")
            got_events = manager.take_events()
            want_events = model.take_events()
            check(
                "take_events",
                [_event_tuple(e) for e in got_events],
                [
                    (keys, "CPU", removed, metadata_only, None, None)
                    for keys, removed, metadata_only in want_events
                ],
            )
            got_kv = _kv_dicts(translator.translate(got_events))
            check("translated KV events", got_kv, _model_kv_dicts(want_events))
            agreement.events += len(want_events)
            agreement.kv_events += len(got_kv)
        elif op == "reset_cache":
            # The scheduler never completes a job started before a reset.
            trace.append("reset_cache")
            manager.reset_cache()
            model.reset_cache()
            store_jobs.clear()
            load_jobs.clear()
            translator.reset()
            check("reset_cache", None, None)
        elif op == "empty_calls":
            trace.append(f"empty prepare_store/prepare_load {r.req.req_id}")
            got = manager.prepare_store([], r.ctx)
            check("prepare_store([])", got is not None and got.keys_to_store, [])
            model.prepare_store([], r.req)
            check("prepare_load([])", manager.prepare_load([], r.ctx).block_ids.tolist(), [])
            model.prepare_load([], r.req)
        else:
            continue
        agreement.operations += 1
        agreement.counts[op] = agreement.counts.get(op, 0) + 1
    return agreement


# About 4,700 compared operations per sequence (under a second each); run the module
# directly for longer ones.
CASES = [
    (policy, seed, chunks)
    for policy in ("lru", "arc")
    for seed, chunks in ((1, 4), (2, 6), (3, 12), (4, 24))
]


@pytest.mark.parametrize(("policy", "seed", "num_chunks"), CASES)
def test_manager_agrees_with_the_vllm_model(policy: str, seed: int, num_chunks: int) -> None:
    agreement = run_sequence(policy, seed, 6000, num_chunks)
    assert agreement.operations >= 4000
    # The sequences reach every behaviour the model describes.
    for op in ("prepare_store", "complete_store", "prepare_load", "finish", "take_events"):
        assert agreement.counts.get(op, 0) > 100, (op, agreement.counts)
    assert agreement.counts.get("reset_cache", 0) >= 2
    assert agreement.kv_events > 1000


def test_the_model_tells_a_different_policy_apart() -> None:
    # The check is not vacuous: the LRU manager against the ARC model diverges.
    with pytest.raises(Divergence):
        run_sequence(
            "arc",
            1,
            5000,
            6,
            make_manager=lambda n, cache_policy, enable_events: CPUOffloadingManager(
                n, cache_policy="lru", enable_events=enable_events
            ),
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=18_000)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--chunks", type=int, nargs="+", default=[6, 16])
    args = parser.parse_args(argv)
    total = agreed = sequences = 0
    failed = False
    for policy in ("lru", "arc"):
        for seed in range(100, 100 + args.seeds):
            for chunks in args.chunks:
                sequences += 1
                try:
                    a = run_sequence(policy, seed, args.ops, chunks)
                except Divergence as exc:
                    failed = True
                    print(f"{policy:4} seed {seed} chunks {chunks:3}: DIVERGED\n{exc}")
                    continue
                total += a.operations
                agreed += a.operations
                print(
                    f"{policy:4} seed {seed} chunks {chunks:3}: {a.operations:,} of "
                    f"{a.operations:,} operations agree ({a.events:,} manager events, "
                    f"{a.kv_events:,} KV events)"
                )
    print(
        f"total: {agreed:,} of {total:,} operations agree in {sequences} sequences"
        + (" (some sequences DIVERGED)" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
