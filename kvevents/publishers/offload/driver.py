"""Driving an offloading manager with a transfer worker: prepare → submit → poll → complete.

One job: :class:`OffloadTransferDriver` pairs each ``prepare_store`` / ``prepare_load``
with a copy job and reports finished jobs back to the manager, leaving the manager
consistent when a copy cannot be submitted.  It needs no torch: the worker
(:class:`~kvevents.publishers.offload.transfer.CPUTransferWorker`, or anything with the
:class:`TransferWorker` methods) does the copies.  Imports only the offload base types.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from kvevents.errors import OffloadError
from kvevents.publishers.offload.base import (
    CPULoadStoreSpec,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    TransferResult,
)

__all__ = ["OffloadTransferDriver", "TransferWorker"]


class TransferWorker(Protocol):
    """What the driver needs of a transfer worker (``CPUTransferWorker`` has it).

    ``submit_store(job_id, device_blocks, chunks)`` / ``submit_load(job_id, chunks,
    device_blocks)`` start a copy (raising :class:`OffloadError` with nothing copied on
    bad ids); ``get_finished()`` pops finished jobs in submission order; ``wait()``
    blocks until every submitted job has finished copying.
    """

    def submit_store(self, job_id: int, src: Sequence[int], dst: CPULoadStoreSpec) -> None: ...

    def submit_load(self, job_id: int, src: CPULoadStoreSpec, dst: Sequence[int]) -> None: ...

    def get_finished(self) -> list[TransferResult]: ...

    def wait(self, job_ids: Iterable[int] | None = None) -> None: ...


class OffloadTransferDriver:
    """Drives a manager with a transfer worker: prepare → submit → finish → complete.

    ``device_blocks`` maps each key to the ``blocks_per_chunk`` device block ids of its
    chunk (for a store: where the data is; for a load: where it goes).
    """

    def __init__(self, manager: OffloadingManager, worker: TransferWorker) -> None:
        self.manager = manager
        self.worker = worker
        self._ids = itertools.count()
        self._pending: dict[int, tuple[bool, list[OffloadKey], ReqContext | None]] = {}

    def _blocks(
        self, keys: Sequence[OffloadKey], device_blocks: Mapping[OffloadKey, Sequence[int]]
    ) -> list[int]:
        out: list[int] = []
        for key in keys:
            try:
                out.extend(int(b) for b in device_blocks[key])
            except KeyError:
                raise OffloadError(f"no device blocks given for key {key!r}") from None
        return out

    def store(
        self,
        keys: Sequence[OffloadKey],
        device_blocks: Mapping[OffloadKey, Sequence[int]],
        ctx: ReqContext | None = None,
    ) -> PrepareStoreOutput | None:
        """``prepare_store`` then submit the copy of the keys it chose; ``None`` if refused.

        If the copy cannot be submitted the store is completed as failed and the error
        re-raised, so the manager is left consistent.
        """
        out = self.manager.prepare_store(keys, ctx)
        if out is None or not out.keys_to_store:
            return out
        if not isinstance(out.store_spec, CPULoadStoreSpec):
            raise OffloadError("the manager's store spec is not a CPU chunk spec")
        job_id = next(self._ids)
        try:
            self.worker.submit_store(
                job_id, self._blocks(out.keys_to_store, device_blocks), out.store_spec
            )
        except Exception:
            self.manager.complete_store(out.keys_to_store, ctx, success=False)
            raise
        self._pending[job_id] = (True, list(out.keys_to_store), ctx)
        return out

    def load(
        self,
        keys: Sequence[OffloadKey],
        device_blocks: Mapping[OffloadKey, Sequence[int]],
        ctx: ReqContext | None = None,
    ) -> int:
        """``prepare_load`` (pins) then submit the copy; returns the job id."""
        blocks = self._blocks(keys, device_blocks)
        spec = self.manager.prepare_load(keys, ctx)
        if not isinstance(spec, CPULoadStoreSpec):
            self.manager.complete_load(keys, ctx)
            raise OffloadError("the manager's load spec is not a CPU chunk spec")
        job_id = next(self._ids)
        try:
            self.worker.submit_load(job_id, spec, blocks)
        except Exception:
            self.manager.complete_load(keys, ctx)
            raise
        self._pending[job_id] = (False, list(keys), ctx)
        return job_id

    def poll(self) -> list[TransferResult]:
        """Report finished jobs to the manager; returns their results."""
        results = self.worker.get_finished()
        for result in results:
            entry = self._pending.pop(result.job_id, None)
            if entry is None:
                continue
            is_store, keys, ctx = entry
            if is_store:
                self.manager.complete_store(keys, ctx, success=result.success)
            else:
                self.manager.complete_load(keys, ctx)
        return results

    def flush(self) -> list[TransferResult]:
        """Wait for every submitted job, then :meth:`poll`."""
        self.worker.wait()
        return self.poll()

    @property
    def num_pending(self) -> int:
        """Jobs submitted whose completion has not reached the manager yet."""
        return len(self._pending)
