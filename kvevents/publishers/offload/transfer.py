"""Device ↔ host block transfers for the CPU offload tier (the only torch module; vLLM's
``cpu/gpu_worker.py``).

Layout:

* every device KV tensor has the block index as its first dimension and is viewed as
  bytes, ``(num_blocks, page_bytes)``; several tensors (layers, K and V) share one block
  table, so a transfer copies the same block ids in each;
* :class:`HostChunkBuffers` holds, per device tensor, a host tensor of
  ``(num_chunks, page_bytes × blocks_per_chunk)`` bytes (pinned when CUDA is present),
  viewed as ``(num_chunks × blocks_per_chunk, page_bytes)`` rows: device block ``j`` of
  chunk ``c`` lives in row ``c·blocks_per_chunk + j``.

Copies are batched and move every byte once.  On CPU the transfer's rows are sorted and
split into runs of consecutive rows, either on the destination side (one
``torch.index_select(src, 0, idx, out=dst[run])`` per run) or on the source side (one
``dst.index_copy_(0, idx, src[run])`` per run), whichever gives fewer calls; there is no
Python loop per block.  Both run on torch's intra-op threads (``torch.set_num_threads``),
the threads torch's own CPU copy uses, so a transfer neither waits for nor competes with
threads of its own.  Rows are viewed with the widest element type that tiles a page, and
pages of 128 KiB or more are copied as sub-rows of 64 KiB or more (the copy kernels
split their work by rows).  Two cases take other paths: a transfer of at most 256 KiB
is one NumPy fancy-index copy per tensor, and a tensor's share of up to 8 MiB with
several runs on both sides goes through a reused staging buffer in two calls.  On CUDA the blocks are gathered on the device, and each run is one
asynchronous copy on a side stream that waits for the compute stream; transfers stay in
submission order and report their device time.

:class:`CPUTransferWorker` reports completion through
:meth:`CPUTransferWorker.get_finished`; :class:`OffloadTransferDriver` turns those
reports into ``complete_store`` / ``complete_load`` calls on the manager (it lives in
the torch-free :mod:`~kvevents.publishers.offload.driver` and is re-exported here).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from kvevents.errors import MissingDependencyError, OffloadError

try:
    import torch
except ImportError as _exc:
    raise MissingDependencyError(
        "kvevents.publishers.offload.transfer (the block copies) needs torch, which is not "
        "installed: pip install 'kvevents[offload]'"
    ) from _exc

from kvevents.publishers.offload.base import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    TransferResult,
)
from kvevents.publishers.offload.driver import OffloadTransferDriver

__all__ = [
    "CPUTransferWorker",
    "HostChunkBuffers",
    "OffloadTransferDriver",
    "TransferStats",
]

logger = logging.getLogger(__name__)


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (block index first, contiguous) as a ``(num_blocks, page_bytes)`` int8 view."""
    if not t.is_contiguous():
        raise OffloadError("KV tensors must be contiguous with the block index first")
    return t.reshape(t.shape[0], -1).view(torch.int8)


def _widest(rows: torch.Tensor) -> torch.Tensor:
    """An int8 row view re-viewed with the widest element type that tiles its pages.

    Copy kernels move wide elements several times faster than bytes; the bits are the
    same.  The widest is ``complex128``, used only as a 16-byte container: the copies
    move its elements without arithmetic, so every bit pattern (NaN payloads included)
    arrives unchanged, and scattering 16-byte elements runs faster than 8-byte ones.
    """
    for dtype, size in (
        (torch.complex128, 16),
        (torch.int64, 8),
        (torch.int32, 4),
        (torch.int16, 2),
    ):
        if rows.shape[1] % size == 0 and rows.data_ptr() % size == 0:
            return rows.view(dtype)
    return rows


class HostChunkBuffers:
    """Host chunk tensors mirroring a set of device KV tensors.

    ``pin_memory`` defaults to ``torch.cuda.is_available()`` (pinned host memory is what
    makes device copies asynchronous).
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        num_chunks: int,
        blocks_per_chunk: int = 1,
        *,
        pin_memory: bool | None = None,
    ) -> None:
        if not kv_caches:
            raise OffloadError("need at least one KV tensor")
        if num_chunks <= 0 or blocks_per_chunk <= 0:
            raise OffloadError("num_chunks and blocks_per_chunk must be positive")
        self.device_rows = [_byte_rows(t) for t in kv_caches]
        num_blocks = {r.shape[0] for r in self.device_rows}
        devices = {r.device for r in self.device_rows}
        if len(num_blocks) != 1 or len(devices) != 1:
            raise OffloadError("all KV tensors must share one device and one block count")
        self.device = devices.pop()
        self.num_device_blocks = num_blocks.pop()
        self.num_chunks = num_chunks
        self.blocks_per_chunk = blocks_per_chunk
        self.pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.host: list[torch.Tensor] = [
            torch.zeros(
                (num_chunks, r.shape[1] * blocks_per_chunk),
                dtype=torch.int8,
                pin_memory=self.pinned,
            )
            for r in self.device_rows
        ]
        self.host_rows = [
            h.view(num_chunks * blocks_per_chunk, r.shape[1])
            for h, r in zip(self.host, self.device_rows)
        ]
        # Same bytes, widest element type: what the copy kernels work on.
        self.device_words = [_widest(r) for r in self.device_rows]
        self.host_words = [
            h.view(w.dtype) if w.dtype != torch.int8 else h
            for h, w in zip(self.host_rows, self.device_words)
        ]

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one device block over all KV tensors."""
        return sum(int(r.shape[1]) for r in self.device_rows)

    @property
    def bytes_per_chunk(self) -> int:
        """Bytes of one host chunk over all KV tensors."""
        return self.bytes_per_block * self.blocks_per_chunk


@dataclass
class TransferStats:
    """Counters of a :class:`CPUTransferWorker`."""

    stores: int = 0
    loads: int = 0
    blocks_stored: int = 0
    blocks_loaded: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    """Failed jobs by reason (``copy_error``)."""


Runs = list[tuple[int, int, int]]  # (destination start, index start, length)
# CPU copies split pages wider than twice this into sub-rows of at least this many bytes:
# torch's row copies share their work between threads by rows, and a transfer of a few
# wide pages otherwise leaves threads idle.
_SUB_ROW_BYTES = 64 << 10


# A CPU transfer whose rows are split into several runs on both sides copies a tensor's
# share of up to this many bytes in two calls, through a staging buffer that stays in
# the caches (an index_select, then an index_copy_), instead of one torch call (3-4 us)
# per run (the commit that added it records the A/B figures).
_STAGED_BYTES = 8 << 20
# A CPU transfer of at most this many bytes (all tensors) is copied with one NumPy
# fancy-index assignment per tensor on the calling thread: fixed costs dominate there.
_SMALL_TRANSFER_BYTES = 256 << 10


def _sub_rows(width: int, itemsize: int) -> int:
    """How many sub-rows a row of ``width`` elements of ``itemsize`` bytes is copied as:
    the largest power of two that divides ``width`` and leaves sub-rows of at least
    :data:`_SUB_ROW_BYTES`."""
    k = 1
    while width % (2 * k) == 0 and width // (2 * k) * itemsize >= _SUB_ROW_BYTES:
        k *= 2
    return k


def _runs(dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64]) -> tuple[Runs, torch.Tensor]:
    """Sort by ``dst``; split into runs of consecutive ``dst`` values.

    Returns the runs and the ``src`` values in that order (an int64 tensor).
    """
    order = np.argsort(dst, kind="stable")
    dst = dst[order]
    bounds = [0, *(np.flatnonzero(np.diff(dst) != 1) + 1).tolist(), int(dst.size)]
    firsts = dst.tolist()
    runs = [(firsts[a], a, b - a) for a, b in pairwise(bounds) if b > a]
    return runs, torch.from_numpy(np.ascontiguousarray(src[order]))


@dataclass
class _Plan:
    """A validated transfer: device blocks and host rows, aligned.  What only some copy
    paths need is worked out on first use."""

    blocks: npt.NDArray[np.int64]  # device block ids, transfer order
    rows: npt.NDArray[np.int64]  # host rows, aligned with ``blocks``
    num_blocks: int
    _host_side: tuple[Runs, torch.Tensor] | None = None
    _block_steps: npt.NDArray[np.int64] | None = None

    @property
    def host_runs(self) -> Runs:
        """Runs of consecutive host rows (see :func:`_runs`)."""
        return self._host()[0]

    @property
    def device_idx(self) -> torch.Tensor:
        """The device blocks in the order of :attr:`host_runs`."""
        return self._host()[1]

    def _host(self) -> tuple[Runs, torch.Tensor]:
        if self._host_side is None:
            self._host_side = _runs(self.rows, self.blocks)
        return self._host_side

    @property
    def block_steps(self) -> npt.NDArray[np.int64]:
        """Differences between neighbours of the sorted device block ids (0: a block
        named twice; 1: consecutive blocks)."""
        steps = self._block_steps
        if steps is None:
            steps = self._block_steps = np.diff(np.sort(self.blocks)).astype(np.int64, copy=False)
        return steps


@dataclass
class _Job:
    job_id: int
    nbytes: int
    start_wall: float
    success: bool = True
    start_event: Any = None
    end_event: Any = None
    seconds: float = 0.0
    keep: list[torch.Tensor] = field(default_factory=list)


class CPUTransferWorker:
    """Copies device blocks into host chunks (store) and back (load).

    CPU tensors: the copy runs inside ``submit_*`` and the job is finished at once.
    CUDA tensors: the copy is queued on a side stream; :meth:`get_finished` reports
    jobs in submission order once their copies are done, and :meth:`wait` blocks.
    A load's data is visible to the compute stream after :meth:`wait` (or once reported
    finished).  The device blocks of a store must not be overwritten before the job is
    reported finished (the copy may still be reading them).
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor] | None = None,
        num_chunks: int = 0,
        blocks_per_chunk: int = 1,
        *,
        pin_memory: bool | None = None,
        buffers: HostChunkBuffers | None = None,
    ) -> None:
        if buffers is None:
            if kv_caches is None:
                raise OffloadError("give kv_caches and num_chunks, or buffers")
            buffers = HostChunkBuffers(
                kv_caches, num_chunks, blocks_per_chunk, pin_memory=pin_memory
            )
        self.buffers = buffers
        self.is_cuda = buffers.device.type == "cuda"
        self._streams: dict[str, Any] = {}
        self._last_end: Any = None
        self._jobs: deque[_Job] = deque()
        self._stage: dict[torch.dtype, torch.Tensor] = {}
        self.stats = TransferStats()

    # --- planning ----------------------------------------------------------------------

    def _plan(
        self,
        device_spec: GPULoadStoreSpec | Sequence[int] | npt.NDArray[Any],
        chunks: CPULoadStoreSpec,
    ) -> _Plan:
        b = self.buffers
        spec = (
            device_spec
            if isinstance(device_spec, GPULoadStoreSpec)
            else GPULoadStoreSpec(device_spec)
        )
        if len(spec.group_sizes) != 1:
            raise OffloadError("one block table per transfer: multi-group specs are not supported")
        blocks = spec.block_ids.astype(np.int64)
        chunk_ids = chunks.block_ids.astype(np.int64)
        bpc = b.blocks_per_chunk
        skip = spec.block_indices[0] % bpc
        n = int(blocks.size)
        if n + skip > chunk_ids.size * bpc or n + skip <= (chunk_ids.size - 1) * bpc:
            raise OffloadError(
                f"{n} device blocks (skipping {skip}) do not fill {chunk_ids.size} chunk(s) "
                f"of {bpc} blocks"
            )
        if n and (blocks.min() < 0 or blocks.max() >= b.num_device_blocks):
            raise OffloadError(f"device block ids must be in [0, {b.num_device_blocks})")
        if chunk_ids.size and (chunk_ids.min() < 0 or chunk_ids.max() >= b.num_chunks):
            raise OffloadError(f"chunk ids must be in [0, {b.num_chunks})")
        if chunk_ids.size > 1 and len(set(chunk_ids.tolist())) != chunk_ids.size:
            raise OffloadError("a destination block or chunk is named twice in one transfer")
        slots = np.arange(skip, skip + n, dtype=np.int64)
        rows = chunk_ids[slots // bpc] * bpc + slots % bpc
        return _Plan(blocks=blocks, rows=rows, num_blocks=n)

    # --- copies --------------------------------------------------------------------------

    def _stream(self, direction: str) -> Any:
        stream = self._streams.get(direction)
        if stream is None:
            stream = torch.cuda.Stream(device=self.buffers.device)  # type: ignore[no-untyped-call]
            self._streams[direction] = stream
        return stream

    def _copy_cpu(self, plan: _Plan, store: bool) -> None:
        # Every byte moves once: either gather each run of consecutive destination rows
        # (``index_select(src, 0, idx, out=dst[run])``), or scatter each run of
        # consecutive source rows (``dst.index_copy_(0, idx, src[run])``), whichever
        # needs fewer calls (they cost about the same per row).  The plan's runs are
        # over host rows: a store's gather runs, a load's scatter runs.  The other side
        # is only counted (C loops), and listed only if it is chosen: on a tie the host
        # side, which is already listed.  When both sides are split into several runs
        # and a tensor's share is small, two calls through a reused staging buffer cost
        # less than a call per run (see :data:`_STAGED_BYTES`).
        if plan.num_blocks * self.buffers.bytes_per_block <= _SMALL_TRANSFER_BYTES:
            # Small: one NumPy fancy-index copy per tensor (about 2 us; a torch call
            # costs more than the bytes it moves here).
            for dev, host in zip(self.buffers.device_words, self.buffers.host_words):
                dev_np, host_np = dev.detach().numpy(), host.numpy()
                if store:
                    host_np[plan.rows] = dev_np[plan.blocks]
                else:
                    dev_np[plan.blocks] = host_np[plan.rows]
            return
        steps = plan.block_steps
        other_runs = int(np.count_nonzero(steps != 1)) + 1 if plan.num_blocks else 0
        if store:
            # A repeated device block can only be gathered (scattered run views of the
            # source would overlap).
            gather = bool(np.any(steps == 0)) or len(plan.host_runs) <= other_runs
        else:
            # (host rows of one transfer are distinct: chunk ids are checked distinct)
            gather = other_runs < len(plan.host_runs)
        staged = min(len(plan.host_runs), other_runs) > 1
        per_run: tuple[Runs, torch.Tensor] | None = None
        indices: dict[tuple[str, int], torch.Tensor] = {}

        def index(name: str, k: int) -> torch.Tensor:
            """The transfer's ``name`` index (``run``: that of the runs; ``blocks`` /
            ``rows``: every device block / host row in transfer order), over sub-rows
            when ``k`` > 1 (row r is sub-rows r*k .. r*k+k-1)."""
            got = indices.get((name, k))
            if got is None:
                if k > 1:
                    got = (index(name, 1).view(-1, 1) * k + torch.arange(k)).view(-1)
                elif name == "run":
                    assert per_run is not None
                    got = per_run[1]
                else:
                    got = torch.from_numpy(plan.blocks if name == "blocks" else plan.rows)
                indices[(name, k)] = got
            return got

        for dev, host in zip(self.buffers.device_words, self.buffers.host_words):
            row_bytes = int(dev.shape[1]) * dev.element_size()
            k = _sub_rows(int(dev.shape[1]), dev.element_size())
            if k > 1:
                dev = dev.view(dev.shape[0] * k, -1)
                host = host.view(host.shape[0] * k, -1)
            src, dst = (dev, host) if store else (host, dev)
            if staged and plan.num_blocks * row_bytes <= _STAGED_BYTES:
                blocks, rows = index("blocks", k), index("rows", k)
                stage = self._staging(dev.dtype, plan.num_blocks * k, int(dev.shape[1]))
                torch.index_select(src, 0, blocks if store else rows, out=stage)
                dst.index_copy_(0, rows if store else blocks, stage)
                continue
            if per_run is None:
                per_run = (
                    (plan.host_runs, plan.device_idx)
                    if gather == store
                    else _runs(plan.blocks, plan.rows)  # over device blocks
                )
            sel = index("run", k)
            for first, start, length in per_run[0]:
                span = slice(first * k, (first + length) * k)
                part = sel[start * k : (start + length) * k]
                if gather:
                    torch.index_select(src, 0, part, out=dst[span])
                else:
                    dst.index_copy_(0, part, src[span])

    def _staging(self, dtype: torch.dtype, rows: int, width: int) -> torch.Tensor:
        """A ``(rows, width)`` host tensor of ``dtype`` for staged copies, carved from a
        buffer kept between transfers (fresh pages would be faulted in on every copy)."""
        need = rows * width
        buf = self._stage.get(dtype)
        if buf is None or buf.numel() < need:
            buf = self._stage[dtype] = torch.empty(need, dtype=dtype)
        return buf[:need].view(rows, width)

    def _copy_cuda(self, plan: _Plan, store: bool, job: _Job) -> None:
        stream = self._stream("store" if store else "load")
        compute = torch.cuda.current_stream(self.buffers.device)
        job.start_event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        job.end_event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            stream.wait_stream(compute)  # stores wait for the model's writes
            if self._last_end is not None:
                stream.wait_event(self._last_end)  # keep transfers in submission order
            job.start_event.record(stream)
            idx = plan.device_idx.to(self.buffers.device, non_blocking=True)
            for dev, host in zip(self.buffers.device_rows, self.buffers.host_rows):
                if store:
                    staging = dev.index_select(0, idx)
                    for row, start, length in plan.host_runs:
                        host[row : row + length].copy_(
                            staging[start : start + length], non_blocking=True
                        )
                else:
                    staging = torch.empty(
                        (plan.num_blocks, dev.shape[1]), dtype=dev.dtype, device=dev.device
                    )
                    for row, start, length in plan.host_runs:
                        staging[start : start + length].copy_(
                            host[row : row + length], non_blocking=True
                        )
                    dev.index_copy_(0, idx, staging)
                job.keep.append(staging)
            job.keep.append(idx)
            job.end_event.record(stream)
        self._last_end = job.end_event

    def _submit(
        self,
        job_id: int,
        device_spec: GPULoadStoreSpec | Sequence[int] | npt.NDArray[Any],
        chunks: CPULoadStoreSpec,
        store: bool,
    ) -> None:
        plan = self._plan(device_spec, chunks)
        if not store and bool(np.any(plan.block_steps == 0)):
            raise OffloadError("a destination block or chunk is named twice in one transfer")
        nbytes = plan.num_blocks * self.buffers.bytes_per_block
        job = _Job(job_id=job_id, nbytes=nbytes, start_wall=time.perf_counter())
        try:
            if self.is_cuda:
                self._copy_cuda(plan, store, job)
            else:
                self._copy_cpu(plan, store)
                job.seconds = time.perf_counter() - job.start_wall
        except (RuntimeError, IndexError) as exc:
            logger.error("transfer job %d failed: %s", job_id, exc)
            self.stats.failures["copy_error"] += 1
            job.success = False
            job.start_event = job.end_event = None
            job.seconds = time.perf_counter() - job.start_wall
        if store:
            self.stats.stores += 1
            self.stats.blocks_stored += plan.num_blocks
            self.stats.bytes_stored += nbytes if job.success else 0
        else:
            self.stats.loads += 1
            self.stats.blocks_loaded += plan.num_blocks
            self.stats.bytes_loaded += nbytes if job.success else 0
        self._jobs.append(job)

    def submit_store(
        self,
        job_id: int,
        src: GPULoadStoreSpec | Sequence[int] | npt.NDArray[Any],
        dst: CPULoadStoreSpec,
    ) -> None:
        """Copy device blocks ``src`` into host chunks ``dst`` (``blocks_per_chunk`` each).

        Raises :class:`OffloadError` (nothing copied) for ids out of range or counts that
        do not fill the chunks.
        """
        self._submit(job_id, src, dst, store=True)

    def submit_load(
        self,
        job_id: int,
        src: CPULoadStoreSpec,
        dst: GPULoadStoreSpec | Sequence[int] | npt.NDArray[Any],
    ) -> None:
        """Copy host chunks ``src`` into device blocks ``dst``; errors as :meth:`submit_store`."""
        self._submit(job_id, dst, src, store=False)

    def get_finished(self) -> list[TransferResult]:
        """Pop the finished jobs, in submission order."""
        out: list[TransferResult] = []
        while self._jobs:
            job = self._jobs[0]
            if job.end_event is not None:
                if not job.end_event.query():
                    break
                job.seconds = job.start_event.elapsed_time(job.end_event) / 1e3
            self._jobs.popleft()
            out.append(
                TransferResult(
                    job.job_id, job.success, job.nbytes if job.success else 0, job.seconds
                )
            )
        return out

    def wait(self, job_ids: Iterable[int] | None = None) -> None:
        """Block until the given jobs (default: all submitted) have finished copying."""
        wanted = None if job_ids is None else set(job_ids)
        for job in list(self._jobs):
            if job.end_event is not None and (wanted is None or job.job_id in wanted):
                job.end_event.synchronize()

    def close(self) -> None:
        """Release the worker: nothing is held between CPU transfers, and CUDA copies end
        with their streams; kept so callers can close every worker alike."""

    @property
    def num_pending(self) -> int:
        """Jobs submitted and not yet returned by :meth:`get_finished`."""
        return len(self._jobs)
