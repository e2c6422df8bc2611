"""A simulated engine: scheduler steps over a GPU block pool, CPU offload, one publisher.

Each :meth:`SimEngine.step` is one engine step (C§2.5):

1. waiting requests (preempted ones first) are admitted while blocks allow.  The GPU hit
   is found as vLLM's ``KVCacheManager.get_computed_blocks`` finds it: capped at
   ``num_tokens − 1``; one group walks its cached prefix (dropping the last matched block
   in EAGLE drop mode); several groups are reconciled as the hybrid coordinator does
   (hits aligned to the least common multiple of the block sizes, full-attention groups
   first, a sliding-window group needs the window's blocks at the hit end, repeated until
   every group agrees).  The CPU hit after it is what the offload connector's
   ``_lookup_complete_chunks`` returns (whole chunks only).  Hit blocks are pinned, new
   blocks allocated (lazy eviction: ``BlockRemoved``), CPU chunks loaded, the prompt
   "prefilled" and its full blocks cached (GPU ``BlockStored``), its full chunks offered
   to the CPU manager;
2. running requests decode ``decode_tokens_per_step`` tokens: sliding-window groups first
   free the blocks that left the window (vLLM's ``remove_skipped_blocks``), blocks that
   fill are cached; with ``preemption`` a request that finds no free block preempts the
   newest running request (its blocks are freed, it waits to be recomputed);
3. finished requests offload their remaining full chunks (up to ``num_tokens − 1``),
   tell the manager they finished, and free their blocks tail-first;
4. CPU stores whose copies have finished complete (``complete_store``); stores submitted
   in a step complete at the end of a later one, so CPU ``BlockStored`` events trail the
   GPU ones, as vLLM's asynchronous transfers make them;
5. GPU events, then the translated offload events, go out as one ``KVEventBatch``
   through the engine's publisher, if there were any.

So everything an engine knows at the start of a step has been published.  A
``before_lookup`` callback (the differential test's router) is called right before each
admission lookup, after the engine has published what the step changed so far.

Block contents are simulated with real tensors when torch is available: every computed
block is filled with bytes derived from its hash, copied to host chunks on store and
back on load, and a load is checked against the expected bytes (``stats.load_mismatches``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvevents.errors import ConfigError
from kvevents.events import KVEvent, KVEventBatch
from kvevents.hashing import none_hash
from kvevents.request import RequestKey
from kvevents.sim.block_pool import (
    NULL_BLOCK,
    GPUBlockPool,
    KVCacheGroupSpec,
    RequestHasher,
    group_block_hashes,
    hash_block_size,
)
from kvevents.sim.keys import SimKey, event_extra_keys
from kvevents.sim.offload import SimOffload
from kvevents.sim.workload import SimRequest

__all__ = [
    "AdmissionRecord",
    "BatchSink",
    "BeforeLookup",
    "EngineStats",
    "RequestResult",
    "SimEngine",
    "SimEngineConfig",
]

logger = logging.getLogger(__name__)


class BatchSink(Protocol):
    """Where an engine's batches go: an event publisher (``ZmqEventPublisher`` or
    anything with the same ``publish``)."""

    def publish(self, batch: KVEventBatch) -> None: ...


@dataclass(frozen=True)
class SimEngineConfig:
    """Shape of one simulated engine.

    * ``groups``: the KV-cache groups; several with different block sizes make a hybrid
      model (hashes at the GCD granularity, C§4.1); ``KVCacheGroupSpec(bs,
      "sliding_window", sliding_window=w)`` adds a sliding-window group.
    * ``num_gpu_blocks``: physical GPU blocks shared by all groups.
    * ``num_cpu_chunks``: CPU offload capacity in chunks (0 turns offload off);
      ``blocks_per_chunk`` GPU blocks per chunk; ``cpu_cache_policy`` ``"lru"``/``"arc"``.
    * ``hash_algo`` / ``hash_seed``: vLLM's ``prefix_caching_hash_algo`` and NONE_HASH seed
      (``None``: ``$PYTHONHASHSEED`` or ``"vllm-none-hash"``).
    * ``lookahead_tokens``: speculative decoding with lookahead hashing (vLLM 0.33's
      default with EAGLE): a block's hash covers the next ``L`` tokens.
      ``eagle_drop``: speculative decoding without it: the last matched block of a hit
      (and the last CPU chunk) is dropped.  At most one of the two.
    * ``preemption``: admit on the blocks a request needs now (not its whole output) and
      preempt the newest running request when decoding runs out of blocks; otherwise a
      request reserves every block it will need at admission and is never preempted.
    * ``decode_tokens_per_step``: output tokens each running request adds per step.
    * ``max_running``: requests decoding at once.
    * ``page_bytes``: bytes of simulated KV per GPU block; ``transfers``: move real
      tensors between device and host memory (needs torch; skipped and counted without);
      ``device``: where the simulated KV cache lives (``"cpu"`` or ``"cuda"``).
    """

    groups: tuple[KVCacheGroupSpec, ...] = (KVCacheGroupSpec(16),)
    num_gpu_blocks: int = 256
    num_cpu_chunks: int = 0
    blocks_per_chunk: int = 1
    cpu_cache_policy: str = "lru"
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = None
    lookahead_tokens: int = 0
    eagle_drop: bool = False
    preemption: bool = False
    decode_tokens_per_step: int = 8
    max_running: int = 8
    page_bytes: int = 64
    transfers: bool = True
    device: str = "cpu"

    def validate(self) -> None:
        """Raise :class:`ConfigError` for an unusable configuration."""
        if not self.groups:
            raise ConfigError("an engine needs at least one KV-cache group")
        if self.num_gpu_blocks <= 0:
            raise ConfigError("num_gpu_blocks must be positive")
        if self.num_cpu_chunks < 0 or self.blocks_per_chunk < 1:
            raise ConfigError("num_cpu_chunks must be >= 0 and blocks_per_chunk >= 1")
        if self.decode_tokens_per_step < 1 or self.max_running < 1:
            raise ConfigError("decode_tokens_per_step and max_running must be >= 1")
        if self.page_bytes < 8:
            raise ConfigError("page_bytes must be >= 8")
        if self.lookahead_tokens < 0:
            raise ConfigError("lookahead_tokens must be >= 0")
        if self.lookahead_tokens and self.eagle_drop:
            raise ConfigError("lookahead hashing and the eagle drop mode are exclusive")
        if self.eagle_drop and len(self.groups) > 1:
            raise ConfigError("the eagle drop mode is modelled for one KV-cache group only")


@dataclass(frozen=True)
class RequestResult:
    """What an engine reused and computed for one request (tokens).

    ``gpu_hit_tokens`` came from the GPU prefix cache, ``cpu_hit_tokens`` were loaded
    from the CPU tier after them, ``computed_tokens`` were prefilled, all at the request's
    first admission; ``preemptions`` counts the times it was preempted and readmitted
    (each readmission is in :attr:`SimEngine.admissions`).
    """

    request_id: str
    engine: str
    prompt_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    computed_tokens: int
    admitted_step: int
    finished_step: int
    preemptions: int = 0


@dataclass(frozen=True)
class AdmissionRecord:
    """One admission lookup: what the engine's own lookup reused for the request.

    ``num_tokens`` is the request's length at the lookup (prompt plus any output a
    preempted request had generated); ``attempt`` is 0 for the first admission."""

    request_id: str
    attempt: int
    step: int
    num_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int


BeforeLookup = Callable[["SimEngine", SimRequest, RequestKey], None]
"""Called right before an admission lookup with the engine, the request and its key
(tokens so far and extras).  Everything the engine changed up to that moment has been
published when it runs."""


@dataclass
class EngineStats:
    """Counters of a :class:`SimEngine` (tokens are prompt tokens)."""

    steps: int = 0
    batches_published: int = 0
    events_published: int = 0
    requests_admitted: int = 0
    requests_finished: int = 0
    preemptions: int = 0
    hits_cut_by_groups: int = 0
    """Hybrid lookups where a later group's hit was shorter than the bound the earlier
    groups gave it (the groups had to agree on less)."""
    hits_cut_by_alignment: int = 0
    """Lookups where a group's matched prefix was cut back to the hit alignment."""
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    computed_tokens: int = 0
    chunks_offered: int = 0
    load_mismatches: int = 0
    requests_rejected: Counter[str] = field(default_factory=Counter)
    admission_deferred: Counter[str] = field(default_factory=Counter)
    offload_skipped: Counter[str] = field(default_factory=Counter)


@dataclass
class _Running:
    req: SimRequest
    key: SimKey
    tokens: list[int]
    hasher: RequestHasher
    blocks: list[list[int]] = field(default_factory=list)
    num_cached: list[int] = field(default_factory=list)
    reserved: int = 0
    admitted_step: int = 0
    gpu_hit: int = 0
    cpu_hit: int = 0
    generated: int = 0
    attempt: int = 0
    first: tuple[int, int, int] | None = None  # (step, gpu, cpu) of the first admission


@dataclass(frozen=True)
class _SpecGroup:
    """Groups sharing one spec: looked up together (a hit needs every one of them)."""

    spec: KVCacheGroupSpec
    ids: tuple[int, ...]


class SimEngine:
    """One simulated engine (one DP rank).  Not thread-safe: drive it from one thread.

    ``sink`` receives one :class:`KVEventBatch` per step that produced events; with
    ``None`` the batches are dropped (and still counted).  ``dp_rank`` is stamped on
    batches only when the sink does not do it itself (a publisher does).
    ``before_lookup`` (see :data:`BeforeLookup`) makes the engine publish what it changed
    before each admission lookup, then calls it.
    """

    def __init__(
        self,
        config: SimEngineConfig | None = None,
        sink: BatchSink | None = None,
        *,
        name: str = "engine0",
        dp_rank: int | None = None,
        before_lookup: BeforeLookup | None = None,
    ) -> None:
        self.config = config or SimEngineConfig()
        self.config.validate()
        self.name = name
        self.sink = sink
        self.dp_rank = dp_rank
        self.before_lookup = before_lookup
        self.stats = EngineStats()
        cfg = self.config
        self.groups = cfg.groups
        self.unit = hash_block_size(cfg.groups)
        self.align = math.lcm(*(g.block_size for g in cfg.groups))
        self._none = none_hash(cfg.hash_algo, cfg.hash_seed)
        self.pool = GPUBlockPool(cfg.num_gpu_blocks)
        # vLLM's HybridKVCacheCoordinator: identical specs are looked up together, full
        # attention first (stable), then the others in group order.
        spec_groups: list[_SpecGroup] = []
        for i, g in enumerate(cfg.groups):
            for j, sg in enumerate(spec_groups):
                if sg.spec == g:
                    spec_groups[j] = _SpecGroup(g, (*sg.ids, i))
                    break
            else:
                spec_groups.append(_SpecGroup(g, (i,)))
        spec_groups.sort(key=lambda sg: not sg.spec.is_full)
        self._spec_groups = spec_groups
        self.offload: SimOffload | None = None
        if cfg.num_cpu_chunks > 0:
            self.offload = SimOffload(
                cfg.num_cpu_chunks,
                cfg.blocks_per_chunk,
                [g.block_size for g in cfg.groups],
                cache_policy=cfg.cpu_cache_policy,
                num_gpu_blocks=cfg.num_gpu_blocks,
                page_bytes=cfg.page_bytes,
                transfers=cfg.transfers,
                device=cfg.device,
                eagle_drop=cfg.eagle_drop,
                windows=[g.sliding_window for g in cfg.groups],
            )
        self._waiting: list[_Running] = []
        self._running: list[_Running] = []
        self._reserved = 0
        self.results: list[RequestResult] = []
        self.admissions: list[AdmissionRecord] = []

    # --- public API --------------------------------------------------------------------
    def add_request(self, req: SimRequest) -> None:
        """Queue a request; it is admitted at a later :meth:`step`."""
        key = req.sim_key
        hasher = RequestHasher(
            self.unit,
            algo=self.config.hash_algo,
            none=self._none,
            key=key,
            lookahead=self.config.lookahead_tokens,
        )
        self._waiting.append(_Running(req, key, list(req.prompt), hasher))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def idle(self) -> bool:
        """No request waiting or running and no offload store in flight."""
        return (
            not self._waiting
            and not self._running
            and (self.offload is None or not self.offload.has_pending())
        )

    def step(self) -> KVEventBatch | None:
        """Run one engine step; returns the batch it published last (or ``None``)."""
        self.stats.steps += 1
        self._admit()
        finished = self._decode()
        for run in finished:
            self._finish(run)
        if self.offload is not None:
            self.offload.complete_pending()
        return self._flush()

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        """Step until :attr:`idle`; returns the number of steps taken."""
        n = 0
        while not self.idle:
            if n >= max_steps:
                raise ConfigError(f"{self.name} not idle after {max_steps} steps")
            self.step()
            n += 1
        return n

    def reset_prefix_cache(self) -> bool:
        """Reset the GPU prefix cache (``AllBlocksCleared``) and the CPU tier (silent,
        C§6.2).  Returns ``False`` while requests hold blocks (nothing changes)."""
        ok = self.pool.reset()
        if ok and self.offload is not None:
            self.offload.reset()
        self._flush()
        return ok

    def close(self) -> None:
        """Shut the sink down if it has a ``shutdown`` method."""
        shutdown = getattr(self.sink, "shutdown", None)
        if callable(shutdown):
            shutdown()

    # --- internals: hashes ---------------------------------------------------------------
    def _group_digests(self, run: _Running) -> list[list[bytes]]:
        raw = run.hasher.extend(run.tokens)
        return [group_block_hashes(raw, g.block_size, self.unit) for g in self.groups]

    def _blocks_for(self, num_tokens: int) -> int:
        return sum(-(-num_tokens // g.block_size) for g in self.groups)

    # --- internals: the GPU lookup (vLLM's coordinators) ---------------------------------
    def _cached(self, digests: list[list[bytes]], sg: _SpecGroup, i: int) -> list[int] | None:
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
        sg: _SpecGroup,
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

    def _find_gpu_hit(
        self, digests: list[list[bytes]], num_tokens: int
    ) -> tuple[int, list[list[int]]]:
        """The GPU hit in tokens and each group's hit blocks (``get_computed_blocks``)."""
        max_length = num_tokens - 1  # the last token is always recomputed
        drop = self.config.eagle_drop
        if len(self.groups) == 1:
            sg = self._spec_groups[0]
            hit = self._lookup_group(digests, sg, max_length, sg.spec.block_size, drop)
            return len(hit) * sg.spec.block_size, [[b[0] for b in hit]]
        align = self.align
        sgs = self._spec_groups
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

    # --- internals: admission -------------------------------------------------------------
    def _admit(self) -> None:
        deferred: list[_Running] = []
        while self._waiting and len(self._running) < self.config.max_running:
            run = self._waiting[0]
            n = len(run.tokens)
            total = self._blocks_for(run.req.num_tokens)
            if total > self.pool.num_blocks:
                self._waiting.pop(0)
                self.stats.requests_rejected["too_long"] += 1
                logger.warning(
                    "%s: request %s needs %d blocks, the pool has %d; rejected",
                    self.name,
                    run.req.request_id,
                    total,
                    self.pool.num_blocks,
                )
                continue
            need = self._blocks_for(n + 1) if self.config.preemption else total
            if need > self.pool.num_free - self._reserved:
                self.stats.admission_deferred["no_free_blocks"] += 1
                break
            self._waiting.pop(0)
            if not self._start(run, 0 if self.config.preemption else total):
                # a CPU chunk it would load is still being written: ask again next step
                self.stats.admission_deferred["cpu_hit_pending"] += 1
                deferred.append(run)
        self._waiting[:0] = deferred

    def request_key(self, run: _Running) -> RequestKey:
        k = run.key
        return RequestKey(
            tuple(run.tokens),
            lora_name=k.lora_name,
            cache_salt=k.cache_salt,
            mm_features=k.mm_features,
            prompt_embeds=k.prompt_embeds,
        )

    def _start(self, run: _Running, total_blocks: int) -> bool:
        """Look the request up and admit it; ``False`` when the CPU lookup is deferred."""
        req = run.req
        if self.before_lookup is not None:
            self._flush()
            self.before_lookup(self, req, self.request_key(run))
        n = len(run.tokens)
        digests = self._group_digests(run)
        gpu_hit, hits = self._find_gpu_hit(digests, n)
        cpu_end = gpu_hit
        if self.offload is not None:
            cpu = self.offload.lookup(run.hasher.digests, gpu_hit, n)
            if cpu is None:
                return False
            cpu_end = gpu_hit + cpu
        # Take every group's hit before allocating anything: an allocation may evict
        # cached free blocks, and must not evict this request's own hits.
        for hit in hits:
            self.pool.touch(hit)
        run.blocks, run.num_cached = [], []
        for g, spec in enumerate(self.groups):
            need = -(-n // spec.block_size) - len(hits[g])
            run.blocks.append(hits[g] + self.pool.allocate(need))
            run.num_cached.append(len(hits[g]))
        allocated = sum(1 for blocks in run.blocks for b in blocks if b != NULL_BLOCK)
        run.reserved = max(0, total_blocks - allocated)
        self._reserved += run.reserved
        # allocate_slots drops what a sliding window no longer needs once the hit is
        # computed (loaded CPU chunks included): those blocks are never loaded or cached
        self._remove_skipped(run, cpu_end)
        if self.offload is not None and cpu_end > gpu_hit:
            self.offload.load(run.hasher.digests, run.blocks, gpu_hit, cpu_end, req.request_id)
            mismatches = self.offload.verify_blocks(digests, run.blocks, gpu_hit, cpu_end)
            self.stats.load_mismatches += mismatches
        run.gpu_hit, run.cpu_hit = gpu_hit, cpu_end - gpu_hit
        run.admitted_step = self.stats.steps
        if run.first is None:
            run.first = (self.stats.steps, run.gpu_hit, run.cpu_hit)
        self.admissions.append(
            AdmissionRecord(
                req.request_id, run.attempt, self.stats.steps, n, run.gpu_hit, run.cpu_hit
            )
        )
        # Prefill: every token becomes computed; full blocks are cached.
        if self.offload is not None:
            self.offload.write_blocks(digests, run.blocks, cpu_end, n)
        self._cache_full(run, digests)
        if self.offload is not None:
            offered = self.offload.store(
                run.hasher.digests, run.blocks, len(req.prompt), req.request_id
            )
            self.stats.chunks_offered += offered
        self._running.append(run)
        st = self.stats
        st.requests_admitted += 1
        if run.attempt == 0:
            st.prompt_tokens += n
        st.gpu_hit_tokens += run.gpu_hit
        st.cpu_hit_tokens += run.cpu_hit
        st.computed_tokens += n - gpu_hit - run.cpu_hit
        return True

    def _cache_full(self, run: _Running, digests: list[list[bytes]]) -> None:
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
                lora_id=_lora_id(lora),
                lora_name=lora,
                event_extra_keys=extras_of,
                lookahead=self.config.lookahead_tokens,
            )
            run.num_cached[g] = max(run.num_cached[g], num_full)
            if spec.is_full and spec.block_size != self.unit:
                self._cache_partial_tail(run, g, spec, extras_of)

    def _cache_partial_tail(
        self,
        run: _Running,
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
            lora_id=_lora_id(lora),
            lora_name=lora,
            extra_keys=extras_of(boundary - unit, boundary) if extras_of else None,
        )

    # --- internals: decode, preemption, finish ---------------------------------------------
    def _remove_skipped(self, run: _Running, computed: int) -> None:
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

    def _preempt(self, run: _Running) -> None:
        """Free a running request's blocks and put it first in line to be recomputed."""
        self._running.remove(run)
        for blocks in run.blocks:
            self.pool.free(list(reversed(blocks)))
        self._reserved -= run.reserved
        run.reserved = 0
        run.blocks, run.num_cached = [], []
        run.attempt += 1
        self._waiting.insert(0, run)
        self.stats.preemptions += 1

    def _decode(self) -> list[_Running]:
        finished: list[_Running] = []
        for run in list(self._running):
            if run not in self._running:
                continue  # preempted by an earlier request this step
            out = run.req.output
            take = out[run.generated : run.generated + self.config.decode_tokens_per_step]
            if take:
                self._remove_skipped(run, len(run.tokens))
                new_len = len(run.tokens) + len(take)
                needs = [
                    -(-new_len // spec.block_size) - len(run.blocks[g])
                    for g, spec in enumerate(self.groups)
                ]
                total = sum(n for n in needs if n > 0)
                if self.config.preemption:
                    while total > self.pool.num_free:
                        victim = self._running[-1]
                        self._preempt(victim)
                        if victim is run:
                            break
                    if run not in self._running:
                        continue
                for g, need in enumerate(needs):
                    if need > 0:
                        run.blocks[g].extend(self.pool.allocate(need))
                        used = min(need, run.reserved)
                        run.reserved -= used
                        self._reserved -= used
                run.tokens.extend(take)
                run.generated += len(take)
                digests = self._group_digests(run)
                if self.offload is not None:
                    start = len(run.tokens) - len(take)
                    self.offload.write_blocks(digests, run.blocks, start, len(run.tokens))
                self._cache_full(run, digests)
            if run.generated >= len(out):
                finished.append(run)
        return finished

    def _finish(self, run: _Running) -> None:
        self._running.remove(run)
        if self.offload is not None:
            # A finished request stores up to num_tokens - 1 (C§5.7).
            self.stats.chunks_offered += self.offload.store(
                run.hasher.digests, run.blocks, len(run.tokens) - 1, run.req.request_id
            )
            self.offload.finished(run.req.request_id)
        for blocks in run.blocks:
            self.pool.free(list(reversed(blocks)))
        self._reserved -= run.reserved
        self.stats.requests_finished += 1
        step, gpu, cpu = run.first or (run.admitted_step, run.gpu_hit, run.cpu_hit)
        n = len(run.req.prompt)
        self.results.append(
            RequestResult(
                run.req.request_id,
                self.name,
                n,
                gpu,
                cpu,
                n - gpu - cpu,
                step,
                self.stats.steps,
                run.attempt,
            )
        )

    def _flush(self) -> KVEventBatch | None:
        events: list[KVEvent] = self.pool.take_events()
        if self.offload is not None:
            events.extend(self.offload.take_events())
        if not events:
            return None
        batch = KVEventBatch(time.time(), events, self.dp_rank)
        self.stats.batches_published += 1
        self.stats.events_published += len(events)
        if self.sink is not None:
            self.sink.publish(batch)
        return batch


def _lora_id(name: str | None) -> int | None:
    if name is None:
        return None
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=2).digest(), "big") + 1
