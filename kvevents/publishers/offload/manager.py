"""The CPU offloading manager: chunk slots, pin/pending states, eviction, events
(vLLM's ``CPUOffloadingManager``).

:class:`CPUOffloadingManager` holds ``num_chunks`` CPU chunk slots.  Slot ids are handed
out fresh (``0, 1, 2, …``) until every slot has been used once, then reused
last-freed-first (LIFO).  A key's chunk is *pending* (``ref_cnt == -1``) from
``prepare_store`` until ``complete_store``, *ready* (``0``, evictable) afterwards, and
*pinned* (``> 0``) between ``prepare_load`` and ``complete_load``.

Events (when ``enable_events``), drained by :meth:`CPUOffloadingManager.take_events`:

* one ``OffloadingEvent(evicted_keys, "CPU", removed=True)`` per ``prepare_store`` that
  evicted;
* one ``OffloadingEvent(stored_keys, "CPU", removed=False)`` per successful
  ``complete_store`` (keys in the order passed);
* one ``OffloadingEvent(keys, "CPU", removed=True, metadata_only=True)`` per failed
  ``complete_store``; at drain time it keeps only the keys that are **absent** from the
  tier then (as vLLM's ``take_events`` does), and is dropped if none is left.

Lookups, loads, touches and :meth:`CPUOffloadingManager.reset_cache` emit nothing; a
reset drops no undrained event.

Request accounting (vLLM's ``_record_request_cache_access``): each request records the
keys it stores or reuses, once.  The keys a call records for the first time go, in call
order, to one ``policy.on_request_access`` call: ``prepare_load`` records its keys after
pinning them; ``prepare_store`` records its store candidates and the ready keys it
offers before allocating, so also when it then returns ``None``.  A key counts as
*reused* when the request loads it or re-offers it while ready, unless the request had
inserted it before; at the request's finish the policy gets its keys per group, the
keys it only inserted, and the keys it reused.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvevents.errors import OffloadError
from kvevents.events import MEDIUM_CPU
from kvevents.publishers.offload.base import (
    CPULoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    get_offload_group_idx,
)
from kvevents.publishers.offload.policies.base import (
    CachePolicy,
    ChunkStatus,
    order_request_keys,
)
from kvevents.publishers.offload.policies.registry import get_cache_policy

__all__ = ["CPUOffloadingManager", "OffloadManagerStats"]

logger = logging.getLogger(__name__)


@dataclass
class OffloadManagerStats:
    """Counters of a :class:`CPUOffloadingManager` (all in keys unless stated)."""

    lookups: int = 0
    hits: int = 0
    hits_pending: int = 0
    misses: int = 0
    loads_prepared: int = 0
    loads_completed: int = 0
    stores_prepared: int = 0
    """Keys allocated by ``prepare_store``."""
    stores_completed: int = 0
    stores_failed: int = 0
    stores_skipped: int = 0
    """Offered keys dropped because they were offered fewer than ``store_threshold`` times."""
    evictions: int = 0
    store_refusals: Counter[str] = field(default_factory=Counter)
    """``prepare_store`` calls that returned ``None``, by reason (``no_space``, ``protected``)."""
    events_emitted: int = 0
    """Events handed out by ``take_events``."""
    metadata_keys_filtered: int = 0
    """Keys dropped from ``metadata_only`` events because they were present again when
    the events were drained."""
    resets: int = 0


@dataclass
class _RequestState:
    generation: int
    store_missed: set[OffloadKey] = field(default_factory=set)
    keys: dict[OffloadKey, None] = field(default_factory=dict)
    inserted: set[OffloadKey] = field(default_factory=set)
    reused: set[OffloadKey] = field(default_factory=set)
    finished: bool = False


def _unique(keys: Sequence[OffloadKey]) -> list[OffloadKey]:
    return list(dict.fromkeys(keys))


class CPUOffloadingManager(OffloadingManager):
    """An :class:`OffloadingManager` over ``num_chunks`` CPU chunk slots, as vLLM's
    ``CPUOffloadingManager``.

    Args:
        num_chunks: number of chunk slots (each holds ``blocks_per_chunk`` device blocks).
        cache_policy: a registered policy name (``"lru"``, ``"arc"``, or one added with
            :func:`~kvevents.publishers.offload.policies.register_cache_policy`), or a
            :class:`CachePolicy` subclass.  Unknown names raise
            :class:`~kvevents.errors.OffloadError` listing the known ones.
        cache_policy_module_path: import ``cache_policy`` (a class name) from this module.
        enable_events: collect :class:`OffloadingEvent` for :meth:`take_events`.
        store_threshold: with ``>= 2``, a key is stored only once it has been offered
            that many times (an access tracker of at most ``max_tracker_size`` keys).
        info: free-form description of the tier, returned by :meth:`config_info`.

    Calls accept ``ctx=None``, which stands for one long-lived anonymous request.
    """

    medium = MEDIUM_CPU

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str | type[CachePolicy] = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: Mapping[str, Any] | None = None,
    ) -> None:
        if num_chunks < 0:
            raise OffloadError("num_chunks must be >= 0")
        if isinstance(cache_policy, str):
            policy_cls = get_cache_policy(cache_policy, cache_policy_module_path)
        elif isinstance(cache_policy, type) and issubclass(cache_policy, CachePolicy):
            policy_cls = cache_policy
        else:
            raise OffloadError(
                f"cache_policy must be a name or CachePolicy class: {cache_policy!r}"
            )
        self.num_chunks = num_chunks
        self.info: dict[str, Any] = dict(info) if info is not None else {}
        self.policy: CachePolicy = policy_cls(num_chunks)
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._access_counts: OrderedDict[OffloadKey, int] | None = (
            OrderedDict() if store_threshold >= 2 else None
        )
        self._num_allocated = 0
        self._free_list: list[int] = []
        self._num_evictable = 0
        self._anonymous = ReqContext(req_id="")
        self._state_slot = f"kvevents.cpu_manager.{id(self)}"
        self.generation = 0
        """Bumped by :meth:`reset_cache`; completions of older jobs find nothing."""
        self.stats = OffloadManagerStats()

    # --- introspection -----------------------------------------------------------------

    def config_info(self) -> dict[str, Any]:
        """The ``info`` given at construction (``{}`` if none)."""
        return dict(self.info)

    @property
    def num_free_chunks(self) -> int:
        """Slots not held by any key."""
        return self.num_chunks - self._num_allocated + len(self._free_list)

    @property
    def num_evictable_chunks(self) -> int:
        """Slots held by ready, unpinned keys."""
        return self._num_evictable

    def chunk_status(self, key: OffloadKey) -> ChunkStatus | None:
        """The slot and ref count held for ``key`` (``None`` if absent)."""
        return self.policy.get(key)

    # --- per-request state -------------------------------------------------------------

    def _ctx(self, ctx: ReqContext | None) -> ReqContext:
        return ctx if ctx is not None else self._anonymous

    def _state(self, ctx: ReqContext) -> _RequestState:
        state = ctx.scratch.get(self._state_slot)
        if not isinstance(state, _RequestState) or state.generation != self.generation:
            state = _RequestState(generation=self.generation)
            ctx.scratch[self._state_slot] = state
        return state

    def _record(
        self,
        ctx: ReqContext,
        state: _RequestState,
        keys: Sequence[OffloadKey],
        reused: Sequence[OffloadKey] = (),
    ) -> None:
        """Record that the request accessed ``keys`` (vLLM's ``_record_request_cache_access``).

        The keys it records for the first time go, in order, to one
        ``policy.on_request_access`` call.  ``reused`` keys count as reused unless the
        request inserted them earlier.  The anonymous request keeps no per-key history
        (it never finishes), so each of its calls is a first access.
        """
        if ctx is self._anonymous:
            new = _unique(keys)
        else:
            new = []
            for key in keys:
                if key not in state.keys:
                    state.keys[key] = None
                    new.append(key)
            state.reused.update(k for k in reused if k not in state.inserted)
        if new:
            self.policy.on_request_access(new, ctx)

    # --- chunk slots -------------------------------------------------------------------

    def _allocate(self, n: int) -> list[int]:
        fresh = min(n, self.num_chunks - self._num_allocated)
        ids = list(range(self._num_allocated, self._num_allocated + fresh))
        self._num_allocated += fresh
        for _ in range(n - fresh):
            ids.append(self._free_list.pop())
        return ids

    def _free(self, chunk: ChunkStatus) -> None:
        self._free_list.append(chunk.chunk_id)

    # --- OffloadingManager -------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext | None = None) -> LookupResult:
        """``MISS`` if absent, ``HIT_PENDING`` while its write is in flight, else ``HIT``."""
        self.stats.lookups += 1
        chunk = self.policy.get(key)
        if chunk is None:
            self.stats.misses += 1
            return LookupResult.MISS
        if not chunk.is_ready:
            self.stats.hits_pending += 1
            return LookupResult.HIT_PENDING
        self.stats.hits += 1
        return LookupResult.HIT

    def prepare_load(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> CPULoadStoreSpec:
        """Pin ``keys`` and return their chunk ids in ``keys`` order.

        Every key must be present and ready, else :class:`OffloadError` and nothing is
        pinned.  Once they are pinned the request records the access: its keys new to
        it go to ``policy.on_request_access``, and the keys count as *reused* unless the
        request inserted them itself.
        """
        chunks: list[ChunkStatus] = []
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is None:
                raise OffloadError(f"prepare_load: key {key!r} is not on this tier")
            if not chunk.is_ready:
                raise OffloadError(f"prepare_load: key {key!r} is still being written")
            chunks.append(chunk)
        for key, chunk in zip(keys, chunks):
            if chunk.ref_cnt == 0:
                self.policy.mark_non_evictable(key)
                self._num_evictable -= 1
            chunk.ref_cnt += 1
        c = self._ctx(ctx)
        self._record(c, self._state(c), keys, reused=keys)
        self.stats.loads_prepared += len(keys)
        return CPULoadStoreSpec(np.array([c.chunk_id for c in chunks], dtype=np.int32))

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """Mark ``keys`` recently used (``keys[0]`` most recent); emits nothing."""
        self.policy.touch(list(keys), self._ctx(ctx))

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """Unpin ``keys``; a key unpinned more often than pinned raises OffloadError."""
        needed = Counter(keys)
        for key, count in needed.items():
            chunk = self.policy.get(key)
            if chunk is None or chunk.ref_cnt < count:
                raise OffloadError(f"complete_load: key {key!r} is not pinned {count} time(s)")
        for key in keys:
            chunk = self.policy.get(key)
            assert chunk is not None
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self._num_evictable += 1
                self.policy.mark_evictable(key)
        self.stats.loads_completed += len(keys)

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        """Allocate slots for the absent ``keys``, evicting if needed (vLLM's
        ``prepare_store``).

        Returns ``None`` with no slot, residency or event change when the absent keys do
        not fit even after evicting every evictable key that is not offered now.  Access
        accounting (the threshold tracker, the policy's miss/access hooks, the request's
        record of its store candidates and of the ready keys it *reuses*) is recorded
        either way, as in vLLM.
        """
        c = self._ctx(ctx)
        state = self._state(c)
        offered = _unique(keys)

        if self._access_counts is not None:
            for key in offered:
                self._access_counts[key] = self._access_counts.get(key, 0) + 1
                self._access_counts.move_to_end(key)
            while len(self._access_counts) > self.max_tracker_size:
                self._access_counts.popitem(last=False)

        candidates: list[OffloadKey] = []
        reused: list[OffloadKey] = []
        for key in offered:
            chunk = self.policy.get(key)
            if chunk is None:
                candidates.append(key)
            elif chunk.is_ready:
                reused.append(key)

        if self._access_counts is not None:
            counts = self._access_counts
            kept = [k for k in candidates if counts.get(k, 0) >= self.store_threshold]
            self.stats.stores_skipped += len(candidates) - len(kept)
            candidates = kept

        new_misses = [k for k in candidates if k not in state.store_missed]
        if new_misses:
            if c is self._anonymous and len(state.store_missed) > self.max_tracker_size:
                state.store_missed.clear()
            state.store_missed.update(new_misses)
            self.policy.on_store_miss(new_misses, c)
        # Recorded before allocating, so also when the call then returns None.  The
        # request's record holds what it stores and what it reuses; a key whose write is
        # still in flight for another request, or that the threshold held back, is
        # neither (its recency is not this request's to change at finish).
        recorded = set(candidates).union(reused)
        self._record(c, state, [k for k in offered if k in recorded], reused=reused)

        if not candidates:
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])

        need = len(candidates) - self.num_free_chunks
        evicted_keys: list[OffloadKey] = []
        if need > 0:
            if need > self._num_evictable:
                self.stats.store_refusals["no_space"] += 1
                return None
            evicted = self.policy.evict(need, set(offered))
            if evicted is None:
                self.stats.store_refusals["protected"] += 1
                return None
            self._num_evictable -= len(evicted)
            for key, chunk in evicted:
                self._free(chunk)
                evicted_keys.append(key)
            self.stats.evictions += len(evicted)
            if self.events is not None:
                self.events.append(OffloadingEvent(list(evicted_keys), self.medium, removed=True))

        chunk_ids = self._allocate(len(candidates))
        for key, chunk_id in zip(candidates, chunk_ids):
            self.policy.insert(key, ChunkStatus(chunk_id), c)
        if c is not self._anonymous:
            state.inserted.update(candidates)
        self.stats.stores_prepared += len(candidates)
        spec = CPULoadStoreSpec(np.array(chunk_ids, dtype=np.int32))  # ids < num_chunks
        return PrepareStoreOutput(candidates, spec, evicted_keys)

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None, success: bool = True
    ) -> None:
        """Finish the writes of the still-pending ``keys`` (others are ignored).

        ``success=True``: they become ready and evictable, and one stored event is
        emitted.  ``success=False``: they are dropped and their slots freed, with one
        ``metadata_only`` removal event.
        """
        done: list[OffloadKey] = []
        for key in _unique(keys):
            chunk = self.policy.get(key)
            if chunk is None or chunk.is_ready:
                continue
            if success:
                chunk.ref_cnt = 0
                self._num_evictable += 1
                self.policy.mark_evictable(key)
            else:
                self.policy.remove(key)
                self._free(chunk)
            done.append(key)
        if not done:
            return
        if success:
            self.stats.stores_completed += len(done)
            if self.events is not None:
                self.events.append(OffloadingEvent(done, self.medium, removed=False))
        else:
            self.stats.stores_failed += len(done)
            if self.events is not None:
                self.events.append(
                    OffloadingEvent(done, self.medium, removed=True, metadata_only=True)
                )

    def on_request_finished(self, ctx: ReqContext) -> None:
        """Hand the request's keys to the policy once (per KV group, head to tail).

        The groups go in group-index order; the built-in policies then walk all of the
        keys in one tail-to-head order by position.
        """
        state = self._state(ctx)
        if state.finished or ctx is self._anonymous:
            return
        state.finished = True
        groups: dict[int, list[OffloadKey]] = {}
        for key in state.keys:
            groups.setdefault(get_offload_group_idx(key), []).append(key)
        # Groups by index; within one, head to tail by position when every key has one,
        # else in the order the request first offered or loaded them.
        key_groups = [order_request_keys([groups[g]], ctx) for g in sorted(groups)]
        self.policy.on_request_finished(
            key_groups, state.inserted - state.reused, set(state.reused), ctx
        )
        state.store_missed.clear()

    def reset_cache(self) -> None:
        """Forget every chunk, slot and counter; emits **no** event (as vLLM's
        ``reset_connector`` path).

        Events not drained yet are kept: a failed store's ``metadata_only`` release is
        still reported, its key being absent after the reset.
        """
        self.policy.clear()
        self._num_allocated = 0
        self._free_list.clear()
        self._num_evictable = 0
        if self._access_counts is not None:
            self._access_counts.clear()
        self.generation += 1
        self.stats.resets += 1

    def take_events(self) -> list[OffloadingEvent]:
        """Detach and return the collected events (``[]`` when events are off).

        A ``metadata_only`` event keeps only its keys that are absent from the tier now
        (a key allocated again and still held is not released), and is dropped when
        none is left.
        """
        if self.events is None or not self.events:
            return []
        drained, self.events = self.events, []
        out: list[OffloadingEvent] = []
        for event in drained:
            if event.metadata_only:
                kept = [k for k in event.keys if self.policy.get(k) is None]
                self.stats.metadata_keys_filtered += len(event.keys) - len(kept)
                if not kept:
                    continue
                event.keys = kept
            out.append(event)
        self.stats.events_emitted += len(out)
        return out
