"""What a simulated engine does with one request's blocks once they are computed:
cache its full blocks (GPU ``BlockStored``, with the request's extra keys), register the
partial tail of a group coarser than the hash unit, and free the sliding-window blocks
that left the window (vLLM's ``remove_skipped_blocks``).

One job: a request's block bookkeeping in the :class:`~kvevents.sim.block_pool.GPUBlockPool`.
Imports the block pool, the sim keys and :mod:`kvevents.sim.engine.running`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvevents.sim.block_pool import (
    NULL_BLOCK,
    GPUBlockPool,
    KVCacheGroupSpec,
    group_block_hashes,
)
from kvevents.sim.engine.running import RunningRequest, lora_id
from kvevents.sim.keys import event_extra_keys

__all__ = ["RequestBlocks"]


class RequestBlocks:
    """Block bookkeeping for the requests of one engine: ``pool`` shared by the KV-cache
    ``groups``, hashed at ``unit`` tokens, with ``lookahead`` tokens of lookahead
    hashing."""

    def __init__(
        self,
        pool: GPUBlockPool,
        groups: tuple[KVCacheGroupSpec, ...],
        unit: int,
        lookahead: int,
    ) -> None:
        self.pool = pool
        self.groups = groups
        self.unit = unit
        self.lookahead = lookahead

    def digests(self, run: RunningRequest) -> list[list[bytes]]:
        """Each group's block hashes of ``run``'s tokens so far (hashing what is new)."""
        raw = run.hasher.extend(run.tokens)
        return [group_block_hashes(raw, g.block_size, self.unit) for g in self.groups]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks ``num_tokens`` tokens take, summed over the groups."""
        return sum(-(-num_tokens // g.block_size) for g in self.groups)

    def cache_full(self, run: RunningRequest, digests: list[list[bytes]]) -> None:
        """Cache every full block of ``run`` not cached yet, in every group (GPU
        ``BlockStored`` with its extra keys), ``digests`` being :meth:`digests`."""
        lora = run.key.lora_name
        key = run.key
        extras_of: Callable[[int, int], Any] | None = None
        if lora is not None or key.cache_salt or key.mm_features or key.prompt_embeds is not None:

            def extras_of(start: int, end: int) -> Any:
                return event_extra_keys(key, start, end)

        for g, spec in enumerate(self.groups):
            num_full = min(len(run.tokens) // spec.block_size, len(digests[g]))
            self.pool.cache_full_blocks(
                run.blocks[g],
                digests[g],
                run.num_cached[g],
                num_full,
                run.tokens,
                g,
                spec,
                lora_id=lora_id(lora),
                lora_name=lora,
                event_extra_keys=extras_of,
                lookahead=self.lookahead,
            )
            run.num_cached[g] = max(run.num_cached[g], num_full)
            if spec.is_full and spec.block_size != self.unit:
                self._cache_partial_tail(run, g, spec, extras_of)

    def _cache_partial_tail(
        self,
        run: RunningRequest,
        g: int,
        spec: KVCacheGroupSpec,
        extras_of: Callable[[int, int], Any] | None,
    ) -> None:
        """vLLM's ``FullAttentionManager`` caching step for a group coarser than the hash
        unit: the prompt's last hash boundary, when it falls inside one of the group's
        blocks, is registered as a partial-tail entry of that block.  vLLM looks such
        entries up only in Mamba "align" hybrids, so here they are wire traffic a router
        must not credit."""
        unit = self.unit
        boundary = len(run.req.prompt) // unit * unit
        if boundary == 0 or boundary > len(run.tokens) or boundary % spec.block_size == 0:
            return
        index = boundary // spec.block_size
        raw = run.hasher.digests
        if index >= len(run.blocks[g]) or boundary // unit > len(raw):
            return
        lora = run.key.lora_name
        self.pool.cache_partial_block(
            run.blocks[g][index],
            raw[boundary // unit - 1],
            raw[boundary // unit - 2] if boundary > unit else None,
            boundary,
            run.tokens[boundary - unit : boundary],
            unit,
            g,
            spec,
            lora_id=lora_id(lora),
            lora_name=lora,
            extra_keys=extras_of(boundary - unit, boundary) if extras_of else None,
        )

    def remove_skipped(self, run: RunningRequest, computed: int) -> None:
        """Free the sliding-window blocks no longer in the window of a request with
        ``computed`` tokens computed (``remove_skipped_blocks``), nearest the window
        first, and hold null blocks in their place."""
        for g, spec in enumerate(self.groups):
            if spec.is_full:
                continue
            window = spec.sliding_window or 0
            last_useful = (computed - window + 1) // spec.block_size
            blocks = run.blocks[g]
            removed: list[int] = []
            for i in range(last_useful - 1, -1, -1):
                if blocks[i] == NULL_BLOCK:
                    break
                removed.append(blocks[i])
                blocks[i] = NULL_BLOCK
            self.pool.free(removed)
