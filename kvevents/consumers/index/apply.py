"""The batch apply loop: every event of a batch, in order, to the room that applies it.

One job: dispatch.  Each event goes through one path, whatever its shape:

* ``BlockStored`` on the GPU tier: :meth:`Stores.store_described` (records, content keys,
  GPU references);
* ``BlockStored`` on CPU/STORAGE: a self-describing chunk (it carries a block size and
  tokens) to :meth:`Stores.store_self_describing`, a vLLM <= 0.23 store (bytes hashes,
  no group) to :func:`.legacy.legacy_store`, anything else is a placeholder for
  :meth:`Stores.store_placeholder` (it joins its GPU record);
* ``BlockRemoved``: :meth:`RefRules.remove` (or :func:`.legacy.legacy_remove`);
* ``AllBlocksCleared``: :meth:`RefRules.clear_tiers`, keeping metadata.

A medium the index does not know (:data:`.workers.TIER_OF`) is counted as
``skipped["unknown_medium"]`` and changes nothing.  Imports :mod:`.legacy`,
:mod:`.stores` and :mod:`.workers`.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvevents.consumers.index.legacy import legacy_remove, legacy_store
from kvevents.consumers.index.records import Hash
from kvevents.consumers.index.stores import Stores
from kvevents.consumers.index.workers import GPU, TIER_OF, WorkerState
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch

__all__ = ["Feeder"]


def _is_legacy(ev: BlockStored | BlockRemoved) -> bool:
    """A vLLM <= 0.23 offload event: no group and bytes hashes."""
    return ev.group_idx is None and any(isinstance(h, bytes) for h in ev.block_hashes)


class Feeder(Stores):
    """Applies event batches to the index state (see the module docstring)."""

    def apply(self, source: str, dp_rank: int, batch: KVEventBatch) -> None:
        """Apply every event of ``batch`` from worker ``(source, dp_rank)`` in order."""
        self.stats.batches += 1
        self.apply_events(self.worker((source, dp_rank)), batch.events)

    def apply_event(self, w: WorkerState, ev: KVEvent) -> None:
        """Apply one event from worker ``w``."""
        self.apply_events(w, (ev,))

    def apply_events(self, w: WorkerState, events: Iterable[KVEvent]) -> None:
        """Apply ``events`` from worker ``w`` in order, each by the rule of its kind and
        tier (see the module docstring).

        Consecutive GPU removals of one group (vLLM publishes one per evicted block) are
        applied as one :meth:`RefRules.remove` of their hashes, in order: the same rule,
        called once per run of them instead of once per event."""
        stats = self.stats
        remove = self.remove
        run: list[Hash] = []  # hashes of the current run of GPU removals
        run_group = 0
        applied = block_events = 0
        try:
            for ev in events:
                applied += 1
                if type(ev) is BlockRemoved and ev.medium == "GPU":
                    group = ev.group_idx or 0
                    if run and group != run_group:
                        remove(w, run_group, run, GPU)
                        run = []
                    run_group = group
                    run += ev.block_hashes
                    block_events += len(ev.block_hashes)
                    continue
                if run:
                    remove(w, run_group, run, GPU)
                    run = []
                block_events += self.apply_other(w, ev)
            if run:
                remove(w, run_group, run, GPU)
        finally:
            stats.applied += applied
            stats.block_events += block_events

    def apply_other(self, w: WorkerState, ev: KVEvent) -> int:
        """Apply one event that is not a GPU removal; returns its block-events."""
        stats = self.stats
        if type(ev) is BlockRemoved:
            n = len(ev.block_hashes)
            tier = TIER_OF.get(ev.medium, -1)
            if tier < 0:
                stats.skipped["unknown_medium"] += n
            elif tier != GPU and _is_legacy(ev):
                legacy_remove(self, w, ev.block_hashes, tier)
            else:
                self.remove(w, ev.group_idx or 0, ev.block_hashes, tier)
            return n
        if type(ev) is BlockStored:
            n = len(ev.block_hashes)
            tier = TIER_OF.get(ev.medium, -1)
            if tier < 0:
                stats.skipped["unknown_medium"] += n
            elif tier == GPU:
                self.store_described(w, ev, tier)
            elif ev.block_size > 0 and ev.token_ids:
                self.store_self_describing(w, ev, tier)
            elif _is_legacy(ev):
                legacy_store(self, w, ev, tier)
            else:
                self.store_placeholder(w, ev, tier)
            return n
        if type(ev) is AllBlocksCleared:
            stats.cleared += 1
            self.clear_tiers(w, keep_metadata=True)
        else:  # pragma: no cover - the decoder yields only the three classes
            stats.skipped["unknown_event"] += 1
        return 0
