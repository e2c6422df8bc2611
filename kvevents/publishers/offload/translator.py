"""From :class:`OffloadingEvent` to wire KV events (vLLM's ``offloading/events.py``).

:class:`OffloadEventTranslator` has two modes.

**Placeholder** (default).  A store becomes one
``BlockStored(block_hashes=[tail], parent_block_hash=None, token_ids=[], block_size=0,
medium, group_idx=g, locality, ownership)`` **per key**, where ``tail`` is the key's
block hash as a wire hash; a removal becomes one ``BlockRemoved`` **per group** (groups
in first-seen order, hashes in event order).  A consumer learns the block size and
tokens from the GPU ``BlockStored`` with the same ``(group_idx, hash)``.

**Self-describing** (opt-in, ``self_describing=True``).  For full-attention groups the
caller records a snapshot of each chunk with :meth:`OffloadEventTranslator.record_chunk`
(when it offers the chunk for storing, and on a lookup hit).  The store then carries the
chunk's ``blocks_per_chunk`` hashes at group-block granularity, its parent, its tokens,
``block_size = tokens_per_block`` and the LoRA; its removal lists every constituent hash.
Snapshots are kept per *residency* ``(medium, ownership)``: the primary tier always
counts, a secondary store counts when it says ``removal_expected``.  A snapshot is
dropped at the end of the batch in which its last residency went away.  Keys without a
snapshot fall back to the placeholder (logged once, counted).  In this mode placeholders
also carry the group's kind and sliding window.

``metadata_only`` removals never produce a KV event.  Keys of groups with different
block sizes go through one :meth:`OffloadEventTranslator.translate` call.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Union

from kvevents.errors import OffloadError
from kvevents.events import BlockRemoved, BlockStored, ExternalBlockHash
from kvevents.hashing import to_wire_hash
from kvevents.publishers.offload.base import (
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)

__all__ = [
    "ChunkSnapshot",
    "OffloadEventTranslator",
    "OffloadGroup",
    "TranslatorStats",
    "drain_kv_events",
]

logger = logging.getLogger(__name__)

OffloadKVEvent = Union[BlockStored, BlockRemoved]

_SLIDING_KINDS = frozenset({"sliding_window", "sliding_window_mla"})


_INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


def _int_hashes_from_env() -> bool:
    """vLLM's switch between int (default) and raw-bytes wire hashes
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    value = os.environ.get(_INT_HASHES_ENV, "1")
    try:
        return int(value) != 0
    except ValueError:
        raise OffloadError(
            f"{_INT_HASHES_ENV} must be an integer (0 or 1), got {value!r}"
        ) from None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class OffloadGroup:
    """Geometry of one offloaded KV-cache group (vLLM's offloading ``config.py``).

    ``tokens_per_block`` is the group's block size in tokens (times DCP when sharded);
    ``kind`` one of :data:`kvevents.events.SPEC_KINDS`; ``sliding_window`` the window in
    tokens for sliding-window kinds (the attention chunk for chunked-local attention);
    ``extra_retained_tokens`` widens a sliding window as vLLM's spec does.
    """

    tokens_per_block: int
    kind: str = "full_attention"
    sliding_window: int | None = None
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        if self.tokens_per_block <= 0:
            raise OffloadError("tokens_per_block must be positive")

    def sliding_window_size_in_chunks(self, tokens_per_chunk: int) -> int | None:
        """Chunks a request must keep for this group; ``None`` for full attention."""
        if self.kind in _SLIDING_KINDS and self.sliding_window is not None:
            w = self.sliding_window
            return max(
                _cdiv(w, tokens_per_chunk),
                _cdiv(w - 1 + self.extra_retained_tokens, tokens_per_chunk),
            )
        if self.kind == "chunked_local_attention" and self.sliding_window is not None:
            return _cdiv(self.sliding_window, tokens_per_chunk)
        if self.kind == "mamba":
            return 1
        return None


@dataclass
class ChunkSnapshot:
    """What a self-describing store of one chunk says (wire hashes already converted)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    residencies: set[tuple[str, str | None]] = field(default_factory=set)


@dataclass
class TranslatorStats:
    """Counters of an :class:`OffloadEventTranslator`."""

    events_in: int = 0
    stored_out: int = 0
    removed_out: int = 0
    placeholders: int = 0
    self_described: int = 0
    placeholder_fallbacks: int = 0
    """Keys of self-describing groups stored without a snapshot."""
    snapshots_recorded: int = 0
    snapshots_dropped: int = 0
    snapshots_evicted: int = 0
    """Snapshots dropped because the table reached ``max_snapshots``."""
    skipped: Counter[str] = field(default_factory=Counter)
    """Manager events that produced no KV event, by reason (``metadata_only``, ``empty``)."""


class OffloadEventTranslator:
    """Turns manager events into ``BlockStored`` / ``BlockRemoved`` (see module docstring).

    Args:
        groups: geometry per group index; needed for self-describing mode and for
            :meth:`chunk_keys`.  Placeholder mode works without it.
        blocks_per_chunk: device blocks per offloaded chunk.
        tokens_per_hash: tokens per raw request hash (vLLM's ``hash_block_size``);
            default: the GCD of the groups' ``tokens_per_block``.
        self_describing: opt into self-describing stores for full-attention groups.
        int_hashes: convert hashes to wire ints; else raw digest bytes.  ``None`` (the
            default) follows vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` environment
            variable (an integer, default ``1``: ints), read when the translator is built.
        max_snapshots: bound of the snapshot table (oldest dropped first, counted).
    """

    def __init__(
        self,
        groups: Sequence[OffloadGroup] | None = None,
        *,
        blocks_per_chunk: int = 1,
        tokens_per_hash: int | None = None,
        self_describing: bool = False,
        int_hashes: bool | None = None,
        max_snapshots: int = 100_000,
    ) -> None:
        self.groups: list[OffloadGroup] = list(groups or [])
        if blocks_per_chunk <= 0:
            raise OffloadError("blocks_per_chunk must be positive")
        if self_describing and not self.groups:
            raise OffloadError("self-describing mode needs the groups' geometry")
        if tokens_per_hash is None and self.groups:
            tokens_per_hash = math.gcd(*(g.tokens_per_block for g in self.groups))
        if tokens_per_hash is not None:
            if tokens_per_hash <= 0:
                raise OffloadError("tokens_per_hash must be positive")
            for idx, g in enumerate(self.groups):
                if g.tokens_per_block % tokens_per_hash:
                    raise OffloadError(
                        f"group {idx}: tokens_per_block {g.tokens_per_block} is not a "
                        f"multiple of tokens_per_hash {tokens_per_hash}"
                    )
        self.blocks_per_chunk = blocks_per_chunk
        self.tokens_per_hash = tokens_per_hash
        self.self_describing = self_describing
        self.max_snapshots = max_snapshots
        if int_hashes is None:
            int_hashes = _int_hashes_from_env()
        self.int_hashes = int_hashes
        self._to_wire: Callable[[bytes], ExternalBlockHash] = to_wire_hash if int_hashes else bytes
        self._snapshots: OrderedDict[OffloadKey, ChunkSnapshot] = OrderedDict()
        self._warned_fallback = False
        self.stats = TranslatorStats()

    # --- geometry ----------------------------------------------------------------------

    def group(self, group_idx: int) -> OffloadGroup | None:
        """The configured geometry of ``group_idx`` (``None`` if not configured)."""
        return self.groups[group_idx] if 0 <= group_idx < len(self.groups) else None

    def _require_group(self, group_idx: int) -> OffloadGroup:
        g = self.group(group_idx)
        if g is None or self.tokens_per_hash is None:
            raise OffloadError(f"group {group_idx} is not configured on this translator")
        return g

    def tokens_per_chunk(self, group_idx: int) -> int:
        """Tokens covered by one chunk of ``group_idx``."""
        return self._require_group(group_idx).tokens_per_block * self.blocks_per_chunk

    def hashes_per_chunk(self, group_idx: int) -> int:
        """Raw request hashes per chunk of ``group_idx``."""
        self._require_group(group_idx)
        assert self.tokens_per_hash is not None
        return self.tokens_per_chunk(group_idx) // self.tokens_per_hash

    def describes(self, group_idx: int) -> bool:
        """Whether stores of ``group_idx`` are self-describing (full-attention groups)."""
        g = self.group(group_idx)
        if not self.self_describing or g is None:
            return False
        return g.sliding_window_size_in_chunks(self.tokens_per_chunk(group_idx)) is None

    def chunk_keys(
        self, block_hashes: Sequence[bytes], group_idx: int
    ) -> list[tuple[OffloadKey, int]]:
        """``(key, end-token position)`` of every complete chunk of a request (vLLM's
        ``RequestOffloadState.update_offload_keys``).

        ``block_hashes`` are the request's raw chained digests at ``tokens_per_hash``
        granularity; chunk c's key is the digest at index ``(c+1)·hashes_per_chunk − 1``.
        """
        hpc = self.hashes_per_chunk(group_idx)
        tpc = self.tokens_per_chunk(group_idx)
        return [
            (make_offload_key(block_hashes[(c + 1) * hpc - 1], group_idx), (c + 1) * tpc)
            for c in range(len(block_hashes) // hpc)
        ]

    # --- snapshots ---------------------------------------------------------------------

    def record_chunk(
        self,
        key: OffloadKey,
        chunk_idx: int,
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> bool:
        """Snapshot chunk ``chunk_idx`` of a request for self-describing events.

        Call it when the chunk is offered for storing and when a lookup finds it.
        ``block_hashes`` are the request's raw digests (``tokens_per_hash`` granularity)
        and ``token_ids`` its tokens.  A new record replaces the payload of an existing
        snapshot of ``key`` and keeps its residencies.  Returns whether a snapshot was
        kept (``False`` in placeholder mode or for groups that are not full attention).
        Raises :class:`OffloadError` if the request is shorter than the chunk.
        """
        group_idx = get_offload_group_idx(key)
        if not self.describes(group_idx):
            return False
        g = self._require_group(group_idx)
        hpc = self.hashes_per_chunk(group_idx)
        tpc = self.tokens_per_chunk(group_idx)
        if chunk_idx < 0 or len(block_hashes) < (chunk_idx + 1) * hpc:
            raise OffloadError(
                f"chunk {chunk_idx} needs {(chunk_idx + 1) * hpc} hashes, got {len(block_hashes)}"
            )
        if len(token_ids) < (chunk_idx + 1) * tpc:
            raise OffloadError(
                f"chunk {chunk_idx} needs {(chunk_idx + 1) * tpc} tokens, got {len(token_ids)}"
            )
        raw = block_hashes[chunk_idx * hpc : (chunk_idx + 1) * hpc]
        per_block = g.tokens_per_block // (self.tokens_per_hash or 1)
        hashes = [self._to_wire(raw[(i + 1) * per_block - 1]) for i in range(self.blocks_per_chunk)]
        parent = self._to_wire(block_hashes[chunk_idx * hpc - 1]) if chunk_idx > 0 else None
        snap = self._snapshots.get(key)
        residencies = snap.residencies if snap is not None else set()
        self._snapshots[key] = ChunkSnapshot(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=list(token_ids[chunk_idx * tpc : (chunk_idx + 1) * tpc]),
            block_size=g.tokens_per_block,
            lora_id=lora_id,
            lora_name=lora_name,
            residencies=residencies,
        )
        self._snapshots.move_to_end(key)
        self.stats.snapshots_recorded += 1
        while len(self._snapshots) > self.max_snapshots:
            self._snapshots.popitem(last=False)
            self.stats.snapshots_evicted += 1
        return True

    def snapshot(self, key: OffloadKey) -> ChunkSnapshot | None:
        """The snapshot held for ``key``, if any."""
        return self._snapshots.get(key)

    @property
    def num_snapshots(self) -> int:
        """Size of the snapshot side table."""
        return len(self._snapshots)

    def reset(self) -> None:
        """Forget every snapshot (call on a cache reset; emits nothing)."""
        self._snapshots.clear()

    # --- translation -------------------------------------------------------------------

    def _kind(self, group_idx: int) -> tuple[str | None, int | None]:
        g = self.group(group_idx)
        if not self.self_describing or g is None:
            return None, None
        return g.kind, g.sliding_window if g.kind in _SLIDING_KINDS else None

    def _stored(self, key: OffloadKey, ev: OffloadingEvent) -> BlockStored:
        group_idx = get_offload_group_idx(key)
        kind, window = self._kind(group_idx)
        snap = self._snapshots.get(key)
        if snap is not None:
            if ev.ownership is None or ev.removal_expected:
                snap.residencies.add((ev.medium, ev.ownership))
            self.stats.self_described += 1
            return BlockStored(
                block_hashes=list(snap.block_hashes),
                parent_block_hash=snap.parent_block_hash,
                token_ids=list(snap.token_ids),
                block_size=snap.block_size,
                lora_id=snap.lora_id,
                medium=ev.medium,
                lora_name=snap.lora_name,
                group_idx=group_idx,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
                locality=ev.locality,
                ownership=ev.ownership,
            )
        if self.describes(group_idx):
            self.stats.placeholder_fallbacks += 1
            if not self._warned_fallback:
                self._warned_fallback = True
                logger.warning(
                    "offload key of group %d has no snapshot; sending a placeholder store "
                    "(further occurrences are only counted)",
                    group_idx,
                )
        self.stats.placeholders += 1
        return BlockStored(
            block_hashes=[self._to_wire(get_offload_block_hash(key))],
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium=ev.medium,
            lora_name=None,
            group_idx=group_idx,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            locality=ev.locality,
            ownership=ev.ownership,
        )

    def translate(self, events: Iterable[OffloadingEvent]) -> list[OffloadKVEvent]:
        """KV events for one drained batch of manager events, in order.

        Snapshots whose last residency went away in this batch are dropped at its end.
        """
        out: list[OffloadKVEvent] = []
        released: list[OffloadKey] = []
        for ev in events:
            self.stats.events_in += 1
            if not ev.keys:
                self.stats.skipped["empty"] += 1
                continue
            if not ev.removed:
                for key in ev.keys:
                    out.append(self._stored(key, ev))
                self.stats.stored_out += len(ev.keys)
                continue
            residency = (ev.medium, ev.ownership)
            if ev.metadata_only:
                for key in ev.keys:
                    snap = self._snapshots.get(key)
                    if snap is not None:
                        snap.residencies.discard(residency)
                        released.append(key)
                self.stats.skipped["metadata_only"] += 1
                continue
            by_group: dict[int, list[ExternalBlockHash]] = {}
            for key in ev.keys:
                hashes = by_group.setdefault(get_offload_group_idx(key), [])
                snap = self._snapshots.get(key)
                if snap is not None:
                    hashes.extend(snap.block_hashes)
                    snap.residencies.discard(residency)
                    released.append(key)
                else:
                    hashes.append(self._to_wire(get_offload_block_hash(key)))
            for group_idx, hashes in by_group.items():
                out.append(
                    BlockRemoved(
                        block_hashes=hashes,
                        medium=ev.medium,
                        group_idx=group_idx,
                        locality=ev.locality,
                        ownership=ev.ownership,
                    )
                )
            self.stats.removed_out += len(by_group)
        for key in released:
            snap = self._snapshots.get(key)
            if snap is not None and not snap.residencies:
                del self._snapshots[key]
                self.stats.snapshots_dropped += 1
        return out


def drain_kv_events(
    manager: OffloadingManager, translator: OffloadEventTranslator
) -> list[OffloadKVEvent]:
    """Drain ``manager.take_events()`` through ``translator`` into KV events.

    The result (``BlockStored`` / ``BlockRemoved`` only) is ready to extend a
    :class:`~kvevents.events.KVEventBatch`'s ``events``; it is empty when the manager
    was built without ``enable_events`` or nothing happened.  Call it once per engine
    step, after the step's offload calls, so evictions precede the stores they made
    room for.
    """
    return translator.translate(manager.take_events())
