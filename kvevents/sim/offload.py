"""The simulated engine's CPU tier: a ``CPUOffloadingManager``, its event translator and
the block transfers, driven the way vLLM's offload scheduler drives them.

* Keys: for group ``g`` with ``T = block_size × blocks_per_chunk`` tokens per chunk, chunk
  ``c`` is keyed by the request's raw hash at its last hash boundary
  (``make_offload_key(raw[(c+1)·T/unit − 1], g)``), which is the GPU hash of the chunk's
  last block in that group.  The key's end position ``(c+1)·T`` is set on the request
  context (the LRU policy ranks a request's keys by it).
* Lookup is vLLM's ``_lookup_complete_chunks``: a bound starting at the request's length,
  tightened group by group to the end of its consecutive stored chunks from the chunk
  holding the GPU hit's end; less than one of the group's chunks beyond the GPU hit is
  no hit at all (partial chunks are never credited).
* Stores: ``prepare_store``, then one batched device→host copy per group through the
  offload room's ``CPUTransferWorker``; ``complete_store`` runs at the start of a later
  step, once the copies have finished (the transfer is asynchronous in vLLM), so CPU
  ``BlockStored`` events trail the GPU ones.
* Loads: ``prepare_load`` (pins), a host→device copy into the request's fresh blocks
  (skipping blocks of a first chunk that the GPU hit already covers), waited for, then
  ``complete_load``.

The simulated KV bytes and their copies are :mod:`kvevents.sim.kv_bytes`' (every
computed block holds bytes derived from its hash, :func:`expected_block_bytes`, so a load
can be checked).  Without torch (or with ``transfers=False``) the manager and its events
work the same and the byte copies are skipped (counted in ``stats.transfers_skipped``).

One job: the CPU tier's bookkeeping as vLLM's scheduler drives it.  Imports the offload
room of the publishers (no torch) and :mod:`kvevents.sim.kv_bytes`.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvevents.errors import OffloadError
from kvevents.events import KVEvent
from kvevents.publishers.offload import (
    CPULoadStoreSpec,
    CPUOffloadingManager,
    GPULoadStoreSpec,
    OffloadEventTranslator,
    OffloadGroup,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from kvevents.sim.block_pool import NULL_BLOCK
from kvevents.sim.kv_bytes import SimKVBytes
from kvevents.sim.kv_bytes import expected_block_bytes as expected_block_bytes  # re-exported

__all__ = ["OffloadSimStats", "SimOffload", "expected_block_bytes"]

logger = logging.getLogger(__name__)


@dataclass
class OffloadSimStats:
    """Counters of the simulated CPU tier (chunks are CPU chunks, blocks GPU blocks)."""

    lookups: int = 0
    lookups_deferred: int = 0
    chunks_not_offered_null: int = 0
    cut_by_window: int = 0
    """CPU lookups whose bound a sliding-window group lowered (or zeroed)."""
    chunks_stored: int = 0
    chunks_loaded: int = 0
    stores_rejected: int = 0
    blocks_copied_to_host: int = 0
    blocks_copied_to_device: int = 0
    transfer_failures: int = 0
    transfers_skipped: Counter[str] = field(default_factory=Counter)


@dataclass
class _PendingStore:
    keys: list[OffloadKey]
    ctx: ReqContext
    jobs: set[int]
    ok: bool = True
    epoch: int = 0


class SimOffload:
    """CPU offload for one engine.  ``block_sizes`` are the groups' GPU block sizes."""

    def __init__(
        self,
        num_chunks: int,
        blocks_per_chunk: int,
        block_sizes: Sequence[int],
        *,
        cache_policy: str = "lru",
        num_gpu_blocks: int,
        page_bytes: int = 64,
        transfers: bool = True,
        device: str = "cpu",
        eagle_drop: bool = False,
        windows: Sequence[int | None] | None = None,
    ) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        self.eagle_drop = eagle_drop
        self.block_sizes = list(block_sizes)
        self.unit = math.gcd(*self.block_sizes)
        self.tokens_per_chunk = [bs * blocks_per_chunk for bs in self.block_sizes]
        self.hashes_per_chunk = [t // self.unit for t in self.tokens_per_chunk]
        # sliding-window groups: the window in chunks (vLLM's
        # sliding_window_size_in_chunks, with no extra retained tokens); None: full
        self.windows = list(windows) if windows is not None else [None] * len(self.block_sizes)
        self.window_chunks: list[int | None] = [
            None if w is None else -(-w // tpc)
            for w, tpc in zip(self.windows, self.tokens_per_chunk)
        ]
        # vLLM's lookup order: full-attention groups (prefix scan), then windowed ones
        self.lookup_order = [g for g, w in enumerate(self.windows) if w is None] + [
            g for g, w in enumerate(self.windows) if w is not None
        ]
        self.page_bytes = page_bytes
        self.manager = CPUOffloadingManager(
            num_chunks, cache_policy=cache_policy, enable_events=True
        )
        self.translator = OffloadEventTranslator(
            [OffloadGroup(bs) for bs in self.block_sizes], blocks_per_chunk=blocks_per_chunk
        )
        self.stats = OffloadSimStats()
        self._pending: list[_PendingStore] = []
        self._epoch = 0
        self._finished_jobs: dict[int, bool] = {}
        self._job_ids = itertools.count()
        self._ctx: dict[str, ReqContext] = {}
        self._offered: dict[str, list[int]] = {}
        self.bytes = SimKVBytes(
            num_gpu_blocks,
            num_chunks,
            blocks_per_chunk,
            self.block_sizes,
            page_bytes=page_bytes,
            transfers=transfers,
            device=device,
        )
        """The simulated KV bytes and their transfer worker."""
        self.kv: Any = self.bytes.kv
        self.worker: Any = self.bytes.worker
        self._skip_reason = self.bytes.skip_reason

    # --- keys ---------------------------------------------------------------------------
    def key(self, raw: Sequence[bytes], group: int, chunk: int) -> OffloadKey:
        """The offload key of ``chunk`` in ``group`` for a request with raw hashes ``raw``."""
        digest = raw[(chunk + 1) * self.hashes_per_chunk[group] - 1]
        return make_offload_key(digest, group)

    def context(self, req_id: str) -> ReqContext:
        """The request's ``ReqContext`` (created on first use)."""
        ctx = self._ctx.get(req_id)
        if ctx is None:
            ctx = self._ctx[req_id] = ReqContext(req_id=req_id)
        return ctx

    # --- scheduler-side calls -----------------------------------------------------------
    def _probe(self, raw: Sequence[bytes], g: int, chunks: range) -> list[str | None]:
        return [
            getattr(self.manager.lookup(self.key(raw, g, c), None), "name", None) for c in chunks
        ]

    def lookup(self, raw: Sequence[bytes], gpu_hit: int, num_tokens: int) -> int | None:
        """Tokens the CPU tier adds after a GPU hit of ``gpu_hit`` tokens, counted as vLLM's
        ``OffloadingConnectorScheduler._lookup_complete_chunks`` counts them.

        A running bound starts at ``num_tokens`` (one less with sliding-window groups).
        Each group in vLLM's order (full attention first, then sliding window) first caps
        it at its own chunk keys' end; if less than one of its chunks then lies beyond
        the GPU hit, nothing is loaded.  A full-attention group counts the consecutive
        stored chunks from the chunk holding the GPU hit's end (in eagle drop mode
        dropping the last one); a sliding-window group scans from the bound backwards
        for the window's worth of consecutive stored chunks (``_sliding_window_lookup``).
        Either tightens the bound to the end of what it found; nothing found, or less
        than one of its chunks beyond the GPU hit, means nothing at all.  When a group
        after a sliding-window group lowers the bound, the sliding-window groups are
        checked again at the new bound.  The answer is the final bound minus the GPU
        hit: whole chunks of every group, never rounded to the groups' lcm.  ``None``
        when a counted chunk is still being written (``HIT_PENDING``): vLLM then defers
        the request and asks again in a later step.
        """
        self.stats.lookups += 1
        bound = num_tokens - (1 if any(w is not None for w in self.windows) else 0)
        hit = 0
        pending = False
        order: list[int] = self.lookup_order
        windowed = [g for g in self.lookup_order if self.windows[g] is not None]
        while order:
            looked_sw = False
            groups, order = order, []
            for g in groups:
                tpc = self.tokens_per_chunk[g]
                num_keys = len(raw) // self.hashes_per_chunk[g]
                bound = min(bound, num_keys * tpc)
                if bound - gpu_hit < tpc:
                    return 0
                first = gpu_hit // tpc
                probes = self._probe(raw, g, range(first, min(-(-bound // tpc), num_keys)))
                window = self.window_chunks[g]
                found = 0
                if window is None:
                    for res in probes:
                        if res not in ("HIT", "HIT_PENDING"):
                            break
                        pending |= res == "HIT_PENDING"
                        found += 1
                else:
                    run = 0
                    for i in range(len(probes) - 1, -1, -1):
                        if probes[i] in ("HIT", "HIT_PENDING"):
                            pending |= probes[i] == "HIT_PENDING"
                            run += 1
                        else:
                            run = 0
                        if run == window:
                            found = i + window
                            break
                    else:
                        found = run
                if found == 0:
                    self.stats.cut_by_window += window is not None
                    return 0
                if self.eagle_drop:
                    found -= 1
                if window is not None and tpc * (first + found) < bound:
                    self.stats.cut_by_window += 1
                bound = min(bound, tpc * (first + found))
                new = bound - gpu_hit
                if new < tpc:
                    return 0
                if new < hit and looked_sw and not order:
                    order = list(windowed)  # confirm the windows at the lower bound
                looked_sw |= window is not None
                hit = new
        if pending:
            self.stats.lookups_deferred += 1
            return None
        return hit

    def load(
        self,
        raw: Sequence[bytes],
        blocks: Sequence[Sequence[int]],
        start: int,
        end: int,
        req_id: str,
    ) -> None:
        """Load tokens ``[start, end)`` of every group from CPU chunks into ``blocks``."""
        ctx = self.context(req_id)
        for g, tpc in enumerate(self.tokens_per_chunk):
            bs = self.block_sizes[g]
            first, last = start // bs, end // bs
            while first < last and blocks[g][first] == NULL_BLOCK:
                first += 1  # a sliding-window group loads only the blocks it keeps
            if first >= last:
                continue
            chunks = list(range(first * bs // tpc, -(-end // tpc)))
            keys = [self.key(raw, g, c) for c in chunks]
            spec = self.manager.prepare_load(keys, ctx)
            try:
                if self.worker is not None and last > first:
                    job = next(self._job_ids)
                    dst = GPULoadStoreSpec(list(blocks[g][first:last]), None, [first])
                    self.worker.submit_load(job, spec, dst)
                    self.worker.wait([job])
                    self.stats.blocks_copied_to_device += last - first
                elif self.worker is None:
                    self.stats.transfers_skipped[self._skip_reason] += 1
            finally:
                self.manager.complete_load(keys, ctx)
            self.stats.chunks_loaded += len(keys)

    def store(
        self, raw: Sequence[bytes], blocks: Sequence[Sequence[int]], upto: int, req_id: str
    ) -> int:
        """Offer every full chunk of ``[0, upto)`` not offered yet for this request and
        copy the accepted ones to host memory.  Returns the number of keys offered."""
        ctx = self.context(req_id)
        offered = self._offered.setdefault(req_id, [0] * len(self.block_sizes))
        keys: list[OffloadKey] = []
        where: dict[OffloadKey, tuple[int, int]] = {}
        for g, tpc in enumerate(self.tokens_per_chunk):
            n_chunks = min(upto, len(raw) * self.unit) // tpc
            bpc = self.blocks_per_chunk
            for c in range(offered[g], n_chunks):
                if NULL_BLOCK in blocks[g][c * bpc : (c + 1) * bpc]:
                    self.stats.chunks_not_offered_null += 1
                    continue  # out of a sliding window: nothing on the GPU to copy
                k = self.key(raw, g, c)
                ctx.set_position(k, (c + 1) * tpc)
                keys.append(k)
                where[k] = (g, c)
            offered[g] = max(offered[g], n_chunks)
        if not keys:
            return 0
        out = self.manager.prepare_store(keys, ctx)
        if out is None:
            self.stats.stores_rejected += 1
            return len(keys)
        to_store = list(out.keys_to_store)
        if not to_store:
            return len(keys)
        pending = _PendingStore(to_store, ctx, set(), epoch=self._epoch)
        spec = out.store_spec
        if not isinstance(spec, CPULoadStoreSpec):
            raise OffloadError("the manager's store spec is not a CPU chunk spec")
        chunk_ids = [int(i) for i in spec.block_ids]
        if self.worker is not None:
            bpc = self.blocks_per_chunk
            for g in range(len(self.block_sizes)):
                mine = [(k, row) for k, row in zip(to_store, chunk_ids) if where[k][0] == g]
                if not mine:
                    continue
                src: list[int] = []
                for k, _ in mine:
                    c = where[k][1]
                    src.extend(blocks[g][c * bpc : (c + 1) * bpc])
                job = next(self._job_ids)
                dst = CPULoadStoreSpec([row for _, row in mine])
                self.worker.submit_store(job, src, dst)
                pending.jobs.add(job)
                self.stats.blocks_copied_to_host += len(src)
        else:
            self.stats.transfers_skipped[self._skip_reason] += 1
        self._pending.append(pending)
        return len(keys)

    def finished(self, req_id: str) -> None:
        """The request will submit nothing more (``on_request_finished``)."""
        ctx = self._ctx.pop(req_id, None)
        self._offered.pop(req_id, None)
        if ctx is not None:
            self.manager.on_request_finished(ctx)

    def has_pending(self) -> bool:
        """Stores submitted and not completed yet."""
        return bool(self._pending)

    def complete_pending(self) -> None:
        """End of an engine step: complete the stores submitted in an earlier step whose
        copies have finished (in submission order).  A store submitted in this step
        completes at the end of the next one at the earliest, as vLLM's worker submits a
        step's stores at the start of the following step."""
        if self.worker is not None:
            for r in self.worker.get_finished():
                self._finished_jobs[r.job_id] = r.success
        still: list[_PendingStore] = []
        for p in self._pending:
            if p.epoch >= self._epoch or any(j not in self._finished_jobs for j in p.jobs) or still:
                still.append(p)
                continue
            ok = all(self._finished_jobs.pop(j) for j in p.jobs)
            if not ok:
                self.stats.transfer_failures += 1
            self.manager.complete_store(p.keys, p.ctx, success=ok)
            self.stats.chunks_stored += len(p.keys) if ok else 0
        self._pending = still
        self._finished_jobs = {
            j: s for j, s in self._finished_jobs.items() if any(j in p.jobs for p in still)
        }
        self._epoch += 1

    def take_events(self) -> list[KVEvent]:
        """Manager events translated to KV events (placeholders), in manager order."""
        return list(self.translator.translate(self.manager.take_events()))

    def reset(self) -> None:
        """Reset the CPU tier (emits nothing, as in vLLM)."""
        if self.worker is not None:
            self.worker.wait()
            self.worker.get_finished()
        self.manager.reset_cache()
        self._pending.clear()
        self._finished_jobs.clear()

    # --- simulated bytes ------------------------------------------------------------------
    def write_blocks(
        self,
        digests: Sequence[Sequence[bytes]],
        blocks: Sequence[Sequence[int]],
        start: int,
        end: int,
    ) -> None:
        """Fill the device blocks that become full while computing tokens ``[start, end)``
        (see :meth:`SimKVBytes.write_blocks`)."""
        self.bytes.write_blocks(digests, blocks, start, end)

    def verify_blocks(
        self,
        digests: Sequence[Sequence[bytes]],
        blocks: Sequence[Sequence[int]],
        start: int,
        end: int,
    ) -> int:
        """How many blocks of ``[start, end)`` do not hold their expected bytes."""
        return self.bytes.verify_blocks(digests, blocks, start, end)
