"""Shared fixtures: captures made by the simulator (no transport involved)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvevents.capture import CaptureWriter
from kvevents.codec import encode_batch
from kvevents.events import KVEventBatch
from kvevents.sim import SimEngine, SimEngineConfig, WorkloadConfig, generate_workload


class CaptureSink:
    """Writes each published batch to a capture as a publisher would send it: seq from
    0, the rank stamped on the batch, the encoded payload."""

    def __init__(self, writer: CaptureWriter, source: str, rank: int = 0) -> None:
        self.writer = writer
        self.source = source
        self.rank = rank
        self.seq = 0
        self.payloads: list[bytes] = []

    def publish(self, batch: KVEventBatch) -> None:
        payload = encode_batch(KVEventBatch(batch.ts, batch.events, self.rank))
        self.writer.write(self.source, b"kv", self.seq, payload, recv_ts=time.time())
        self.payloads.append(payload)
        self.seq += 1


def make_sim_capture(
    path: Path, *, requests: int = 30, blocks: int = 48, seed: int = 0
) -> list[bytes]:
    """Run one GPU-only engine over a small workload into ``path``; returns the payloads."""
    reqs = generate_workload(
        WorkloadConfig(num_requests=requests, num_tenants=2, concurrent_sessions=4, seed=seed)
    )
    with CaptureWriter(path, meta={"made_by": "test"}) as writer:
        sink = CaptureSink(writer, "tcp://engine-a:5557")
        engine = SimEngine(SimEngineConfig(num_gpu_blocks=blocks), sink)
        for r in reqs:
            engine.add_request(r)
        engine.run_until_idle()
    return sink.payloads


@pytest.fixture
def sim_capture(tmp_path: Path) -> tuple[Path, list[bytes]]:
    path = tmp_path / "sim.kvcap"
    return path, make_sim_capture(path)
