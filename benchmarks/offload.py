"""CPU offload tier: manager operations per second and block-transfer throughput.

Manager (per policy, events enabled and drained every 64 operations):
  lookup          ``lookup`` of one key, half hits / half misses, on a full cache
  store+evict     ``prepare_store`` + ``complete_store`` of one new key on a full cache
                  (each call evicts one chunk); ops/s
  store+evict x16 the same with 16 new keys per call; keys/s
Baseline: a bare ``OrderedDict`` LRU (membership test; insert + ``popitem``) doing the same
logical operation, without ref counts, pin/pending states, policies or events.

Transfer (torch, on CUDA when present, else CPU): batched copies of ``N`` scattered
device blocks of several layers into scattered host chunks (store) and back (load),
``blocks_per_chunk = 2``, in GB/s.  Baseline: one contiguous ``torch`` copy of the same
number of bytes between the same two devices, measured in the same run.

Run: python benchmarks/offload.py [--quick]
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from _common import best_rate, parse_args, report, result

from kvevents.publishers.offload import CPUOffloadingManager, OffloadKey, make_offload_key


def keys(n: int, start: int = 0) -> list[OffloadKey]:
    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + n)]


def bench_manager(policy: str, capacity: int, quick: bool) -> list[dict[str, object]]:
    m = CPUOffloadingManager(capacity, cache_policy=policy, enable_events=True)
    resident = keys(capacity)
    for i in range(0, capacity, 256):
        batch = resident[i : i + 256]
        m.prepare_store(batch)
        m.complete_store(batch)
    m.take_events()
    probe = [k for pair in zip(resident, keys(capacity, 10**9)) for k in pair]
    pos = [0]

    def lookups() -> int:
        n = min(4096, len(probe) // 2)
        i = pos[0]
        for k in probe[i : i + n]:
            m.lookup(k)
        pos[0] = (i + n) % (len(probe) - n)
        return n

    fresh = [capacity * 10]

    def stores(batch: int) -> Callable[[], int]:
        def run() -> int:
            ops = 64
            for _ in range(ops):
                ks = keys(batch, fresh[0])
                fresh[0] += batch
                out = m.prepare_store(ks)
                assert out is not None and len(out.evicted_keys) == batch
                m.complete_store(ks)
            m.take_events()
            return ops * batch

        return run

    repeat, min_time = (2, 0.05) if quick else (5, 0.3)
    # baseline: bare OrderedDict LRU
    od: OrderedDict[bytes, int] = OrderedDict((k, i) for i, k in enumerate(resident))
    bpos = [0]
    bfresh = [capacity * 10]

    def base_lookups() -> int:
        n = min(4096, len(probe) // 2)
        i = bpos[0]
        for k in probe[i : i + n]:
            if k in od:
                od.move_to_end(k)
        bpos[0] = (i + n) % (len(probe) - n)
        return n

    def base_stores(batch: int) -> Callable[[], int]:
        def run() -> int:
            ops = 64
            for _ in range(ops):
                for k in keys(batch, bfresh[0]):
                    od.popitem(last=False)
                    od[k] = 0
                bfresh[0] += batch
            return ops * batch

        return run

    out = []
    for name, fn, base, unit in (
        ("lookup", lookups, base_lookups, "ops/s"),
        ("store+evict", stores(1), base_stores(1), "ops/s"),
        ("store+evict x16", stores(16), base_stores(16), "keys/s"),
    ):
        value = best_rate(fn, repeat=repeat, min_time=min_time)
        baseline = best_rate(base, repeat=repeat, min_time=min_time)
        out.append(result(f"manager {policy} {name}", value, unit, baseline))
    return out


def bench_transfer(quick: bool) -> list[dict[str, object]]:
    import numpy as np
    import torch

    from kvevents.publishers.offload import CPULoadStoreSpec
    from kvevents.publishers.offload.transfer import CPUTransferWorker

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Per layer and block: 16 tokens x 2 (K, V) x 8 heads x 128 dims x fp16 = 64 KiB.
    layers, num_blocks, bpc = (2, 128, 2) if quick else (4, 1024, 2)
    moved = num_blocks // 2  # blocks per transfer
    kv = [
        torch.randn((num_blocks, 2, 16, 8, 128), device=device).to(torch.float16)
        for _ in range(layers)
    ]
    num_chunks = moved // bpc
    worker = CPUTransferWorker(kv, num_chunks, bpc)
    rng = np.random.default_rng(0)
    src = rng.permutation(num_blocks)[:moved].tolist()
    chunks = CPULoadStoreSpec(rng.permutation(num_chunks))
    nbytes = moved * worker.buffers.bytes_per_block
    pinned = worker.buffers.pinned

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn: Callable[[], None], base: Callable[[], None], reps: int) -> tuple[float, float]:
        """Best GB/s of ``fn`` and of ``base``, timed alternately so drift hits both."""
        best = [float("inf"), float("inf")]
        fn()  # warm-up
        base()
        sync()
        for _ in range(reps):
            for i, f in enumerate((fn, base)):
                t0 = time.perf_counter()
                f()
                sync()
                best[i] = min(best[i], time.perf_counter() - t0)
        return nbytes / best[0] / 1e9, nbytes / best[1] / 1e9

    job = [0]

    def store_into(spec: CPULoadStoreSpec) -> Callable[[], None]:
        def run() -> None:
            worker.submit_store(job[0], src, spec)
            job[0] += 1
            worker.wait()
            worker.get_finished()

        return run

    def load() -> None:
        worker.submit_load(job[0], chunks, src)
        job[0] += 1
        worker.wait()
        worker.get_finished()

    # Real, touched memory on both sides (untouched pages would flatter the baseline).
    dev_flat = torch.randint(-128, 127, (nbytes,), dtype=torch.int8, device=device)
    host_flat = torch.ones(nbytes, dtype=torch.int8, pin_memory=pinned)

    def copy_d2h() -> None:
        host_flat.copy_(dev_flat, non_blocking=pinned)

    def copy_h2d() -> None:
        dev_flat.copy_(host_flat, non_blocking=pinned)

    reps = 5 if quick else 20
    consecutive = CPULoadStoreSpec(np.arange(num_chunks))
    store_gbs, base_store = timed(store_into(chunks), copy_d2h, reps)
    store_seq_gbs, base_store_seq = timed(store_into(consecutive), copy_d2h, reps)
    load_gbs, base_load = timed(load, copy_h2d, reps)
    label = f"{device}, {layers} layers x {moved} blocks x 64 KiB, bpc {bpc}"
    return [
        result(f"transfer store, scattered chunks ({label})", store_gbs, "GB/s", base_store),
        result(
            f"transfer store, consecutive chunks ({label})",
            store_seq_gbs,
            "GB/s",
            base_store_seq,
        ),
        result(f"transfer load, scattered chunks ({label})", load_gbs, "GB/s", base_load),
    ]


def main() -> None:
    args = parse_args(__doc__ or "")
    capacity = 2048 if args.quick else 16384
    results: list[dict[str, object]] = []
    for policy in ("lru", "arc"):
        results += bench_manager(policy, capacity, args.quick)
    results += bench_transfer(args.quick)
    report("offload", results)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
