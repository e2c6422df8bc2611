"""Simulated engines behind real ZMQ publishers, followed by a real subscriber and index."""

from __future__ import annotations

import time
from collections import Counter

import kvevents.consumers as consumers
from kvevents.sim import SimEngineConfig, WorkloadConfig, generate_workload
from kvevents.sim.cluster import ClusterConfig, SimCluster, loopback_endpoint


def test_loopback_endpoint_rewrites_wildcards_only() -> None:
    assert loopback_endpoint("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert loopback_endpoint("tcp://*:6000") == "tcp://127.0.0.1:6000"
    assert loopback_endpoint("ipc:///tmp/x") == "ipc:///tmp/x"


def test_the_index_built_from_the_wire_holds_what_each_engine_holds() -> None:
    engine = SimEngineConfig(num_gpu_blocks=64, num_cpu_chunks=24, blocks_per_chunk=4)
    with SimCluster(ClusterConfig(num_engines=2, dp_ranks=2, engine=engine)) as cluster:
        assert len({w.endpoint for w in cluster}) == 4  # one publisher per engine and rank
        sub = consumers.Subscriber(
            cluster.endpoints,
            replay_endpoints=cluster.replay_endpoints,
            options=consumers.SubscriberOptions(catch_up=True),
        )
        index = consumers.BlockIndex(blocks_per_chunk=4)
        last: dict[tuple[str, int], int] = {}
        events: Counter[tuple[str, int]] = Counter()
        anomalies: Counter[str] = Counter()

        def pump(timeout: float = 0.01) -> None:
            item = sub.receive(timeout=timeout)
            while item is not None:
                if isinstance(item, consumers.ReceivedBatch):
                    index.apply(item.source, item.dp_rank, item.batch)
                    last[item.worker] = item.seq
                    events[item.worker] += len(item.batch.events)
                else:
                    anomalies[item.kind] += 1
                item = sub.receive(timeout=0)

        def seen(wid: tuple[str, int]) -> bool:
            pump()
            return wid in last

        try:
            assert cluster.announce(seen) == []
            reqs = generate_workload(WorkloadConfig(num_requests=48, num_tenants=2, seed=4))
            for i, r in enumerate(reqs):
                cluster.workers[i % 4].engine.add_request(r)
            cluster.run_until_idle()
            targets = {w.worker_id: w.engine.stats.batches_published - 1 for w in cluster}
            deadline = time.monotonic() + 20
            while any(last.get(w, -1) < s for w, s in targets.items()):
                assert time.monotonic() < deadline, f"index lags: {last} < {targets}"
                pump(0.05)
        finally:
            sub.close()
        assert not anomalies.get("unrecoverable_loss")
        summary = index.summary()
        for w in cluster:
            assert w.dp_rank == w.worker_id[1]
            assert events[w.worker_id] == w.engine.stats.events_published
            held = summary[w.worker_id].tiers
            assert held["GPU"].entries == w.engine.pool.num_cached
            assert w.engine.offload is not None
            manager = w.engine.offload.manager
            assert held["CPU"].entries == manager.num_chunks - manager.num_free_chunks
            assert held["CPU"].entries > 0
