"""Legacy offload events (vLLM <= 0.23): bytes hashes and no KV-cache group.

One job: find which group and which hash form a legacy CPU store or removal means, and
apply it through the public steps of :class:`~.stores.Stores` (``ref``, ``remove``,
``observe_tail``).  Imports :mod:`.records`, :mod:`.stores` and :mod:`.workers`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvevents.consumers.index.records import Hash, content_key
from kvevents.consumers.index.stores import Stores
from kvevents.consumers.index.workers import TIERS, GroupState, WorkerState
from kvevents.events import BlockStored

__all__ = ["legacy_remove", "legacy_store"]


def legacy_store(feed: Stores, w: WorkerState, ev: BlockStored, tier: int) -> None:
    """≤0.23 CPU store: bytes hashes, no group, meaningless block_size (vLLM ≤ 0.23).

    Each hash is looked up in every group of the worker, as the raw digest and as its wire
    int (the digest's last 8 bytes); repeated occurrences of one hash go to the next group
    that knows it (a hash can key several groups: their offload keys differ in the group
    suffix only).
    """
    used: dict[Hash, int] = {}
    for raw in ev.block_hashes:
        feed.stats.stored[TIERS[tier]] += 1
        found = _find(w, raw, used, lambda gs, h: h in gs.meta)
        if found is None:
            feed.stats.unjoined["legacy_unknown_hash"] += 1
            continue
        gs, h = found
        feed.stats.joined += 1
        m = gs.meta[h]
        feed.observe_tail(w, gs, m)
        feed.ref(w, gs, tier, h, content_key(m))


def legacy_remove(feed: Stores, w: WorkerState, hashes: Iterable[Hash], tier: int) -> None:
    """≤0.23 CPU removal: bytes hashes, no group; each looked up as :func:`legacy_store` does."""
    used: dict[Hash, int] = {}
    for raw in hashes:
        found = _find(w, raw, used, lambda gs, h: h in gs.refs[tier])
        if found is None:
            feed.stats.unknown_removals[TIERS[tier]] += 1
            continue
        gs, h = found
        feed.remove(w, gs.group, [h], tier)


def _find(
    w: WorkerState, raw: Hash, used: dict[Hash, int], has: Any
) -> tuple[GroupState, Hash] | None:
    """The (group, hash) ``raw`` stands for: the next group, in group order, whose
    ``has(group, hash)`` holds for the raw digest or its wire int."""
    forms: list[Hash] = [raw]
    if isinstance(raw, bytes):
        forms.append(int.from_bytes(raw[-8:], "big"))
    skip = used.get(raw, 0)
    for g in sorted(w.groups):
        gs = w.groups[g]
        for h in forms:
            if has(gs, h):
                if skip:
                    skip -= 1
                    break
                used[raw] = used.get(raw, 0) + 1
                return gs, h
    return None
