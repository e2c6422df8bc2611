"""A simulated engine: scheduler steps over a GPU block pool, CPU offload, one publisher.

Each :meth:`SimEngine.step` is one engine step (C§2.5):

1. stores submitted last step complete (``complete_store``), so CPU ``BlockStored``
   events trail the GPU ones by a step, as the asynchronous transfer worker makes them;
2. waiting requests are admitted while blocks allow: the GPU prefix hit is taken from
   the pool, the CPU hit (whole chunks after it, C§5.7, counted like vLLM's
   ``_lookup_complete_chunks``) is loaded from host memory into fresh GPU blocks, the
   prompt is "prefilled" and its full blocks cached (GPU ``BlockStored``), and its full
   chunks are offered to the CPU manager (``prepare_store`` + a block copy);
3. running requests decode ``decode_tokens_per_step`` tokens, caching blocks that fill;
4. finished requests offload their remaining full chunks (up to ``num_tokens − 1``),
   tell the manager they finished, and free their blocks tail-first;
5. GPU events, then the translated offload events, go out as one ``KVEventBatch``
   through the engine's publisher, if there were any.

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
from dataclasses import dataclass, field
from typing import Protocol

from kvevents.errors import ConfigError
from kvevents.events import KVEvent, KVEventBatch
from kvevents.hashing import none_hash
from kvevents.sim.block_pool import (
    GPUBlockPool,
    KVCacheGroupSpec,
    RequestHasher,
    group_block_hashes,
    hash_block_size,
)
from kvevents.sim.offload import SimOffload
from kvevents.sim.workload import SimRequest

__all__ = [
    "BatchSink",
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
      model (hashes at the GCD granularity, C§4.1).
    * ``num_gpu_blocks``: physical GPU blocks shared by all groups.
    * ``num_cpu_chunks``: CPU offload capacity in chunks (0 turns offload off);
      ``blocks_per_chunk`` GPU blocks per chunk; ``cpu_cache_policy`` ``"lru"``/``"arc"``.
    * ``hash_algo`` / ``hash_seed``: vLLM's ``prefix_caching_hash_algo`` and NONE_HASH seed
      (``None``: ``$PYTHONHASHSEED`` or ``"vllm-none-hash"``).
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


@dataclass(frozen=True)
class RequestResult:
    """What an engine reused and computed for one request (tokens).

    ``gpu_hit_tokens`` came from the GPU prefix cache, ``cpu_hit_tokens`` were loaded
    from the CPU tier after them, ``computed_tokens`` were prefilled.
    """

    request_id: str
    engine: str
    prompt_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    computed_tokens: int
    admitted_step: int
    finished_step: int


@dataclass
class EngineStats:
    """Counters of a :class:`SimEngine` (tokens are prompt tokens)."""

    steps: int = 0
    batches_published: int = 0
    events_published: int = 0
    requests_admitted: int = 0
    requests_finished: int = 0
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
    tokens: list[int]
    hasher: RequestHasher
    blocks: list[list[int]]
    num_cached: list[int]
    reserved: int
    admitted_step: int
    gpu_hit: int
    cpu_hit: int
    generated: int = 0


class SimEngine:
    """One simulated engine (one DP rank).  Not thread-safe: drive it from one thread.

    ``sink`` receives one :class:`KVEventBatch` per step that produced events; with
    ``None`` the batches are dropped (and still counted).  ``dp_rank`` is stamped on
    batches only when the sink does not do it itself (a publisher does).
    """

    def __init__(
        self,
        config: SimEngineConfig | None = None,
        sink: BatchSink | None = None,
        *,
        name: str = "engine0",
        dp_rank: int | None = None,
    ) -> None:
        self.config = config or SimEngineConfig()
        self.config.validate()
        self.name = name
        self.sink = sink
        self.dp_rank = dp_rank
        self.stats = EngineStats()
        cfg = self.config
        self.groups = cfg.groups
        self.unit = hash_block_size(cfg.groups)
        self.align = math.lcm(*(g.block_size for g in cfg.groups))
        self._none = none_hash(cfg.hash_algo, cfg.hash_seed)
        self.pool = GPUBlockPool(cfg.num_gpu_blocks)
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
            )
        self._waiting: list[SimRequest] = []
        self._running: list[_Running] = []
        self._reserved = 0
        self.results: list[RequestResult] = []

    # --- public API --------------------------------------------------------------------
    def add_request(self, req: SimRequest) -> None:
        """Queue a request; it is admitted at a later :meth:`step`."""
        self._waiting.append(req)

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
        """Run one engine step; returns the batch it published (or ``None``)."""
        self.stats.steps += 1
        if self.offload is not None:
            self.offload.complete_pending()
        self._admit()
        finished = self._decode()
        for run in finished:
            self._finish(run)
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

    # --- internals ---------------------------------------------------------------------
    def _group_digests(self, run: _Running) -> list[list[bytes]]:
        raw = run.hasher.extend(run.tokens)
        return [group_block_hashes(raw, g.block_size, self.unit) for g in self.groups]

    def _blocks_for(self, num_tokens: int) -> int:
        return sum(-(-num_tokens // g.block_size) for g in self.groups)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_running:
            req = self._waiting[0]
            total = self._blocks_for(req.num_tokens)
            if total > self.pool.num_blocks:
                self._waiting.pop(0)
                self.stats.requests_rejected["too_long"] += 1
                logger.warning(
                    "%s: request %s needs %d blocks, the pool has %d; rejected",
                    self.name,
                    req.request_id,
                    total,
                    self.pool.num_blocks,
                )
                continue
            if total > self.pool.num_free - self._reserved:
                self.stats.admission_deferred["no_free_blocks"] += 1
                return
            self._waiting.pop(0)
            self._start(req, total)

    def _start(self, req: SimRequest, total_blocks: int) -> None:
        prompt = list(req.prompt)
        extra = ("lora", req.lora_name, f"/loras/{req.lora_name}") if req.lora_name else None
        hasher = RequestHasher(
            self.unit,
            algo=self.config.hash_algo,
            none=self._none,
            extra_keys=(extra,) if extra else None,
        )
        run = _Running(req, prompt, hasher, [], [], 0, self.stats.steps, 0, 0)
        digests = self._group_digests(run)
        # Reuse at most len(prompt) - 1 tokens: at least one token is always computed.
        limit = ((len(prompt) - 1) // self.align) * self.align
        gpu_hit = min(
            len(self.pool.longest_hit(digests[g], g)) * spec.block_size
            for g, spec in enumerate(self.groups)
        )
        gpu_hit = min((gpu_hit // self.align) * self.align, limit)
        cpu_end = gpu_hit
        if self.offload is not None:
            cpu_end = self.offload.lookup(run.hasher.digests, gpu_hit, limit, self.align)
        # Take every group's hit before allocating anything: an allocation may evict
        # cached free blocks, and must not evict this request's own hits.
        hits = [
            self.pool.longest_hit(digests[g], g)[: gpu_hit // spec.block_size]
            for g, spec in enumerate(self.groups)
        ]
        for hit in hits:
            self.pool.touch(hit)
        for g, spec in enumerate(self.groups):
            need = -(-len(prompt) // spec.block_size) - len(hits[g])
            run.blocks.append(hits[g] + self.pool.allocate(need))
            run.num_cached.append(len(hits[g]))
        allocated = sum(len(b) for b in run.blocks)
        run.reserved = total_blocks - allocated
        self._reserved += run.reserved
        if self.offload is not None and cpu_end > gpu_hit:
            self.offload.load(run.hasher.digests, run.blocks, gpu_hit, cpu_end, req.request_id)
            mismatches = self.offload.verify_blocks(digests, run.blocks, gpu_hit, cpu_end)
            self.stats.load_mismatches += mismatches
        run.gpu_hit, run.cpu_hit = gpu_hit, cpu_end - gpu_hit
        # Prefill: every prompt block becomes computed; full ones are cached.
        if self.offload is not None:
            self.offload.write_blocks(digests, run.blocks, cpu_end, len(prompt))
        self._cache_full(run, digests)
        if self.offload is not None:
            offered = self.offload.store(
                run.hasher.digests, run.blocks, len(prompt), req.request_id
            )
            self.stats.chunks_offered += offered
        self._running.append(run)
        st = self.stats
        st.requests_admitted += 1
        st.prompt_tokens += len(prompt)
        st.gpu_hit_tokens += run.gpu_hit
        st.cpu_hit_tokens += run.cpu_hit
        st.computed_tokens += len(prompt) - gpu_hit - run.cpu_hit

    def _cache_full(self, run: _Running, digests: list[list[bytes]]) -> None:
        lora = run.req.lora_name
        for g, spec in enumerate(self.groups):
            num_full = len(run.tokens) // spec.block_size
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
                event_extra_keys=(lora,) if lora else None,
            )
            run.num_cached[g] = max(run.num_cached[g], num_full)

    def _decode(self) -> list[_Running]:
        finished: list[_Running] = []
        for run in self._running:
            out = run.req.output
            take = out[run.generated : run.generated + self.config.decode_tokens_per_step]
            if take:
                run.tokens.extend(take)
                run.generated += len(take)
                for g, spec in enumerate(self.groups):
                    need = -(-len(run.tokens) // spec.block_size) - len(run.blocks[g])
                    if need > 0:
                        run.blocks[g].extend(self.pool.allocate(need))
                        run.reserved -= need
                        self._reserved -= need
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
        self.results.append(
            RequestResult(
                run.req.request_id,
                self.name,
                len(run.req.prompt),
                run.gpu_hit,
                run.cpu_hit,
                len(run.req.prompt) - run.gpu_hit - run.cpu_hit,
                run.admitted_step,
                self.stats.steps,
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
