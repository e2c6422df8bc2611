"""Codec throughput: encode and decode of realistic batches vs the raw msgpack decode.

Workloads (one engine step each):
  gpu_stores   8 BlockStored of 4 x 16-token blocks (u64 hashes, 64 token ids, kind set)
  cpu_place    32 CPU placeholder BlockStored([H], block_size=0, token_ids=[])
  removals     32 single-hash BlockRemoved (as vLLM emits them)
  mixed        one of each kind's batch concatenated
  legacy_0.23  the mixed batch written positionally (array events) as vLLM <= 0.23 did

Baseline: ``msgspec.msgpack.decode(payload)`` of the same bytes into plain Python
objects (no validation, no classes), the ceiling the issue names.

Run: python benchmarks/codec.py [--quick]
"""

from __future__ import annotations

import random

import msgspec
from _common import best_rate, parse_args, report, result

from kvevents import BatchDecoder, BlockRemoved, BlockStored, KVEventBatch, encode_batch


def _h(rng: random.Random) -> int:
    return rng.getrandbits(64)


def build(rng: random.Random) -> dict[str, KVEventBatch]:
    gpu = [
        BlockStored(
            [_h(rng) for _ in range(4)],
            _h(rng),
            [rng.randrange(150_000) for _ in range(64)],
            16,
            None,
            "GPU",
            None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        for _ in range(8)
    ]
    cpu = [BlockStored([_h(rng)], None, [], 0, None, "CPU", None, group_idx=0) for _ in range(32)]
    rem = [BlockRemoved([_h(rng)], "GPU", group_idx=0) for _ in range(32)]
    ts = 1_700_000_000.0
    return {
        "gpu_stores": KVEventBatch(ts, gpu, 0),
        "cpu_place": KVEventBatch(ts, cpu, 0),
        "removals": KVEventBatch(ts, rem, 0),
        "mixed": KVEventBatch(ts, gpu + cpu + rem, 0),
    }


def legacy_payload(batch: KVEventBatch) -> bytes:
    """The batch as a vLLM 0.23 producer wrote it: 12-element BlockStored, 4-element BlockRemoved."""
    events = []
    for e in batch.events:
        names = e.__struct_fields__[: 11 if isinstance(e, BlockStored) else 3]
        events.append([type(e).__name__, *(getattr(e, n) for n in names)])
    return msgspec.msgpack.encode([batch.ts, events, batch.data_parallel_rank])


def main() -> None:
    args = parse_args(__doc__ or "")
    repeat, min_time = (2, 0.05) if args.quick else (5, 0.4)
    batches = build(random.Random(0))
    payloads = {name: encode_batch(b) for name, b in batches.items()}
    payloads["legacy_0.23"] = legacy_payload(batches["mixed"])
    n_events = {name: len(b.events) for name, b in batches.items()}
    n_events["legacy_0.23"] = n_events["mixed"]
    results = []
    raw_decode = msgspec.msgpack.decode
    for name, payload in payloads.items():
        n = n_events[name]
        dec = BatchDecoder()

        def ours(p: bytes = payload, n: int = n, d: BatchDecoder = dec) -> int:
            for _ in range(50):
                d.decode(p)
            return 50 * n

        def raw(p: bytes = payload, n: int = n) -> int:
            for _ in range(50):
                raw_decode(p)
            return 50 * n

        r_raw = best_rate(raw, repeat=repeat, min_time=min_time)
        r_ours = best_rate(ours, repeat=repeat, min_time=min_time)
        mb = len(payload) / n / 1e6
        results.append(result(f"decode {name} events/s", r_ours, "events/s", r_raw))
        results.append(result(f"decode {name} MB/s", r_ours * mb, "MB/s", r_raw * mb))
        assert dec.stats.tolerant_batches == 0, "benchmark payload took the slow path"
        if name in batches:
            b = batches[name]

            def encode(b: KVEventBatch = b, n: int = n) -> int:
                for _ in range(50):
                    encode_batch(b)
                return 50 * n

            r_enc = best_rate(encode, repeat=repeat, min_time=min_time)
            results.append(result(f"encode {name} events/s", r_enc, "events/s"))
            results.append(result(f"encode {name} MB/s", r_enc * mb, "MB/s"))
    report("codec", results)


if __name__ == "__main__":
    main()
