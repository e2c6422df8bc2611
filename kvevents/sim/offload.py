"""The simulated engine's CPU tier: a ``CPUOffloadingManager``, its event translator and
the block transfers, driven the way vLLM's offload scheduler drives them (C§5.3, C§5.7).

* Keys: for group ``g`` with ``T = block_size × blocks_per_chunk`` tokens per chunk, chunk
  ``c`` is keyed by the request's raw hash at its last hash boundary
  (``make_offload_key(raw[(c+1)·T/unit − 1], g)``), which is the GPU hash of the chunk's
  last block in that group.
* Lookup counts consecutive whole-chunk hits after the GPU hit, per group, and keeps the
  smallest end; less than one chunk beyond the GPU hit in any group is no hit.
* Stores copy the chunk's GPU blocks into a host chunk row; ``complete_store`` runs at
  the next step (the transfer is asynchronous in vLLM), so CPU ``BlockStored`` events
  trail the GPU ones.
* Loads copy host chunk rows back into fresh GPU blocks (pinned between
  ``prepare_load`` and ``complete_load``).

Without torch (or with ``transfers=False``) the manager and events work the same and the
byte copies are skipped (counted in ``stats.transfers_skipped``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvevents.events import KVEvent

__all__ = ["OffloadSimStats", "SimOffload", "expected_block_bytes", "offload_available"]

logger = logging.getLogger(__name__)


def offload_available() -> bool:
    """True when :mod:`kvevents.publishers.offload` (the CPU offloading manager) exists."""
    try:
        return importlib.util.find_spec("kvevents.publishers.offload") is not None
    except ModuleNotFoundError:  # pragma: no cover - parent package missing
        return False


def _torch() -> Any | None:
    try:
        import torch
    except ImportError:
        return None
    return torch


def expected_block_bytes(digest: bytes, group: int, page_bytes: int) -> bytes:
    """The simulated KV bytes of a computed block: the group id and its digest, repeated
    to ``page_bytes``."""
    seed = bytes([group & 0xFF]) + digest
    reps = -(-page_bytes // len(seed))
    return (seed * reps)[:page_bytes]


@dataclass
class OffloadSimStats:
    """Counters of the simulated CPU tier."""

    lookups: int = 0
    chunk_hits: int = 0
    chunks_stored: int = 0
    chunks_loaded: int = 0
    stores_rejected: int = 0
    blocks_copied_to_host: int = 0
    blocks_copied_to_device: int = 0
    transfers_skipped: Counter[str] = field(default_factory=Counter)


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
    ) -> None:
        off: Any = importlib.import_module("kvevents.publishers.offload")
        self._off = off
        self.blocks_per_chunk = blocks_per_chunk
        self.block_sizes = list(block_sizes)
        import math

        self.unit = math.gcd(*self.block_sizes)
        self.tokens_per_chunk = [bs * blocks_per_chunk for bs in self.block_sizes]
        self.hashes_per_chunk = [t // self.unit for t in self.tokens_per_chunk]
        self.page_bytes = page_bytes
        self.manager = off.CPUOffloadingManager(
            num_chunks, cache_policy=cache_policy, enable_events=True
        )
        self.translator = off.OffloadEventTranslator(
            [off.OffloadGroup(bs) for bs in self.block_sizes], blocks_per_chunk=blocks_per_chunk
        )
        self.stats = OffloadSimStats()
        self._pending: list[tuple[list[bytes], Any]] = []
        self._ctx: dict[str, Any] = {}
        self._offered: dict[str, list[int]] = {}
        torch = _torch() if transfers else None
        self._torch: Any = torch
        self.device: Any = None
        self.host: Any = None
        if torch is not None:
            self.device = torch.zeros((num_gpu_blocks, page_bytes), dtype=torch.uint8)
            self.host = torch.zeros((num_chunks, page_bytes * blocks_per_chunk), dtype=torch.uint8)
        else:
            reason = "torch_missing" if transfers else "disabled"
            logger.info("simulated offload runs without byte transfers (%s)", reason)
            self._skip_reason = reason

    # --- keys ---------------------------------------------------------------------------
    def key(self, raw: Sequence[bytes], group: int, chunk: int) -> bytes:
        """The offload key of ``chunk`` in ``group`` for a request with raw hashes ``raw``."""
        digest = raw[(chunk + 1) * self.hashes_per_chunk[group] - 1]
        return bytes(self._off.make_offload_key(digest, group))

    def context(self, req_id: str) -> Any:
        ctx = self._ctx.get(req_id)
        if ctx is None:
            ctx = self._ctx[req_id] = self._off.ReqContext(req_id=req_id)
        return ctx

    # --- scheduler-side calls -----------------------------------------------------------
    def lookup(self, raw: Sequence[bytes], gpu_hit: int, limit: int, align: int) -> int:
        """The end (in tokens) of the CPU hit after ``gpu_hit``, at most ``limit`` and a
        multiple of ``align``; ``gpu_hit`` when the CPU tier adds nothing."""
        self.stats.lookups += 1
        end = limit
        for g, tpc in enumerate(self.tokens_per_chunk):
            c = gpu_hit // tpc
            last = -1
            while (c + 1) * tpc <= limit:
                res = self.manager.lookup(self.key(raw, g, c), None)
                if not _is_hit(res):
                    break
                last = c
                c += 1
            group_end = tpc * (last + 1)
            if last < 0 or group_end <= gpu_hit:
                return gpu_hit
            end = min(end, group_end)
        end = (end // align) * align
        return end if end > gpu_hit else gpu_hit

    def load(
        self,
        raw: Sequence[bytes],
        blocks: Sequence[Sequence[int]],
        start: int,
        end: int,
        req_id: str,
    ) -> bool:
        """Load tokens ``[start, end)`` of every group from CPU chunks into ``blocks``."""
        ctx = self.context(req_id)
        for g, tpc in enumerate(self.tokens_per_chunk):
            bs = self.block_sizes[g]
            chunks = list(range(start // tpc, -(-end // tpc)))
            keys = [self.key(raw, g, c) for c in chunks]
            spec = self.manager.prepare_load(keys, ctx)
            chunk_ids = list(_chunk_ids(spec))
            try:
                if self.device is not None:
                    for c, row in zip(chunks, chunk_ids):
                        for j in range(self.blocks_per_chunk):
                            b_idx = c * self.blocks_per_chunk + j
                            if b_idx * bs < start or (b_idx + 1) * bs > end:
                                continue
                            self._copy_to_device(int(row), j, blocks[g][b_idx])
                else:
                    self.stats.transfers_skipped[self._skip_reason] += 1
            finally:
                self.manager.complete_load(keys, ctx)
            self.stats.chunks_loaded += len(keys)
            self.stats.chunk_hits += len(keys)
        return True

    def store(
        self, raw: Sequence[bytes], blocks: Sequence[Sequence[int]], upto: int, req_id: str
    ) -> int:
        """Offer every full chunk of ``[0, upto)`` not offered yet for this request;
        copies the accepted ones to host memory.  Returns the number of keys offered."""
        ctx = self.context(req_id)
        offered = self._offered.setdefault(req_id, [0] * len(self.block_sizes))
        keys: list[bytes] = []
        where: dict[bytes, tuple[int, int]] = {}
        for g, tpc in enumerate(self.tokens_per_chunk):
            n_chunks = min(upto, len(raw) * self.unit) // tpc
            for c in range(offered[g], n_chunks):
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
        to_store = [bytes(k) for k in out.keys_to_store]
        if to_store:
            rows = list(_chunk_ids(out.store_spec))
            if self.device is not None:
                for k, row in zip(to_store, rows):
                    g, c = where[k]
                    for j in range(self.blocks_per_chunk):
                        self._copy_to_host(blocks[g][c * self.blocks_per_chunk + j], int(row), j)
            else:
                self.stats.transfers_skipped[self._skip_reason] += 1
            self._pending.append((to_store, ctx))
        return len(keys)

    def finished(self, req_id: str) -> None:
        """The request will submit nothing more (``on_request_finished``)."""
        ctx = self._ctx.pop(req_id, None)
        self._offered.pop(req_id, None)
        if ctx is not None:
            self.manager.on_request_finished(ctx)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def complete_pending(self) -> None:
        """Report last step's stores as complete."""
        pending, self._pending = self._pending, []
        for keys, ctx in pending:
            self.manager.complete_store(keys, ctx)
            self.stats.chunks_stored += len(keys)

    def take_events(self) -> list[KVEvent]:
        """Manager events translated to KV events (placeholders), in manager order."""
        return list(self.translator.translate(self.manager.take_events()))

    def reset(self) -> None:
        """Reset the CPU tier (emits nothing, C§6.2)."""
        self.manager.reset_cache()
        self._pending.clear()

    # --- simulated bytes ------------------------------------------------------------------
    def write_blocks(
        self,
        digests: Sequence[Sequence[bytes]],
        blocks: Sequence[Sequence[int]],
        start: int,
        end: int,
    ) -> None:
        """Fill the device blocks that become full while computing tokens ``[start, end)``."""
        if self.device is None:
            return
        torch = self._torch
        for g, bs in enumerate(self.block_sizes):
            for i in range(start // bs, min(end // bs, len(digests[g]))):
                data = expected_block_bytes(digests[g][i], g, self.page_bytes)
                self.device[blocks[g][i]] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def verify_blocks(
        self,
        digests: Sequence[Sequence[bytes]],
        blocks: Sequence[Sequence[int]],
        start: int,
        end: int,
    ) -> int:
        """How many blocks of ``[start, end)`` do not hold their expected bytes."""
        if self.device is None:
            return 0
        bad = 0
        for g, bs in enumerate(self.block_sizes):
            for i in range(start // bs, end // bs):
                want = expected_block_bytes(digests[g][i], g, self.page_bytes)
                if bytes(self.device[blocks[g][i]].numpy().tobytes()) != want:
                    bad += 1
        return bad

    def _copy_to_host(self, block: int, row: int, slot: int) -> None:
        p = self.page_bytes
        self.host[row, slot * p : (slot + 1) * p].copy_(self.device[block])
        self.stats.blocks_copied_to_host += 1

    def _copy_to_device(self, row: int, slot: int, block: int) -> None:
        p = self.page_bytes
        self.device[block].copy_(self.host[row, slot * p : (slot + 1) * p])
        self.stats.blocks_copied_to_device += 1


def _is_hit(result: Any) -> bool:
    name = getattr(result, "name", None)
    if name is not None:
        return bool(name == "HIT")
    return bool(result)


def _chunk_ids(spec: Any) -> Sequence[int]:
    ids = getattr(spec, "chunk_ids", None)
    if ids is None:
        ids = spec.block_ids
    return list(int(i) for i in ids)
