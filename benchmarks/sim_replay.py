"""How fast the simulator makes events, and how fast a capture replays into the index.

* Simulator: events per second a ``SimEngine`` emits on the seeded chat workload with
  its CPU tier (offload manager, translator, torch byte copies), against a baseline in
  the same run: the same engine with the CPU tier off (GPU pool and hashing only).
* Replay: ``kvevents replay --into-index``'s work (capture file → ``Subscriber`` over a
  ``CaptureSource`` → ``BlockIndex.apply``) in events per second, against a baseline in
  the same run: reading and decoding the same capture (``CaptureReader`` +
  ``BatchDecoder``) without seq tracking or indexing.

``--quick`` shrinks the workload so the run takes a few seconds.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import parse_args, report, result
from kvevents.capture import CaptureReader, CaptureWriter
from kvevents.codec import BatchDecoder, encode_batch
from kvevents.events import KVEventBatch
from kvevents.sim import (
    KVCacheGroupSpec,
    SimEngine,
    SimEngineConfig,
    SimRequest,
    WorkloadConfig,
    generate_workload,
)


class _CaptureSink:
    def __init__(self, writer: CaptureWriter, source: str) -> None:
        self.writer, self.source, self.seq = writer, source, 0

    def publish(self, batch: KVEventBatch) -> None:
        self.writer.write(self.source, b"", self.seq, encode_batch(batch))
        self.seq += 1


def _engine(cpu: bool) -> SimEngineConfig:
    return SimEngineConfig(
        groups=(KVCacheGroupSpec(16),),
        num_gpu_blocks=96,
        num_cpu_chunks=128 if cpu else 0,
        blocks_per_chunk=4,
        decode_tokens_per_step=16,
    )


def simulate(
    reqs: list[SimRequest], cpu: bool, sink: Any = None, rank: int = 0
) -> tuple[int, float]:
    """Events emitted and seconds taken by one engine serving ``reqs``."""
    engine = SimEngine(_engine(cpu), sink, dp_rank=rank)
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    engine.run_until_idle()
    return engine.stats.events_published, time.perf_counter() - t0


def replay_into_index(path: Path) -> tuple[int, float]:
    from kvevents.consumers import BlockIndex, CaptureSource, ReceivedBatch, Subscriber

    index = BlockIndex(blocks_per_chunk=4)
    events = 0
    t0 = time.perf_counter()
    with Subscriber([CaptureSource(str(path))]) as sub:
        for item in sub:
            if isinstance(item, ReceivedBatch):
                index.apply(item.source, item.dp_rank, item.batch)
                events += len(item.batch.events)
    return events, time.perf_counter() - t0


def decode_only(path: Path) -> tuple[int, float]:
    dec = BatchDecoder()
    events = 0
    t0 = time.perf_counter()
    with CaptureReader(path) as reader:
        for rec in reader:
            events += len(dec.decode(rec.payload).events)
    return events, time.perf_counter() - t0


def main() -> None:
    args = parse_args(__doc__ or "")
    n_req = 120 if args.quick else 1200
    engines = 2 if args.quick else 4
    repeat = 1 if args.quick else 3
    reqs = generate_workload(WorkloadConfig(num_requests=n_req, seed=0))
    results = []

    def best(fn: Any) -> tuple[int, float]:
        runs = [fn() for _ in range(repeat)]
        return min(runs, key=lambda r: r[1])

    ev_gpu, s_gpu = best(lambda: simulate(reqs, cpu=False))
    ev_cpu, s_cpu = best(lambda: simulate(reqs, cpu=True))
    results.append(
        result("sim events/s (GPU + CPU tier)", ev_cpu / s_cpu, "events/s", ev_gpu / s_gpu)
    )

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.kvcap"
        with CaptureWriter(path, flush_every=256) as writer:
            for i in range(engines):
                part = [r for r in reqs if r.session % engines == i]
                simulate(part, True, _CaptureSink(writer, f"tcp://engine{i}:5557"))
        size = path.stat().st_size
        ev_dec, s_dec = best(lambda: decode_only(path))
        ev_idx, s_idx = best(lambda: replay_into_index(path))
        assert ev_idx == ev_dec, (ev_idx, ev_dec)
        results.append(
            result("replay --into-index events/s", ev_idx / s_idx, "events/s", ev_dec / s_dec)
        )
        print(
            f"workload: {n_req} requests; capture: {engines} engines, {ev_dec:,} events, "
            f"{size / 1e6:.1f} MB; CPU tier on"
        )
    report("sim_replay", results)


if __name__ == "__main__":
    main()
