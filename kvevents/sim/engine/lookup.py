"""The GPU prefix-cache lookup of a simulated engine, as vLLM's KV-cache coordinators
do it: one group walks its cached prefix (``find_longest_cache_hit`` of the full
attention and sliding-window managers); several groups are reconciled as the hybrid
coordinator does (hits aligned to the least common multiple of the block sizes, full
attention first, repeated until every group agrees).

One job: finding the GPU hit.  Reads the :class:`~kvevents.sim.block_pool.GPUBlockPool`
(never changes it) and counts cut hits in :class:`~kvevents.sim.engine.records.EngineStats`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvevents.sim.block_pool import NULL_BLOCK, GPUBlockPool, KVCacheGroupSpec
from kvevents.sim.engine.records import EngineStats

__all__ = ["GPULookup", "SpecGroup"]


@dataclass(frozen=True)
class SpecGroup:
    """Groups sharing one spec: looked up together (a hit needs every one of them)."""

    spec: KVCacheGroupSpec
    ids: tuple[int, ...]


class GPULookup:
    """``get_computed_blocks`` over ``pool`` for the KV-cache ``groups``.

    Identical specs are looked up together, full attention first (stable), then the
    others in group order (vLLM's ``HybridKVCacheCoordinator``).  ``eagle_drop`` drops
    the last matched block of a hit.  Hits cut by the groups or by the alignment are
    counted in ``stats``.
    """

    def __init__(
        self,
        pool: GPUBlockPool,
        groups: tuple[KVCacheGroupSpec, ...],
        *,
        eagle_drop: bool,
        stats: EngineStats,
    ) -> None:
        self.pool = pool
        self.groups = groups
        self.eagle_drop = eagle_drop
        self.stats = stats
        self.align = math.lcm(*(g.block_size for g in groups))
        spec_groups: list[SpecGroup] = []
        for i, g in enumerate(groups):
            for j, sg in enumerate(spec_groups):
                if sg.spec == g:
                    spec_groups[j] = SpecGroup(g, (*sg.ids, i))
                    break
            else:
                spec_groups.append(SpecGroup(g, (i,)))
        spec_groups.sort(key=lambda sg: not sg.spec.is_full)
        self.spec_groups = spec_groups
        """The groups in lookup order, identical specs merged."""

    def _cached(self, digests: list[list[bytes]], sg: SpecGroup, i: int) -> list[int] | None:
        """vLLM's ``get_cached_block``: block ``i`` of every group of ``sg``, or ``None``."""
        out = []
        for g in sg.ids:
            b = self.pool.cached_block(digests[g][i], g)
            if b is None:
                return None
            out.append(b)
        return out

    def _lookup_group(
        self,
        digests: list[list[bytes]],
        sg: SpecGroup,
        max_length: int,
        align: int,
        drop: bool,
    ) -> list[list[int]]:
        """One spec group's hit (``FullAttentionManager`` / ``SlidingWindowManager``
        ``find_longest_cache_hit``): per position, the blocks of each of its groups
        (null blocks before a sliding window)."""
        bs = sg.spec.block_size
        n = min(max_length // bs, len(digests[sg.ids[0]]))
        if sg.spec.is_full:
            hit: list[list[int]] = []
            for i in range(n):
                blocks = self._cached(digests, sg, i)
                if blocks is None:
                    break
                hit.append(blocks)
            if drop and hit:
                hit.pop()
            if bs != align and len(hit) * bs % align:
                self.stats.hits_cut_by_alignment += 1
                while len(hit) * bs % align:
                    hit.pop()
            return hit
        window = sg.spec.sliding_window or 0
        need = -(-(window - 1) // bs) + (1 if drop else 0)
        null = [NULL_BLOCK] * len(sg.ids)
        out: list[list[int]] = [null] * n
        run = 0
        found = False
        for i in range(n - 1, -1, -1):
            blocks = self._cached(digests, sg, i)
            if blocks is None:
                run = 0
                continue
            if run == 0 and bs != align and (i + 1) * bs % align:
                continue  # a hit must end on an aligned boundary
            out[i] = blocks
            run += 1
            if run >= need:
                del out[i + run :]
                found = True
                break
        if not found:
            del out[run:]  # the run that reached block 0 is a hit, even if short
            while bs != align and len(out) * bs % align:
                out.pop()
        if drop and out:
            out.pop()
        return out

    def find_gpu_hit(
        self, digests: list[list[bytes]], num_tokens: int
    ) -> tuple[int, list[list[int]]]:
        """The GPU hit in tokens and each group's hit blocks (``get_computed_blocks``)."""
        max_length = num_tokens - 1  # the last token is always recomputed
        drop = self.eagle_drop
        if len(self.groups) == 1:
            sg = self.spec_groups[0]
            hit = self._lookup_group(digests, sg, max_length, sg.spec.block_size, drop)
            return len(hit) * sg.spec.block_size, [[b[0] for b in hit]]
        align = self.align
        sgs = self.spec_groups
        simple = len(sgs) == 2 and sgs[0].spec.is_full
        found: dict[int, list[list[int]]] = {}
        lengths: dict[int, int] = {}
        hit_length = max_length
        while True:
            curr = hit_length
            for k, sg in enumerate(sgs):
                if sg.spec.is_full and k in found:
                    curr = min(curr, lengths[k])  # full attention is downward-closed
                    continue
                blocks = self._lookup_group(digests, sg, curr, align, False)
                found[k] = blocks
                got = len(blocks) * sg.spec.block_size
                if k > 0 and got < curr:
                    self.stats.hits_cut_by_groups += 1
                lengths[k] = curr = got
            if curr >= hit_length:
                break
            hit_length = curr
            if simple:
                break
        per_group: list[list[int]] = [[] for _ in self.groups]
        for k, sg in enumerate(sgs):
            blocks = found.get(k, [])
            if sg.spec.is_full:
                blocks = blocks[: -(-hit_length // sg.spec.block_size)]
            for j, g in enumerate(sg.ids):
                per_group[g] = [b[j] for b in blocks]
        return hit_length, per_group
