"""What a simulated engine is configured with and what it reports: its
:class:`SimEngineConfig`, the :class:`BatchSink` its batches go to, a finished request's
:class:`RequestResult`, an :class:`AdmissionRecord` per lookup and its
:class:`EngineStats` counters.

One job: the engine's plain data types.  Imports only the core (errors, events) and
:mod:`kvevents.sim.block_pool` (for :class:`~kvevents.sim.block_pool.KVCacheGroupSpec`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from kvevents.errors import ConfigError
from kvevents.events import KVEventBatch
from kvevents.sim.block_pool import KVCacheGroupSpec

__all__ = [
    "AdmissionRecord",
    "BatchSink",
    "EngineStats",
    "RequestResult",
    "SimEngineConfig",
]


class BatchSink(Protocol):
    """Where an engine's batches go: an event publisher (``ZmqEventPublisher`` or
    anything with the same ``publish``)."""

    def publish(self, batch: KVEventBatch) -> None: ...


@dataclass(frozen=True)
class SimEngineConfig:
    """Shape of one simulated engine.

    * ``groups``: the KV-cache groups; several with different block sizes make a hybrid
      model (hashes at the GCD granularity, vLLM's ``hash_block_size``);
      ``KVCacheGroupSpec(bs, "sliding_window", sliding_window=w)`` adds a sliding-window
      group.
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
    (each readmission is in :attr:`SimEngine.admissions`).  ``remote_tokens`` were
    received from a remote prefill (a disaggregated decode); ``block_ids`` are the GPU
    block ids that held the prompt, per KV-cache group (what a prefill engine names to
    the decode engine that pulls them).
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
    remote_tokens: int = 0
    block_ids: tuple[tuple[int, ...], ...] = ()


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
    remote_tokens: int = 0
    """Prompt tokens received from a remote prefill instead of computed."""
    chunks_offered: int = 0
    load_mismatches: int = 0
    requests_rejected: Counter[str] = field(default_factory=Counter)
    admission_deferred: Counter[str] = field(default_factory=Counter)
    offload_skipped: Counter[str] = field(default_factory=Counter)
