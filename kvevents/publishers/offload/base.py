"""Core types of the KV offloading subsystem (vLLM's ``vllm/v1/kv_offload/base.py``).

An :data:`OffloadKey` names one *chunk* of KV cache on a secondary tier: the request's raw
chained block hash (digest bytes, at ``tokens_per_hash`` granularity) at the chunk's last
token boundary, followed by the 4-byte big-endian KV-cache group index (vLLM's
``make_offload_key``).

:class:`OffloadingEvent` is what a manager reports about its tier.  It deliberately has
**no block size**: one event may carry keys of several groups whose chunks have different
sizes; the translator (:mod:`.translator`) turns events into wire KV events.

:class:`OffloadingManager` is the scheduler-side interface; its docstrings state what is
pinned, what is atomic and what emits events.  This module imports no torch.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

from kvevents.errors import MissingDependencyError, OffloadError
from kvevents.events import MEDIUM_CPU

try:
    import numpy as np
    import numpy.typing as npt
except ImportError as exc:  # numpy is the offload and sim extras', not the core's
    raise MissingDependencyError(
        "the CPU offload tier (and the engine simulator) need numpy, which is not "
        "installed: pip install 'kvevents[offload]' (or 'kvevents[sim]')"
    ) from exc

__all__ = [
    "GROUP_SUFFIX_BYTES",
    "CPULoadStoreSpec",
    "GPULoadStoreSpec",
    "LoadStoreSpec",
    "LookupResult",
    "OffloadKey",
    "OffloadPolicy",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
    "RequestOffloadingContext",
    "TransferResult",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]

OffloadKey = NewType("OffloadKey", bytes)
"""``block_hash + group_idx.to_bytes(4, "big")``; see :func:`make_offload_key`."""

GROUP_SUFFIX_BYTES = 4
"""Length of the group-index suffix of an :data:`OffloadKey`."""


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """The key of the chunk whose last raw hash is ``block_hash``, in KV group ``group_idx``.

    ``block_hash`` is the raw digest (not the wire int); ``group_idx`` must fit in an
    unsigned 32-bit integer.
    """
    if not isinstance(block_hash, (bytes, bytearray)):
        raise OffloadError(f"block_hash must be bytes, not {type(block_hash).__name__}")
    if not 0 <= group_idx < 1 << 32:
        raise OffloadError(f"group_idx {group_idx} does not fit in 4 unsigned bytes")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(GROUP_SUFFIX_BYTES, "big"))


def get_offload_block_hash(key: OffloadKey | bytes) -> bytes:
    """The raw block hash of ``key`` (everything but the group suffix)."""
    if len(key) <= GROUP_SUFFIX_BYTES:
        raise OffloadError(f"offload key too short ({len(key)} bytes)")
    return bytes(key[:-GROUP_SUFFIX_BYTES])


def get_offload_group_idx(key: OffloadKey | bytes) -> int:
    """The KV-cache group index of ``key`` (its last 4 bytes, big-endian)."""
    if len(key) <= GROUP_SUFFIX_BYTES:
        raise OffloadError(f"offload key too short ({len(key)} bytes)")
    return int.from_bytes(key[-GROUP_SUFFIX_BYTES:], "big")


class LookupResult(enum.Enum):
    """Outcome of :meth:`OffloadingManager.lookup` for one key (vLLM ≥ 0.26 shape)."""

    MISS = "miss"
    """Not on this tier."""
    HIT = "hit"
    """Present and readable now."""
    HIT_PENDING = "hit_pending"
    """Present, but its write has not completed yet; ask again later."""
    RETRY = "retry"
    """The tier cannot answer now (e.g. an asynchronous lookup in flight)."""


@dataclass
class ReqContext:
    """Per-request context handed to every manager call.

    ``offload_key_positions`` maps a key to the token position at the end of its chunk (set
    by the scheduler, as vLLM's ``ReqContext``; the LRU policy ranks keys of one request by
    it).  ``scratch`` is per-request state that managers and policies may keep (keyed by an
    owner-specific string); it lives as long as the context.
    """

    req_id: str = ""
    kv_transfer_params: dict[str, Any] | None = None
    offload_key_positions: dict[OffloadKey, int] = field(default_factory=dict)
    scratch: dict[str, Any] = field(default_factory=dict)

    def set_position(self, key: OffloadKey, position: int) -> None:
        """Record that ``key``'s chunk ends at token ``position``."""
        self.offload_key_positions[key] = position

    def position(self, key: OffloadKey) -> int | None:
        """The end-token position of ``key``, or ``None`` when the scheduler set none."""
        return self.offload_key_positions.get(key)


class OffloadPolicy(enum.Enum):
    """How the scheduler offers a request's chunks for storing."""

    CHUNK_LEVEL = "chunk_level"
    """Skip chunks that were prefix hits on this tier."""
    REQUEST_LEVEL = "request_level"
    """Offer every chunk of the request."""


@dataclass
class RequestOffloadingContext:
    """What :meth:`OffloadingManager.on_new_request` tells the scheduler."""

    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


class LoadStoreSpec:
    """Marker base of the specs that tell a transfer worker where data lives."""

    medium: str = ""


def _as_int32(ids: Sequence[int] | npt.NDArray[Any]) -> npt.NDArray[np.int32]:
    if isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1:
        return ids  # already validated by whoever built it (e.g. the manager)
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= 1 << 31):
        raise OffloadError("block/chunk ids must be non-negative int32 values")
    return arr.astype(np.int32, copy=False)


class CPULoadStoreSpec(LoadStoreSpec):
    """CPU chunk ids (a numpy int32 array), in the order of the keys they belong to.

    ``block_ids`` and ``chunk_ids`` name the same array (vLLM calls them block ids;
    each is one chunk of ``blocks_per_chunk`` device blocks).
    """

    medium = MEDIUM_CPU

    def __init__(self, chunk_ids: Sequence[int] | npt.NDArray[Any] = ()) -> None:
        self.block_ids: npt.NDArray[np.int32] = _as_int32(chunk_ids)

    def __len__(self) -> int:
        return int(self.block_ids.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CPULoadStoreSpec):
            return NotImplemented
        return bool(np.array_equal(self.block_ids, other.block_ids))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CPULoadStoreSpec({self.block_ids.tolist()})"


class GPULoadStoreSpec(LoadStoreSpec):
    """Device blocks of a transfer, ordered by group (vLLM's ``GPULoadStoreSpec``).

    ``group_sizes[g]`` blocks of group g follow each other in ``block_ids``
    (``sum(group_sizes) == len(block_ids)``); ``block_indices[g]`` is the
    request-relative index of group g's first block, used to skip into a partially
    covered first chunk.  With one group, ``group_sizes`` defaults to ``[len(block_ids)]``
    and ``block_indices`` to ``[0]``.
    """

    medium = "GPU"

    def __init__(
        self,
        block_ids: Sequence[int] | npt.NDArray[Any],
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> None:
        self.block_ids = _as_int32(block_ids)
        self.group_sizes: list[int] = (
            list(group_sizes) if group_sizes is not None else [int(self.block_ids.size)]
        )
        self.block_indices: list[int] = (
            list(block_indices) if block_indices is not None else [0] * len(self.group_sizes)
        )
        if sum(self.group_sizes) != self.block_ids.size:
            raise OffloadError(
                f"group_sizes sum to {sum(self.group_sizes)}, "
                f"but there are {self.block_ids.size} block ids"
            )
        if len(self.block_indices) != len(self.group_sizes):
            raise OffloadError("block_indices needs one entry per group")

    def __repr__(self) -> str:
        return (
            f"GPULoadStoreSpec({self.block_ids.tolist()}, group_sizes={self.group_sizes}, "
            f"block_indices={self.block_indices})"
        )


@dataclass
class PrepareStoreOutput:
    """Result of a successful :meth:`OffloadingManager.prepare_store`.

    ``keys_to_store[i]`` is written to the location ``store_spec`` names at index i;
    ``evicted_keys`` were evicted to make room (already announced as removed).
    """

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass
class OffloadingEvent:
    """A change of residency on one tier, as drained by ``take_events()`` (vLLM's
    ``OffloadingEvent``).

    There is **no block_size**: the keys may belong to groups whose chunks differ in
    size.  ``removed`` is ``False`` for stores, ``True`` for evictions/removals.
    ``ownership`` names a secondary tier (``None`` = primary); ``removal_expected`` says
    the tier will later announce the removal of these keys; ``metadata_only`` marks the
    release of a failed allocation, which is never published as a KV event.
    """

    keys: list[OffloadKey]
    medium: str
    removed: bool
    locality: str | None = None
    ownership: str | None = None
    removal_expected: bool = False
    metadata_only: bool = False


@dataclass(frozen=True)
class TransferResult:
    """Completion report of one transfer job.

    ``bytes`` is the number of bytes copied (all layers); ``seconds`` the copy time
    (device time on CUDA, wall time on CPU).
    """

    job_id: int
    success: bool
    bytes: int
    seconds: float

    @property
    def transfer_size(self) -> int:
        """vLLM's name for :attr:`bytes` (``TransferResult.transfer_size``)."""
        return self.bytes

    @property
    def transfer_time(self) -> float:
        """vLLM's name for :attr:`seconds` (``TransferResult.transfer_time``)."""
        return self.seconds


class OffloadingManager(ABC):
    """Scheduler-side bookkeeping of one offload tier (vLLM's ``OffloadingManager``).

    Contracts every implementation keeps:

    * **Locking.** :attr:`lock` is a no-op context manager by default; callers that need
      a lookup HIT and the :meth:`prepare_load` that pins it to be atomic hold it across
      both calls.
    * **Pinning.** :meth:`prepare_load` pins its keys (they cannot be evicted) until the
      matching :meth:`complete_load`.  Keys returned by :meth:`prepare_store` are
      *pending* (``HIT_PENDING``, not loadable, not evictable) until
      :meth:`complete_store`.
    * **Atomicity.** :meth:`prepare_store` either succeeds completely or returns
      ``None`` having changed nothing.  Misuse (loading an absent key, unpinning an
      unpinned one) raises :class:`~kvevents.errors.OffloadError` before anything changes.
    * **Events.** Only storage this tier owns is reported: evictions when
      :meth:`prepare_store` makes room, successful stores at :meth:`complete_store`,
      failed stores as ``metadata_only`` removals.  Lookups, loads and touches emit
      nothing; :meth:`reset_cache` emits nothing.
    """

    medium: str = MEDIUM_CPU

    class _NoLock:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    lock: Any = _NoLock()
    """A context manager serialising related calls (no-op by default)."""

    @abstractmethod
    def lookup(self, key: OffloadKey, ctx: ReqContext | None = None) -> LookupResult:
        """Whether ``key`` is on this tier; no side effects on residency or recency."""

    @abstractmethod
    def prepare_load(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> LoadStoreSpec:
        """Pin ``keys`` (all present and ready) for reading; the spec follows ``keys`` order."""

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """Mark ``keys`` recently used; ``keys[0]`` becomes the most recent."""
        return None

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """Unpin keys pinned by :meth:`prepare_load`."""
        return None

    @abstractmethod
    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        """Choose which of ``keys`` need storing, make room (evicting), allocate.

        Returns ``None`` (nothing changed) when they cannot be stored.  Offered keys are
        never evicted by their own offer; returned keys stay pending until
        :meth:`complete_store`.
        """

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None, success: bool = True
    ) -> None:
        """Finish writes: pending keys become loadable, or (``success=False``) are dropped."""
        return None

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """Called once when a request starts; says how to offer its chunks."""
        return RequestOffloadingContext()

    def on_request_finished(self, ctx: ReqContext) -> None:
        """No further prepare calls will come for ``ctx``; completions may still arrive."""
        return None

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Drain the events collected since the last call (empty when events are off)."""
        return []

    def on_schedule_end(self) -> None:
        """Called at the end of every scheduler step."""
        return None

    def has_pending_work(self) -> bool:
        """Whether the tier still has asynchronous work in flight."""
        return False

    def reset_cache(self) -> None:
        """Drop everything this tier holds, without emitting events, as vLLM does."""
        return None

    def shutdown(self) -> None:
        """Release resources; called without :attr:`lock`."""
        return None
