"""An engine publishing its KV-cache events, CPU offload included (no torch needed).

This is the engine side of kvevents in one file.  A toy engine serves chat requests that
share per-tenant system prompts.  Each engine step it:

1. hashes the prompt's full blocks with vLLM's ``sha256_cbor`` block hashes, reuses the
   blocks its GPU prefix cache already holds and stores the new ones
   (``BlockStored``, medium GPU, with the tokens and the block size);
2. evicts the least recently used GPU blocks when the pool is full (``BlockRemoved``);
3. offers every whole chunk of ``--blocks-per-chunk`` blocks to the CPU tier through
   ``CPUOffloadingManager`` (LRU), the way vLLM's offloading connector does, and reads
   back chunks the CPU tier already holds;
4. drains the manager's ``OffloadingEvent`` s through ``OffloadEventTranslator`` into
   the events vLLM publishes for the CPU tier: placeholders with ``block_size=0`` and no
   tokens, which a consumer joins with the GPU store of the same hash;
5. publishes the step's events as one ``KVEventBatch`` with ``ZmqEventPublisher``
   (vLLM's frames, seq numbers and replay socket).  ``publish()`` never blocks.

A real engine also copies the blocks' bytes between GPU and host memory
(``kvevents.publishers.offload.transfer``, which needs torch); the events are the same.

Run it, then follow it from another terminal::

    python examples/publish_engine.py --requests 0          # until Ctrl-C
    python examples/follow_engines.py tcp://127.0.0.1:5557 \\
        --replay-endpoint tcp://127.0.0.1:5558 --from-start

``--requests N`` stops after N requests (0: run until interrupted); ``--json`` prints
the totals as one JSON object at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import OrderedDict

from kvevents import BlockRemoved, BlockStored, KVEventBatch
from kvevents.hashing import hash_request_blocks, to_wire_hash
from kvevents.publishers import ZmqEventPublisher
from kvevents.publishers.offload import (
    CPUOffloadingManager,
    OffloadEventTranslator,
    OffloadGroup,
    ReqContext,
    drain_kv_events,
    make_offload_key,
)


class ToyEngine:
    """A GPU prefix cache of ``gpu_blocks`` blocks with a CPU tier behind it."""

    def __init__(self, args: argparse.Namespace, publisher: ZmqEventPublisher) -> None:
        self.block_size = args.block_size
        self.bpc = args.blocks_per_chunk
        self.gpu_blocks = args.gpu_blocks
        self.publisher = publisher
        # digest -> wire hash of every block on GPU, least recently used first
        self.gpu: OrderedDict[bytes, int] = OrderedDict()
        # The CPU tier: the manager decides what is stored and evicted (LRU) and emits
        # OffloadingEvents; the translator turns them into vLLM's wire events.
        self.cpu = CPUOffloadingManager(args.cpu_chunks, cache_policy="lru", enable_events=True)
        self.translator = OffloadEventTranslator(
            [OffloadGroup(self.block_size)], blocks_per_chunk=self.bpc
        )
        self.totals = {"requests": 0, "batches": 0, "events": 0, "prompt_tokens": 0}
        self.totals |= {"gpu_hit_tokens": 0, "cpu_hit_tokens": 0, "cpu_placeholders": 0}

    def step(self, req_id: str, prompt: list[int]) -> None:
        """Serve one request's prefill and publish what changed in the cache."""
        events: list[BlockStored | BlockRemoved] = []
        digests = hash_request_blocks(prompt, self.block_size, algo="sha256_cbor")
        # GPU prefix hit: the leading blocks already cached.
        hit = 0
        while hit < len(digests) and digests[hit] in self.gpu:
            self.gpu.move_to_end(digests[hit])
            hit += 1
        # CPU hit: whole chunks after the GPU hit that the CPU tier holds.
        ctx = ReqContext(req_id=req_id)
        loaded = self._load_from_cpu(digests, hit, ctx)
        self.totals["gpu_hit_tokens"] += hit * self.block_size
        self.totals["cpu_hit_tokens"] += loaded * self.block_size
        # Store the blocks after the GPU hit (loaded ones come back onto the GPU too).
        new = digests[hit:]
        if new:
            events += self._evict(len(new))
            wire = [to_wire_hash(d) for d in new]
            for d, h in zip(new, wire):
                self.gpu[d] = h
            parent = to_wire_hash(digests[hit - 1]) if hit else None
            first, last = hit * self.block_size, len(digests) * self.block_size
            events.append(
                BlockStored(
                    block_hashes=wire,
                    parent_block_hash=parent,
                    token_ids=prompt[first:last],
                    block_size=self.block_size,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
        self._offload(digests, ctx)
        cpu_events = drain_kv_events(self.cpu, self.translator)
        self.totals["cpu_placeholders"] += sum(isinstance(e, BlockStored) for e in cpu_events)
        events += cpu_events
        self.totals["requests"] += 1
        self.totals["prompt_tokens"] += len(prompt)
        if events:  # like vLLM, a step without cache changes publishes nothing
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            self.totals["batches"] += 1
            self.totals["events"] += len(events)

    def _chunk_key(self, digests: list[bytes], chunk: int) -> bytes:
        # A chunk is named by the hash of its last block, tagged with the group (0).
        return bytes(make_offload_key(digests[(chunk + 1) * self.bpc - 1], 0))

    def _load_from_cpu(self, digests: list[bytes], gpu_hit: int, ctx: ReqContext) -> int:
        """Blocks after ``gpu_hit`` read back from CPU chunks (whole chunks only)."""
        chunk, keys = gpu_hit // self.bpc, []
        while (chunk + 1) * self.bpc <= len(digests):
            key = self._chunk_key(digests, chunk)
            if self.cpu.lookup(key, ctx).name != "HIT":
                break
            keys.append(key)
            chunk += 1
        if not keys or chunk * self.bpc <= gpu_hit:
            return 0
        self.cpu.prepare_load(keys, ctx)  # pins the chunks while they are read
        self.cpu.complete_load(keys, ctx)  # (a real engine copies the bytes in between)
        return chunk * self.bpc - gpu_hit

    def _offload(self, digests: list[bytes], ctx: ReqContext) -> None:
        """Offer every whole chunk of the prompt to the CPU tier."""
        keys = []
        for chunk in range(len(digests) // self.bpc):
            key = self._chunk_key(digests, chunk)
            ctx.set_position(key, (chunk + 1) * self.bpc * self.block_size)
            keys.append(key)
        if keys:
            out = self.cpu.prepare_store(keys, ctx)  # None: no room even after evicting
            if out is not None and out.keys_to_store:
                # A real engine submits the copies here and completes them when done.
                self.cpu.complete_store(list(out.keys_to_store), ctx, success=True)
        self.cpu.on_request_finished(ctx)

    def _evict(self, needed: int) -> list[BlockStored | BlockRemoved]:
        """Free GPU blocks for ``needed`` new ones, least recently used first."""
        gone = []
        while self.gpu and len(self.gpu) + needed > self.gpu_blocks:
            _, h = self.gpu.popitem(last=False)
            gone.append(h)
        return [BlockRemoved(block_hashes=gone, medium="GPU", group_idx=0)] if gone else []


TENANTS = 3


def system_prompts(block_size: int = 16) -> list[list[int]]:
    """Each tenant's system prompt (8 blocks): the shared prefixes that make routing
    matter.  The same on every engine, so a router can tell who holds which."""
    rng = random.Random(1234)
    return [[rng.randrange(1000, 30000) for _ in range(8 * block_size)] for _ in range(TENANTS)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # vLLM's default ports, on loopback only ('tcp://*:5557' listens on every interface).
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="PUB endpoint to bind")
    p.add_argument("--replay-endpoint", default="tcp://127.0.0.1:5558", help="replay endpoint")
    p.add_argument("--requests", type=int, default=200, help="stop after N requests (0: never)")
    p.add_argument("--interval", type=float, default=0.05, help="seconds between requests")
    p.add_argument("--hold", type=float, default=1.0, help="serve replays S s after the end")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--blocks-per-chunk", type=int, default=4, help="GPU blocks per CPU chunk")
    p.add_argument("--gpu-blocks", type=int, default=32, help="GPU blocks in the pool")
    p.add_argument("--cpu-chunks", type=int, default=32, help="CPU chunks in the tier")
    p.add_argument("--seed", type=int, default=0, help="seed of the questions")
    p.add_argument(
        "--tenants",
        default=",".join(str(t) for t in range(TENANTS)),
        help=f"which tenants' requests this engine serves (of 0..{TENANTS - 1})",
    )
    p.add_argument("--json", action="store_true", help="print the totals as JSON")
    args = p.parse_args()

    rng = random.Random(args.seed)
    prompts = system_prompts(args.block_size)
    chosen = [t.strip() for t in args.tenants.split(",")]
    if not all(t.isdigit() and int(t) < TENANTS for t in chosen):
        p.error(f"--tenants wants tenant numbers from 0 to {TENANTS - 1}, got {args.tenants!r}")
    systems = [prompts[int(t)] for t in chosen]
    # bind=True: bind the PUB socket even on tcp://127.0.0.1 (vLLM's rule binds only '*'
    # and '::' addresses and connects to others, e.g. to an XSUB proxy).
    publisher = ZmqEventPublisher(
        endpoint=args.endpoint, replay_endpoint=args.replay_endpoint, bind=True
    )
    print(f"publishing on {publisher.endpoint}, replay on {publisher.replay_endpoint}", flush=True)
    engine = ToyEngine(args, publisher)
    n = 0
    try:
        while args.requests == 0 or n < args.requests:
            question = [rng.randrange(30000, 32000) for _ in range(rng.randrange(16, 96))]
            engine.step(f"req-{n}", rng.choice(systems) + question)
            n += 1
            if args.interval > 0:
                time.sleep(args.interval)  # pacing of the toy workload, not synchronisation
        time.sleep(args.hold)  # late subscribers can still fetch the history by replay
    except KeyboardInterrupt:
        pass
    finally:
        publisher.shutdown()  # sends what is queued; never raises
    totals = {**engine.totals, "dropped_batches": publisher.stats.dropped_batches}
    if args.json:
        print(json.dumps(totals))
    else:
        print(", ".join(f"{k} {v}" for k, v in totals.items()))


if __name__ == "__main__":
    main()
