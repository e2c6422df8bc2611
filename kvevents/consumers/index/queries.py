"""Read-only answers about what the index holds: one entry, or per-worker totals.

One job: :func:`block_info` and :func:`summary` (the router's walks read the marks and
the layout instead).  Never writes index state.  Imports :mod:`.layout`,
:mod:`.records`, :mod:`.stats` and :mod:`.workers`.
"""

from __future__ import annotations

from kvevents.consumers.index.layout import slot_indexable
from kvevents.consumers.index.records import (
    Hash,
    block_size,
    content_key,
    end_tokens,
    extra_keys,
    gpu_refs,
    lora_name,
    parent_of,
    token_ids,
)
from kvevents.consumers.index.stats import BlockInfo, ChunkSpan, TierSummary, WorkerSummary
from kvevents.consumers.index.workers import TIERS, WorkerId, WorkerState

__all__ = ["block_info", "held_content_keys", "summary"]


def block_info(
    workers: dict[WorkerId, WorkerState], worker: WorkerId, group: int, block_hash: Hash
) -> BlockInfo | None:
    """What ``workers`` know about ``block_hash`` in ``group`` of ``worker``, or None."""
    w = workers.get(worker)
    gs = w.groups.get(group) if w is not None else None
    m = gs.meta.get(block_hash) if gs is not None else None
    if w is None or gs is None or m is None:
        return None
    tiers = frozenset(
        TIERS[t] for t in range(3) if (gpu_refs(m) > 0 if t == 0 else block_hash in gs.refs[t])
    )
    chunk = None
    if w.bpc and (block_hash in gs.refs[1] or block_hash in gs.refs[2]):
        hashes: list[Hash] = [block_hash]
        cur = m
        while len(hashes) < w.bpc:
            up = parent_of(cur)
            if up is None:
                break
            hashes.append(up)
            nxt = gs.meta.get(up)
            if nxt is None:
                break
            cur = nxt
        size = gs.block_size or block_size(m)
        span = w.bpc * size
        end = end_tokens(m)
        chunk = ChunkSpan(
            hashes=tuple(reversed(hashes)),
            start=end - span if end is not None else None,
            end=end,
            blocks_per_chunk=w.bpc,
            tokens=span,
        )
    end = end_tokens(m)
    return BlockInfo(
        group=group,
        block_size=block_size(m),
        start=end - block_size(m) if end is not None else None,
        end=end,
        parent=parent_of(m),
        lora_name=lora_name(m),
        extra_keys=extra_keys(m),
        kind=gs.kind,
        tiers=tiers,
        indexed=content_key(m) is not None and slot_indexable(w, gs),
        token_ids=token_ids(m),
        chunk=chunk,
    )


def summary(workers: dict[WorkerId, WorkerState]) -> dict[WorkerId, WorkerSummary]:
    """Per worker and tier: entries held (blocks on GPU, chunks elsewhere) and tokens."""
    out: dict[WorkerId, WorkerSummary] = {}
    for wid in sorted(workers):
        w = workers[wid]
        counts = [[0, 0], [0, 0], [0, 0]]
        retained = 0
        for gs in w.groups.values():
            retained += len(gs.meta)
            for m in gs.meta.values():
                if gpu_refs(m):
                    counts[0][0] += 1
                    counts[0][1] += block_size(m)
            for tier in (1, 2):
                for h in gs.refs[tier]:
                    tm = gs.meta.get(h)
                    size = block_size(tm) if tm is not None else 0
                    counts[tier][0] += 1
                    counts[tier][1] += size * (w.bpc or 1)
        out[wid] = WorkerSummary(
            worker=wid,
            groups=len(w.groups),
            blocks_per_chunk=w.bpc or None,
            tiers={TIERS[t]: TierSummary(counts[t][0], counts[t][1]) for t in range(3)},
            retained_metadata=retained,
        )
    return out


def held_content_keys(w: WorkerState, tier: int) -> set[int]:
    """Content keys of the blocks (GPU) or chunk tails (CPU/STORAGE) ``w`` holds on
    ``tier``, over all its groups."""
    out: set[int] = set()
    for gs in w.groups.values():
        if tier == 0:
            for m in gs.meta.values():
                ck = content_key(m)
                if ck is not None and gpu_refs(m):
                    out.add(ck)
        else:
            for h in gs.refs[tier]:
                tm = gs.meta.get(h)
                ck = content_key(tm) if tm is not None else None
                if ck is not None:
                    out.add(ck)
    return out
