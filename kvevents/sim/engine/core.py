"""The simulated engine's scheduler: :class:`SimEngine` admits, decodes, preempts and
finishes requests step by step and publishes what each step changed.

One job: the step loop (see :mod:`kvevents.sim.engine` for what one step does).  The
lookup is :mod:`~kvevents.sim.engine.lookup`'s, a request's block bookkeeping
:mod:`~kvevents.sim.engine.blocks`', the data types :mod:`~kvevents.sim.engine.records`';
CPU offload is :mod:`kvevents.sim.offload`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvevents.errors import ConfigError
from kvevents.events import KVEvent, KVEventBatch
from kvevents.hashing import none_hash
from kvevents.request import RequestKey
from kvevents.sim.block_pool import (
    NULL_BLOCK,
    GPUBlockPool,
    RequestHasher,
    hash_block_size,
)
from kvevents.sim.engine.blocks import RequestBlocks
from kvevents.sim.engine.lookup import GPULookup
from kvevents.sim.engine.records import (
    AdmissionRecord,
    BatchSink,
    EngineStats,
    RequestResult,
    SimEngineConfig,
)
from kvevents.sim.engine.running import RunningRequest
from kvevents.sim.offload import SimOffload
from kvevents.sim.workload import SimRequest

__all__ = ["BeforeLookup", "SimEngine", "make_offload"]

logger = logging.getLogger(__name__)


BeforeLookup = Callable[["SimEngine", SimRequest, RequestKey], None]
"""Called right before an admission lookup with the engine, the request and its key
(tokens so far and extras).  Everything the engine changed up to that moment has been
published when it runs."""


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
        self._none = none_hash(cfg.hash_algo, cfg.hash_seed)
        self.pool = GPUBlockPool(cfg.num_gpu_blocks)
        self.lookup = GPULookup(self.pool, cfg.groups, eagle_drop=cfg.eagle_drop, stats=self.stats)
        """The GPU prefix-cache lookup (vLLM's coordinators)."""
        self.align = self.lookup.align
        self.blocks = RequestBlocks(self.pool, cfg.groups, self.unit, cfg.lookahead_tokens)
        """Caching and freeing a request's blocks."""
        self.offload: SimOffload | None = make_offload(cfg)
        """The CPU tier (None when ``num_cpu_chunks`` is 0)."""
        self._waiting: list[RunningRequest] = []
        self._running: list[RunningRequest] = []
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
        self._waiting.append(RunningRequest(req, key, list(req.prompt), hasher))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def progress(self) -> list[tuple[str, int]]:
        """``(request_id, output tokens generated so far)`` of every running request."""
        return [(run.req.request_id, run.generated) for run in self._running]

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
        as in vLLM).  Returns ``False`` while requests hold blocks (nothing changes)."""
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

    # --- internals: admission -------------------------------------------------------------
    def _admit(self) -> None:
        deferred: list[RunningRequest] = []
        while self._waiting and len(self._running) < self.config.max_running:
            run = self._waiting[0]
            n = len(run.tokens)
            total = self.blocks.blocks_for(run.req.num_tokens)
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
            need = self.blocks.blocks_for(n + 1) if self.config.preemption else total
            if need > self.pool.num_free - self._reserved:
                self.stats.admission_deferred["no_free_blocks"] += 1
                break
            self._waiting.pop(0)
            if not self._start(run, 0 if self.config.preemption else total):
                # a CPU chunk it would load is still being written: ask again next step
                self.stats.admission_deferred["cpu_hit_pending"] += 1
                deferred.append(run)
        self._waiting[:0] = deferred

    def request_key(self, run: RunningRequest) -> RequestKey:
        """The routing key of ``run`` as it stands (tokens so far and its extras)."""
        return run.request_key()

    def _start(self, run: RunningRequest, total_blocks: int) -> bool:
        """Look the request up and admit it; ``False`` when the CPU lookup is deferred."""
        req = run.req
        if self.before_lookup is not None:
            self._flush()
            self.before_lookup(self, req, self.request_key(run))
        n = len(run.tokens)
        digests = self.blocks.digests(run)
        gpu_hit, hits = self.lookup.find_gpu_hit(digests, n)
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
        self.blocks.remove_skipped(run, cpu_end)
        if self.offload is not None and cpu_end > gpu_hit:
            self.offload.load(run.hasher.digests, run.blocks, gpu_hit, cpu_end, req.request_id)
            mismatches = self.offload.verify_blocks(digests, run.blocks, gpu_hit, cpu_end)
            self.stats.load_mismatches += mismatches
        run.gpu_hit, run.cpu_hit = gpu_hit, cpu_end - gpu_hit
        # a disaggregated decode: the connector fills the prompt's blocks past the local
        # hit with the remote prefill's KV (all but the last prompt token, which the
        # engine computes); they are cached below like computed ones
        run.remote = max(0, min(req.remote_tokens, n - 1) - cpu_end)
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
        self.blocks.cache_full(run, digests)
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
        st.computed_tokens += n - gpu_hit - run.cpu_hit - run.remote
        st.remote_tokens += run.remote
        return True

    def _preempt(self, run: RunningRequest) -> None:
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

    def _decode(self) -> list[RunningRequest]:
        finished: list[RunningRequest] = []
        for run in list(self._running):
            if run not in self._running:
                continue  # preempted by an earlier request this step
            out = run.req.output
            take = out[run.generated : run.generated + self.config.decode_tokens_per_step]
            if take:
                self.blocks.remove_skipped(run, len(run.tokens))
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
                digests = self.blocks.digests(run)
                if self.offload is not None:
                    start = len(run.tokens) - len(take)
                    self.offload.write_blocks(digests, run.blocks, start, len(run.tokens))
                self.blocks.cache_full(run, digests)
            if run.generated >= len(out):
                finished.append(run)
        return finished

    def _finish(self, run: RunningRequest) -> None:
        self._running.remove(run)
        if self.offload is not None:
            # A finished request stores up to num_tokens - 1 (as vLLM's offload scheduler).
            self.stats.chunks_offered += self.offload.store(
                run.hasher.digests, run.blocks, len(run.tokens) - 1, run.req.request_id
            )
            self.offload.finished(run.req.request_id)
        n = len(run.req.prompt)
        block_ids = tuple(
            tuple(run.blocks[g][: -(-n // spec.block_size)]) for g, spec in enumerate(self.groups)
        )
        for blocks in run.blocks:
            self.pool.free(list(reversed(blocks)))
        self._reserved -= run.reserved
        self.stats.requests_finished += 1
        step, gpu, cpu = run.first or (run.admitted_step, run.gpu_hit, run.cpu_hit)
        self.results.append(
            RequestResult(
                run.req.request_id,
                self.name,
                n,
                gpu,
                cpu,
                n - gpu - cpu - run.remote,
                step,
                self.stats.steps,
                run.attempt,
                run.remote,
                block_ids,
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


def make_offload(cfg: SimEngineConfig) -> SimOffload | None:
    """The CPU tier an engine of shape ``cfg`` has (None when ``num_cpu_chunks`` is 0)."""
    if cfg.num_cpu_chunks <= 0:
        return None
    return SimOffload(
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
