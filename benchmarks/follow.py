"""Follow a fleet: payload bytes of many engines' KV events into one ``BlockIndex``.

The workload is a fleet's event stream as a router receives it: ``--engines`` engines
(1,000; 100 with ``--quick``), each serving requests that share one of 24 system prompts
(512 to 8,192 tokens) and add a private tail (64 to 1,024 tokens); 16-token blocks on
GPU with a per-engine pool (oldest requests' tails evicted first, one ``BlockRemoved``
per evicted block as vLLM's ``BlockPool`` publishes them), and every fourth block's chunk
offloaded to CPU as vLLM's offload connector announces it (a placeholder ``BlockStored``
with ``block_size`` 0 and no tokens), with CPU evictions as one removal per batch.  Each
batch is encoded by vLLM 0.33's own classes (the stand-in of ``benchmarks/vs_vllm.py``
when vLLM is absent), map form, int hashes; engines' batches interleave.

Rows, in block-events/s (one block hash of any event), same run:

* baseline: vLLM 0.33's typed decoder (``msgspec.msgpack.Decoder`` of its
  ``KVEventBatch``) merely decoding the bytes;
* ``python``: ``BatchDecoder.decode`` + ``BlockIndex.apply`` (the pure-Python path;
  content keys by the ``xxhash`` package);
* ``native``: ``BlockIndex.apply_payload`` with the compiled core (native parse and
  content keys, the Python index rules); skipped, saying so, without the core.

Both index rows must end with the same counters and entries (checked), and no payload may
fall back to the Python decoder.  Memory rows: bytes per resident (worker, tier, hash)
entry, the RSS growth of following the stream (the index kept) minus that of only
decoding it, each path in a fresh process, the Python core and the compiled one.  Run:
``python benchmarks/follow.py [--quick] [--engines N] [--requests N] [--rounds N]``;
``--once PATH`` runs one pass of one path for an instruction count (see
``docs/benchmarks.md``).
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
from collections import deque
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec
from _common import arg_parser, report, result
from vs_vllm import reference

from kvevents import BatchDecoder
from kvevents.consumers import BlockIndex
from kvevents.consumers.index.bulk import reads_natively
from kvevents.native import NATIVE, core_name

BS = 16
BPC = 4
POOL_BLOCKS = 2_048
"""GPU blocks per engine (tails are evicted beyond it; system prompts stay)."""


class _Engine:
    """One engine's state: which system prompts it holds, its requests' tails in LRU
    order, and its CPU chunks."""

    def __init__(self, rank: int, rng: random.Random) -> None:
        self.rank = rank
        self.rng = rng
        self.held_prompts: set[int] = set()
        self.tails: deque[list[int]] = deque()
        self.gpu_blocks = 0
        self.cpu: deque[int] = deque()


def fleet_stream(engines: int, requests: int, seed: int = 0) -> tuple[list[tuple[int, bytes]], int]:
    """``(engine, payload)`` in arrival order, and the block-events they hold."""
    ref, _ = reference(verbose=False)
    encoder = msgspec.msgpack.Encoder()
    rng = random.Random(seed)
    prompts = []  # (tokens, hashes) of each shared system prompt
    for _ in range(24):
        n = rng.randrange(512, 8193) // BS * BS
        prompts.append(
            (
                [rng.randrange(50_000) for _ in range(n)],
                [rng.getrandbits(63) for _ in range(n // BS)],
            )
        )
    fleet = [_Engine(e, random.Random(seed * 100_003 + e)) for e in range(engines)]
    out: list[tuple[int, bytes]] = []
    total = 0

    def gpu_store(hashes: list[int], parent: int | None, tokens: list[int]) -> Any:
        return ref.BlockStored(
            hashes, parent, tokens, BS, None, "GPU", None, group_idx=0,
            kv_cache_spec_kind="full_attention",
        )  # fmt: skip

    for _ in range(requests):
        for eng in fleet:
            r = eng.rng
            events: list[Any] = []
            p = r.randrange(len(prompts))
            ptoks, phashes = prompts[p]
            new_prompt = p not in eng.held_prompts
            if new_prompt:  # the system prompt, in prefill chunks of 128 blocks
                eng.held_prompts.add(p)
                for a in range(0, len(phashes), 128):
                    parent = phashes[a - 1] if a else None
                    events.append(
                        gpu_store(phashes[a : a + 128], parent, ptoks[a * BS : (a + 128) * BS])
                    )
                eng.gpu_blocks += len(phashes)
            nt = r.randrange(4, 65)
            tail = [r.getrandbits(63) for _ in range(nt)]
            events.append(
                gpu_store(tail, phashes[-1], [r.randrange(50_000) for _ in range(nt * BS)])
            )
            eng.tails.append(tail)
            eng.gpu_blocks += nt
            # offload: every chunk tail, once (a new system prompt's, then the tail's)
            base = len(phashes)
            cpu_tails = phashes[BPC - 1 :: BPC] if new_prompt else []
            cpu_tails += [h for j, h in enumerate(tail) if (base + j) % BPC == BPC - 1]
            for t in cpu_tails:
                events.append(ref.BlockStored([t], None, [], 0, None, "CPU", None, group_idx=0))
                eng.cpu.append(t)
            # evictions: the oldest tails, one removal per block
            while eng.gpu_blocks > POOL_BLOCKS and len(eng.tails) > 1:
                old = eng.tails.popleft()
                for h in reversed(old):
                    events.append(ref.BlockRemoved([h], "GPU", group_idx=0))
                eng.gpu_blocks -= len(old)
            if len(eng.cpu) > 4 * POOL_BLOCKS // BPC:
                drop = [eng.cpu.popleft() for _ in range(len(eng.cpu) - 4 * POOL_BLOCKS // BPC)]
                events.append(ref.BlockRemoved(drop, "CPU", group_idx=0))
            for ev in events:
                total += len(ev.block_hashes)
            out.append((eng.rank, encoder.encode(ref.KVEventBatch(0.0, events))))
    return out, total


def source_of(engine: int) -> str:
    return f"tcp://10.0.{engine // 250}.{engine % 250}:5557"


def run_python(stream: list[tuple[int, bytes]]) -> BlockIndex:
    index = BlockIndex(blocks_per_chunk=BPC)
    decode = BatchDecoder().decode
    apply = index.apply
    for e, p in stream:
        apply(source_of(e), 0, decode(p))
    return index


def run_native(stream: list[tuple[int, bytes]]) -> BlockIndex:
    index = BlockIndex(blocks_per_chunk=BPC)
    apply = index.apply_payload
    for e, p in stream:
        apply(source_of(e), 0, p)
    return index


def _timed(fn: Any, stream: list[tuple[int, bytes]]) -> tuple[float, Any]:
    gc.collect()
    t0 = time.perf_counter()
    out = fn(stream)
    return time.perf_counter() - t0, out


def once(path: str, stream: list[tuple[int, bytes]]) -> None:
    """One pass of one path over ``stream`` (``none``: nothing)."""
    if path == "vllm":
        decode = msgspec.msgpack.Decoder(reference(verbose=False)[0].KVEventBatch).decode
        for _, p in stream:
            decode(p)
    elif path == "python":
        run_python(stream)
    elif path == "parse" and NATIVE is not None and reads_natively():
        parse = NATIVE.parse_batch
        for _, p in stream:
            parse(p).ops()
    elif path == "native":
        run_native(stream)


def _rss() -> int:
    """This process's resident set size in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_growth(path: str, stream: list[tuple[int, bytes]]) -> tuple[int, int]:
    """RSS growth over one pass of ``path`` (``decode``: vLLM's decoder only, nothing
    kept; ``python``, ``native``: the index, kept), and the index's resident entries."""
    gc.collect()
    before = _rss()
    index = None
    if path == "decode":
        once("vllm", stream)
    else:
        index = run_python(stream) if path == "python" else run_native(stream)
    gc.collect()
    return _rss() - before, len(index) if index is not None else 0


def bench_memory(args: Any) -> list[dict[str, Any]]:
    """Bytes per resident (worker, tier, hash) entry: the RSS growth of following the
    stream minus that of only decoding it, each in a fresh process, for the Python core
    (``KVEVENTS_NATIVE=0``) and the compiled one."""
    import subprocess

    def run(path: str, native: bool) -> tuple[int, int]:
        cmd = [sys.executable, os.path.abspath(__file__), "--rss", path,
               "--engines", str(args.engines), "--requests", str(args.requests)]  # fmt: skip
        env = {**os.environ, "KVEVENTS_NATIVE": "1" if native else "0"}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        got = json.loads(out.splitlines()[-1])
        return int(got["rss"]), int(got["entries"])

    rows = []
    decode, _ = run("decode", False)
    cores = [("python", False)] + ([("native", True)] if NATIVE is not None else [])
    for path, native in cores:
        grown, entries = run(path if path == "python" else "native", native)
        label = "compiled core" if native else "Python core"
        rows.append(
            result(f"bytes per resident entry, {label} (vs goal)", (grown - decode) / entries,
                   "B", MEMORY_GOAL)
        )  # fmt: skip
    return rows


MEMORY_GOAL = 64.0
"""Bytes per resident (worker, tier, hash) entry: the goal."""


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=None, help="engines (1,000; 100 quick)")
    parser.add_argument(
        "--requests", type=int, default=None, help="requests per engine (6; 3 quick)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="alternated rounds (3; 1 quick)")
    parser.add_argument(
        "--once",
        choices=["none", "vllm", "python", "parse", "native"],
        help="build the stream, run one pass of one path, print nothing more (for "
        "valgrind --tool=callgrind: a path's count is its run's minus that of 'none')",
    )
    parser.add_argument(
        "--rss",
        choices=["decode", "python", "native"],
        help="build the stream, run one pass of one path, print its RSS growth as JSON",
    )
    args = parser.parse_args()
    args.engines = engines = args.engines or (100 if args.quick else 1000)
    args.requests = requests = args.requests or (3 if args.quick else 6)
    rounds = args.rounds or (1 if args.quick else 3)
    stream, total = fleet_stream(engines, requests)
    if args.once:
        once(args.once, stream)
        return
    if args.rss:
        grown, entries = rss_growth(args.rss, stream)
        print(json.dumps({"rss": grown, "entries": entries}))
        return
    size = sum(len(p) for _, p in stream)
    print(
        f"{engines} engines x {requests} requests: {len(stream):,} payloads, "
        f"{size / 2**20:.1f} MiB, {total:,} block-events; core: {core_name()}"
    )
    ref, label = reference(verbose=False)
    vllm_decode = msgspec.msgpack.Decoder(ref.KVEventBatch).decode

    def decode_only(s: list[tuple[int, bytes]]) -> None:
        for _, p in s:
            vllm_decode(p)

    rows: dict[str, list[float]] = {"vllm": [], "python": [], "native": []}
    native = NATIVE is not None and reads_natively()
    for _ in range(rounds):  # alternated, so the machine's drift hits every row
        rows["vllm"].append(_timed(decode_only, stream)[0])
        t_py, py_index = _timed(run_python, stream)
        rows["python"].append(t_py)
        py_stats, py_len = py_index.stats, len(py_index)
        del py_index
        if native:
            t_nat, nat_index = _timed(run_native, stream)
            rows["native"].append(t_nat)
            if nat_index.stats != py_stats or len(nat_index) != py_len:
                raise AssertionError("apply_payload and decode + apply disagree")
            if nat_index.payload_stats.fallbacks:
                raise AssertionError("a fleet payload fell back to the Python decoder")
            del nat_index
    rate = {k: total / min(v) / 1e6 for k, v in rows.items() if v}
    base = rate["vllm"]
    results = [
        result(f"{label} typed decode of the bytes (baseline)", base, "M block-events/s"),
        result("decode + BlockIndex.apply (Python)", rate["python"], "M block-events/s", base),
    ]
    if native:
        results.append(
            result("BlockIndex.apply_payload (native)", rate["native"], "M block-events/s", base)
        )
        results.append(
            result("apply_payload (native) vs decode + apply", rate["native"], "M block-events/s",
                   rate["python"])
        )  # fmt: skip
    else:
        why = core_name() if NATIVE is None else "this build lacks ParsedBatch.ops"
        print(f"apply_payload's native row skipped ({why}): pip install ./native")
    print(f"resident (worker, tier, hash) entries at the end: {py_len:,}")
    report("follow", results + bench_memory(args))


if __name__ == "__main__":
    main()
