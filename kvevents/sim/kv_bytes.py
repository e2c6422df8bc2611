"""The simulated engine's KV bytes: one byte tensor of ``(num_gpu_blocks, page_bytes)`` on
``device`` (``"cpu"`` or ``"cuda"``) where every computed block holds bytes derived from
its hash (:func:`expected_block_bytes`), and the offload room's ``CPUTransferWorker``
that copies them to and from host chunks, so a load can be checked byte for byte.

One job: the bytes, not the bookkeeping (that is :mod:`kvevents.sim.offload`).  Imports
the sim block pool's ``NULL_BLOCK``; torch and
:mod:`kvevents.publishers.offload.transfer` only when byte transfers are on (torch is an
optional dependency: without it the copies are skipped and said so).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvevents.errors import ConfigError
from kvevents.sim.block_pool import NULL_BLOCK

__all__ = ["SimKVBytes", "expected_block_bytes"]

logger = logging.getLogger(__name__)


def expected_block_bytes(digest: bytes, group: int, page_bytes: int) -> bytes:
    """The simulated KV bytes of a computed block: the group id and its digest, repeated
    to ``page_bytes``."""
    seed = bytes([group & 0xFF]) + digest
    reps = -(-page_bytes // len(seed))
    return (seed * reps)[:page_bytes]


class SimKVBytes:
    """The simulated KV cache of one engine and its transfer worker.

    ``kv`` is the device tensor and ``worker`` the ``CPUTransferWorker`` over
    ``num_chunks`` host chunks of ``blocks_per_chunk`` blocks, both None when byte
    transfers are off; ``skip_reason`` then says why (``"disabled"``: ``transfers`` was
    False; ``"torch_missing"``).  :class:`ConfigError` when ``device`` is CUDA and CUDA
    is not available.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        num_chunks: int,
        blocks_per_chunk: int,
        block_sizes: Sequence[int],
        *,
        page_bytes: int = 64,
        transfers: bool = True,
        device: str = "cpu",
    ) -> None:
        self.block_sizes = list(block_sizes)
        self.page_bytes = page_bytes
        self.kv: Any = None
        self.worker: Any = None
        self._torch: Any = None
        self.skip_reason = ""
        if not transfers:
            self.skip_reason = "disabled"
        else:
            try:
                import torch

                from kvevents.publishers.offload.transfer import CPUTransferWorker
            except ImportError:
                self.skip_reason = "torch_missing"
            else:
                if device.startswith("cuda") and not torch.cuda.is_available():
                    raise ConfigError(f"device {device!r} asked for, but CUDA is not available")
                self._torch = torch
                self.kv = torch.zeros((num_gpu_blocks, page_bytes), dtype=torch.int8, device=device)
                self.worker = CPUTransferWorker([self.kv], num_chunks, blocks_per_chunk)
        if self.skip_reason:
            logger.info("simulated offload runs without byte transfers (%s)", self.skip_reason)

    def write_blocks(
        self,
        digests: Sequence[Sequence[bytes]],
        blocks: Sequence[Sequence[int]],
        start: int,
        end: int,
    ) -> None:
        """Fill the device blocks that become full while computing tokens ``[start, end)``."""
        if self.kv is None:
            return
        torch = self._torch
        ids: list[int] = []
        data = bytearray()
        for g, bs in enumerate(self.block_sizes):
            for i in range(start // bs, min(end // bs, len(digests[g]))):
                if blocks[g][i] == NULL_BLOCK:
                    continue
                ids.append(blocks[g][i])
                data += expected_block_bytes(digests[g][i], g, self.page_bytes)
        if not ids:
            return
        rows = torch.frombuffer(data, dtype=torch.int8).view(len(ids), self.page_bytes)
        index = torch.tensor(ids, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(0, index, rows.to(self.kv.device))

    def verify_blocks(
        self,
        digests: Sequence[Sequence[bytes]],
        blocks: Sequence[Sequence[int]],
        start: int,
        end: int,
    ) -> int:
        """How many blocks of ``[start, end)`` do not hold their expected bytes."""
        if self.kv is None:
            return 0
        bad = 0
        for g, bs in enumerate(self.block_sizes):
            kept = [i for i in range(start // bs, end // bs) if blocks[g][i] != NULL_BLOCK]
            if not kept:
                continue
            ids = [blocks[g][i] for i in kept]
            index = self._torch.tensor(ids, device=self.kv.device)
            got = self.kv.index_select(0, index).cpu().numpy().tobytes()
            p = self.page_bytes
            for j, i in enumerate(kept):
                if got[j * p : (j + 1) * p] != expected_block_bytes(digests[g][i], g, p):
                    bad += 1
        return bad
