"""One request inside a simulated engine: its tokens, hasher, blocks per KV-cache group
and what its admission reused; and the LoRA id a LoRA name is published with.

One job: per-request state.  Imports the sim's block pool (the hasher), keys and
workload.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from kvevents.request import RequestKey
from kvevents.sim.block_pool import RequestHasher
from kvevents.sim.keys import SimKey
from kvevents.sim.workload import SimRequest

__all__ = ["RunningRequest", "lora_id"]


@dataclass
class RunningRequest:
    """A request the engine holds (waiting or running).

    ``tokens`` are the prompt plus the output generated so far; ``blocks[g]`` /
    ``num_cached[g]`` its blocks and cached-block count in KV-cache group ``g``;
    ``reserved`` blocks promised to it but not allocated yet; ``gpu_hit`` / ``cpu_hit``
    the tokens its last admission reused; ``generated`` output tokens so far;
    ``attempt`` 0 until it is preempted; ``first`` ``(step, gpu_hit, cpu_hit)`` of its
    first admission.
    """

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
    remote: int = 0
    generated: int = 0
    attempt: int = 0
    first: tuple[int, int, int] | None = None  # (step, gpu, cpu) of the first admission

    def request_key(self) -> RequestKey:
        """The routing key of this request as it stands (tokens so far and its extras)."""
        k = self.key
        return RequestKey(
            tuple(self.tokens),
            lora_name=k.lora_name,
            cache_salt=k.cache_salt,
            mm_features=k.mm_features,
            prompt_embeds=k.prompt_embeds,
        )


def lora_id(name: str | None) -> int | None:
    """The ``lora_id`` a simulated engine publishes for LoRA ``name`` (None: no LoRA):
    a stable small positive integer derived from the name."""
    if name is None:
        return None
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=2).digest(), "big") + 1
