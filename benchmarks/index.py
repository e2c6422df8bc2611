"""BlockIndex and Router: apply throughput, find_matches latency, bytes per entry.

* ``apply``: block-events/s (hashes in stores and removals) on one core for a realistic
  engine stream (prefills of 256 tokens that half the time continue a shared 128-token
  prefix, CPU placeholders every 4 blocks, GPU removals one hash per event, CPU
  removals), with pre-decoded batches (decode excluded) and from msgpack bytes (decode
  included).  Baselines: a plain per-worker ``set`` of hashes fed the same events (no
  join, no content keys), and decoding alone.
* ``find_matches``: p50/p99 latency for 1k/8k/32k-token prompts over 10/100/1,000
  workers, each holding a random-length prefix of the prompt on GPU and the next chunks
  on CPU.  Baseline: a naive per-worker walk over the prompt's content keys (GPU only,
  key computation included).
* ``select``: ``Router.select`` p50 for an 8k-token prompt over 1,000 workers (all or 1%
  hold it), without loads and with a load for every worker.  Baseline: ``find_matches``
  on the same prompt, sampled alternately with it.
* ``find_matches`` with request keys: the same fleet shape (100 workers, 8k-token
  prompt, GPU prefix and CPU chunks) stored by LoRA requests (the adapter name in every
  block's extra keys) and by requests with two images (``(identifier, offset)`` extra
  keys on the blocks they overlap), queried with the matching request key.  Baseline:
  the plain-token fleet queried with plain tokens, in the same run.  Also the same
  fleet on a hybrid model (a full-attention and a 1,024-token sliding-window group, the
  window group dropping a different random tail), whose workers the router looks up one
  by one with vLLM's hybrid rules; baseline: the single-group fleet.
* ``bytes per entry``: tracemalloc'd index memory per resident (block, worker, tier)
  entry (400 GPU blocks and 50 CPU chunks per worker, fed as decoded wire batches), for
  workers sharing prefixes and for workers with unique content.

Run: ``python benchmarks/index.py [--quick]``.
"""

from __future__ import annotations

import gc
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import best_rate, parse_args, report, result

from kvevents.codec import BatchDecoder, encode_batch
from kvevents.consumers.content import prompt_keys
from kvevents.consumers.index import BlockIndex
from kvevents.consumers.router import Router
from kvevents.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvevents.request import MMFeature, RequestKey, block_extra_keys

BS = 16
BPC = 4


def _gpu(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, None, "GPU", None, group_idx=0,
                       kv_cache_spec_kind="full_attention")  # fmt: skip


def engine_stream(requests: int, seed: int) -> list[KVEventBatch]:
    """One engine's batches: each request stores, offloads and later drops its blocks."""
    rng = random.Random(seed)
    shared_tokens = [rng.randrange(50_000) for _ in range(128)]
    shared_hashes = [rng.getrandbits(64) for _ in range(8)]
    batches = [KVEventBatch(0.0, [_gpu(shared_hashes, None, shared_tokens)])]
    for _ in range(requests):
        events: list[KVEvent] = []
        if rng.random() < 0.5:
            hashes = [rng.getrandbits(64) for _ in range(8)]
            tokens = [rng.randrange(50_000) for _ in range(128)]
            events.append(_gpu(hashes, shared_hashes[-1], tokens))
            all_hashes = shared_hashes + hashes
        else:
            hashes = [rng.getrandbits(64) for _ in range(16)]
            tokens = [rng.randrange(50_000) for _ in range(256)]
            events.append(_gpu(hashes, None, tokens))
            all_hashes = hashes
        tails = all_hashes[BPC - 1 :: BPC]
        events += [BlockStored([t], None, [], 0, None, "CPU", None, group_idx=0) for t in tails]
        events += [BlockRemoved([h], "GPU", group_idx=0) for h in hashes]
        events.append(BlockRemoved(tails, "CPU", group_idx=0))
        batches.append(KVEventBatch(0.0, events))
    return batches


def block_events(batches: list[KVEventBatch]) -> int:
    n = 0
    for b in batches:
        for e in b.events:
            n += len(getattr(e, "block_hashes", ()))
    return n


def bench_apply(quick: bool) -> list[dict[str, Any]]:
    engines = 4
    streams = [engine_stream(60 if quick else 600, seed) for seed in range(engines)]
    payloads = [[encode_batch(b) for b in s] for s in streams]
    total = sum(block_events(s) for s in streams)
    kw: dict[str, Any] = {"repeat": 1 if quick else 5, "min_time": 0.05 if quick else 0.5}

    def run_index() -> int:
        index = BlockIndex(blocks_per_chunk=BPC)
        for e, s in enumerate(streams):
            for b in s:
                index.apply("engine", e, b)
        return total

    def run_sets() -> int:
        held: dict[tuple[int, str], set[Any]] = {}
        for e, s in enumerate(streams):
            for b in s:
                for ev in b.events:
                    key = (e, ev.medium)  # type: ignore[union-attr]
                    tier = held.setdefault(key, set())
                    if isinstance(ev, BlockStored):
                        tier.update(ev.block_hashes)
                    elif isinstance(ev, BlockRemoved):
                        tier.difference_update(ev.block_hashes)
        return total

    decoder = BatchDecoder()

    def run_decode_index() -> int:
        index = BlockIndex(blocks_per_chunk=BPC)
        for e, ps in enumerate(payloads):
            for p in ps:
                index.apply("engine", e, decoder.decode(p))
        return total

    def run_decode() -> int:
        for ps in payloads:
            for p in ps:
                decoder.decode(p)
        return total

    gc.collect()
    idx_rate = best_rate(run_index, **kw)
    set_rate = best_rate(run_sets, **kw)
    dec_idx_rate = best_rate(run_decode_index, **kw)
    dec_rate = best_rate(run_decode, **kw)
    return [
        result("apply, decode excluded (vs set-of-hashes)", idx_rate, "block-events/s", set_rate),
        result(
            "apply, decode included (vs decode alone)", dec_idx_rate, "block-events/s", dec_rate
        ),
    ]


def populate(
    workers: int, prompt: list[int], rng: random.Random, every: int, index: BlockIndex | None = None
) -> BlockIndex:
    """Every ``every``-th worker holds a random GPU prefix of ``prompt`` and the next
    chunks on CPU; the others hold the same amount of another prompt's blocks.  Fills
    ``index`` when given (an empty one, built with ``blocks_per_chunk=BPC``)."""
    if index is None:
        index = BlockIndex(blocks_per_chunk=BPC)
    nblocks = len(prompt) // BS
    other = [rng.randrange(50_000) for _ in range(len(prompt))]
    own_hashes = [rng.getrandbits(64) for _ in range(nblocks)]  # one engine hash family
    other_hashes = [rng.getrandbits(64) for _ in range(nblocks)]
    for w in range(workers):
        if w % every == 0:
            tokens, hashes = prompt, own_hashes
        else:
            tokens, hashes = other, other_hashes
        held = rng.randrange(nblocks + 1)
        gpu = rng.randrange(held + 1)
        if held:
            index.apply_event(("w", w), _gpu(hashes[:held], None, tokens[: held * BS]))
        for c in range(held // BPC):
            index.apply_event(
                ("w", w),
                BlockStored([hashes[(c + 1) * BPC - 1]], None, [], 0, None, "CPU", None,
                            group_idx=0),
            )  # fmt: skip
        for h in hashes[gpu:held]:
            index.apply_event(("w", w), BlockRemoved([h], "GPU", group_idx=0))
    return index


def naive_matches(index: BlockIndex, tokens: list[int]) -> dict[Any, int]:
    """The per-worker walk the bitset design avoids: each worker walks the keys alone."""
    held_by: dict[Any, set[int]] = {}
    for w in index.workers():
        held_by[w] = index.held_keys(w, 0)
    start = time.perf_counter()
    keys = prompt_keys(tokens, index.canonical_block_size)
    out = {}
    for w, held in held_by.items():
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        if n:
            out[w] = n * BS
    naive_matches.elapsed = time.perf_counter() - start  # type: ignore[attr-defined]
    return out


def bench_find(quick: bool) -> list[dict[str, Any]]:
    rng = random.Random(7)
    sizes = [1024, 8192] if quick else [1024, 8192, 32768]
    fleets = [10, 100] if quick else [10, 100, 1000]
    out = []
    for n in sizes:
        prompt = [rng.randrange(50_000) for _ in range(n)]
        for workers in fleets:
            for every, label in ((1, "all hold it"), (100, "1% hold it")):
                if quick and n * workers > 8192 * 10:
                    continue
                index = populate(workers, prompt, rng, every)
                router = Router(index)
                router.find_matches(prompt)  # build the layout
                gc.collect()
                samples = []
                reps = 20 if quick else (200 if n <= 8192 else 60)
                for _ in range(reps):
                    t0 = time.perf_counter()
                    router.find_matches(prompt)
                    samples.append(time.perf_counter() - t0)
                samples.sort()
                naive = []
                for _ in range(3 if quick else 10):
                    naive_matches(index, prompt)
                    naive.append(naive_matches.elapsed)  # type: ignore[attr-defined]
                p50 = samples[len(samples) // 2] * 1e3
                p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e3
                base = sorted(naive)[len(naive) // 2] * 1e3
                name = f"find_matches {n // 1024}k tok x {workers} w, {label}"
                out.append(result(name + " p50", p50, "ms", base))
                out.append(result(name + " p99", p99, "ms"))
                del index, router
                gc.collect()
    return out


def bench_select(quick: bool) -> list[dict[str, Any]]:
    """``Router.select`` (no loads, and a load for every worker) vs ``find_matches`` on the
    same prompt and fleet, sampled alternately call by call."""
    rng = random.Random(11)
    n, workers = (8192, 100) if quick else (8192, 1000)
    prompt = [rng.randrange(50_000) for _ in range(n)]
    reps = 30 if quick else 300
    out = []
    for every, label in ((1, "all hold it"), (100, "1% hold it")):
        index = populate(workers, prompt, rng, every)
        router = Router(index)
        loads = {wid: float(rng.randrange(8)) for wid in index.workers()}
        calls: dict[str, Callable[[], object]] = {
            "find": partial(router.find_matches, prompt),
            "select": partial(router.select, prompt),
            "select_loads": partial(router.select, prompt, loads),
        }
        for call in calls.values():
            call()  # build the layout and the router's worker cache
        gc.collect()
        samples: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(reps):
            for k, call in calls.items():
                t0 = time.perf_counter()
                call()
                samples[k].append(time.perf_counter() - t0)
        p50 = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in samples.items()}
        name = f"{n // 1024}k tok x {workers} w, {label}"
        out.append(result(f"select {name} p50", p50["select"], "ms", p50["find"]))
        out.append(result(f"select with loads {name} p50", p50["select_loads"], "ms", p50["find"]))
        del index, router, calls
        gc.collect()
    return out


def populate_keyed(
    workers: int, key: RequestKey, rng: random.Random, window: int = 0
) -> BlockIndex:
    """``workers`` workers each hold a random GPU prefix of ``key`` and the next chunks on
    CPU, stored with the request's extra keys as vLLM's BlockPool emits them; with a
    ``window``, a second (sliding-window) group holds them too and drops its own tail."""
    index = BlockIndex(blocks_per_chunk=BPC)
    nblocks = len(key.tokens) // BS
    hashes = [rng.getrandbits(64) for _ in range(nblocks)]
    extras = [block_extra_keys(key, i * BS, (i + 1) * BS) for i in range(nblocks)]
    groups = [(0, "full_attention", None)] + ([(1, "sliding_window", window)] if window else [])
    for w in range(workers):
        held = rng.randrange(nblocks + 1)
        for g, kind, win in groups:
            gpu = rng.randrange(held + 1)
            if held:
                ex = extras[:held]
                index.apply_event(
                    ("w", w),
                    BlockStored(hashes[:held], None, list(key.tokens[: held * BS]), BS, None,
                                "GPU", key.lora_name, extra_keys=ex if any(ex) else None,
                                group_idx=g, kv_cache_spec_kind=kind,
                                kv_cache_spec_sliding_window=win),
                )  # fmt: skip
            for c in range(held // BPC):
                index.apply_event(
                    ("w", w),
                    BlockStored([hashes[(c + 1) * BPC - 1]], None, [], 0, None, "CPU", None,
                                group_idx=g),
                )  # fmt: skip
            for h in hashes[gpu:held]:
                index.apply_event(("w", w), BlockRemoved([h], "GPU", group_idx=g))
    return index


def bench_request_keys(quick: bool) -> list[dict[str, Any]]:
    """find_matches with LoRA and multimodal request keys vs plain tokens, same fleet."""
    rng = random.Random(11)
    n = 8192
    workers = 100
    prompt = [rng.randrange(50_000) for _ in range(n)]
    images = [MMFeature("image-a", 100, 576), MMFeature("image-b", 3000, 576)]
    cases = [
        ("plain tokens", RequestKey(prompt)),
        ("LoRA request", RequestKey(prompt, lora_name="adapter-7")),
        ("2-image request", RequestKey(prompt, mm_features=images)),
    ]
    reps = 20 if quick else 400
    rounds = 1 if quick else 5
    hybrid = "hybrid full + sliding window"
    times: dict[str, list[float]] = {label: [] for label, _ in cases}
    times[hybrid] = []
    routers = []
    for label, key in cases:
        index = populate_keyed(workers, key, random.Random(5))
        router = Router(index)
        query: Any = key.tokens if label == "plain tokens" else key
        assert router.find_matches(query), label  # every fleet holds something
        routers.append((label, router, query, reps))
    hrouter = Router(populate_keyed(workers, cases[0][1], random.Random(5), window=1024))
    assert hrouter.find_matches(prompt)
    routers.append((hybrid, hrouter, prompt, reps // 4))  # (slow in pure Python)
    gc.collect()
    for _ in range(rounds):  # interleaved, so drift hits every case alike
        for label, router, query, n_reps in routers:
            for _ in range(n_reps):
                t0 = time.perf_counter()
                router.find_matches(query)
                times[label].append(time.perf_counter() - t0)
    p50 = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    base = p50["plain tokens"]
    out = [result(f"find_matches 8k tok x {workers} w, plain tokens p50", base, "ms")]
    for label in ("LoRA request", "2-image request", hybrid):
        out.append(
            result(f"find_matches 8k tok x {workers} w, {label} p50", p50[label], "ms", base)
        )
    return out


def bench_memory(quick: bool) -> list[dict[str, Any]]:
    out = []
    workers = 20 if quick else 100
    per_worker = 40 if quick else 400  # blocks per worker
    for label, shared in (("shared prefixes", True), ("unique content", False)):
        rng = random.Random(3)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        index = BlockIndex(blocks_per_chunk=BPC)
        decoder = BatchDecoder()
        docs = [[rng.randrange(50_000) for _ in range(per_worker * BS)] for _ in range(4)]
        doc_hashes = [[rng.getrandbits(64) for _ in range(per_worker)] for _ in range(4)]
        for w in range(workers):
            if shared:
                d = w % 4
                toks, hs = docs[d], doc_hashes[d]
            else:
                toks = [rng.randrange(50_000) for _ in range(per_worker * BS)]
                hs = [rng.getrandbits(64) for _ in range(per_worker)]
            events: list[KVEvent] = [_gpu(hs, None, toks)]
            events += [
                BlockStored([hs[(c + 1) * BPC - 1]], None, [], 0, None, "CPU", None, group_idx=0)
                for c in range(per_worker // BPC // 2)
            ]
            # through wire bytes, as from a subscriber: each worker's hashes are its own ints
            index.apply("w", w, decoder.decode(encode_batch(KVEventBatch(0.0, events))))
            del events
        del docs, doc_hashes, toks, hs
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        # the compiled core's tables are not Python allocations: tracemalloc misses them
        used += index.native_nbytes
        entries = sum(t.entries for s in index.summary().values() for t in s.tiers.values())
        out.append(result(f"bytes per (block, worker, tier), {label}", used / entries, "B"))
        del index
    return out


def bench_content_keys(quick: bool) -> list[dict[str, Any]]:
    """The stable content key (xxh3-64 chained by seed over packed int64 token ids)
    against the process-local scheme it replaced (CPython's tuple hash over unit tuples),
    for an 8k-token prompt at 16-token units."""
    from kvevents.consumers.content import prompt_keys

    rng = random.Random(5)
    tokens = [rng.randrange(150_000) for _ in range(8192)]

    def tuple_hash_keys() -> list[int]:
        k, out = 0, []
        for unit in zip(*[iter(tokens)] * 16):
            k = hash((k, unit))
            out.append(k)
        return out

    reps = 50 if quick else 400

    def best(fn: Any) -> float:
        b = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            b = min(b, time.perf_counter() - t)
        return b * 1e3

    old = best(tuple_hash_keys)
    new = best(lambda: prompt_keys(tokens, 16))
    return [result("content keys of an 8k-token prompt (xxh3 vs tuple hash)", new, "ms", old)]


def main() -> None:
    args = parse_args(__doc__ or "")
    results = (
        bench_apply(args.quick)
        + bench_find(args.quick)
        + bench_select(args.quick)
        + bench_request_keys(args.quick)
        + bench_content_keys(args.quick)
        + bench_memory(args.quick)
    )
    report("index", results)


if __name__ == "__main__":
    main()
