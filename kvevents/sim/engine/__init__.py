"""A simulated engine: scheduler steps over a GPU block pool, CPU offload, one publisher.

Each :meth:`SimEngine.step` is one engine step (one batch per step, as vLLM's scheduler
publishes):

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

Rooms: :mod:`~kvevents.sim.engine.records` (config, results, stats),
:mod:`~kvevents.sim.engine.running` (one request's state),
:mod:`~kvevents.sim.engine.lookup` (the GPU hit), :mod:`~kvevents.sim.engine.blocks`
(caching and freeing a request's blocks), :mod:`~kvevents.sim.engine.core` (the
scheduler, :class:`SimEngine`).  This package re-exports the public names.
"""

from kvevents.sim.engine.core import BeforeLookup, SimEngine
from kvevents.sim.engine.records import (
    AdmissionRecord,
    BatchSink,
    EngineStats,
    RequestResult,
    SimEngineConfig,
)

__all__ = [
    "AdmissionRecord",
    "BatchSink",
    "BeforeLookup",
    "EngineStats",
    "RequestResult",
    "SimEngine",
    "SimEngineConfig",
]
