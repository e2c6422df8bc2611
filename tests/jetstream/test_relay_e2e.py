"""Engines (simulated, real ZMQ) → relay → JetStream (real nats-server) → routers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvevents.consumers import Anomaly, BlockIndex, Subscriber
from kvevents.consumers.zmq_source import ZmqSource
from kvevents.engines import EngineSpec
from kvevents.jetstream import JetStreamRelay, JetStreamSubscriber, LocalNatsServer
from kvevents.sim import SimEngineConfig, WorkloadConfig, generate_workload
from kvevents.sim.cluster import ClusterConfig, SimCluster


def wait_until(pred: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def holdings(index: BlockIndex) -> dict[tuple[str, int], dict[str, tuple[int, int]]]:
    return {
        wid: {t: (s.entries, s.tokens) for t, s in ws.tiers.items()}
        for wid, ws in index.summary().items()
    }


def engine_specs(cluster: SimCluster) -> list[EngineSpec]:
    out = []
    for i, w in enumerate(cluster):
        out.append(
            EngineSpec(
                f"sim-{i}",
                events_endpoint=w.publisher.endpoint.replace("0.0.0.0", "127.0.0.1").replace(
                    "*", "127.0.0.1"
                ),
                replay_endpoint=w.publisher.replay_endpoint.replace("0.0.0.0", "127.0.0.1").replace(
                    "*", "127.0.0.1"
                ),
            )
        )
    return out


def drive(cluster: SimCluster, n_requests: int, seed: int) -> None:
    reqs = generate_workload(WorkloadConfig(num_requests=n_requests, seed=seed))
    workers = list(cluster)
    for i, r in enumerate(reqs):
        workers[i % len(workers)].engine.add_request(r)
    cluster.run_until_idle()


def consume(
    sub: Iterable[Any], expect_batches: int, timeout: float = 20.0
) -> tuple[BlockIndex, list[Anomaly]]:
    """Apply ``expect_batches`` batches from ``sub`` to a fresh index, handling anomalies."""
    index = BlockIndex()
    anomalies: list[Anomaly] = []
    applied = 0
    deadline = time.monotonic() + timeout
    while applied < expect_batches and time.monotonic() < deadline:
        item = sub.receive(timeout=0.5)  # type: ignore[attr-defined]
        if item is None:
            continue
        if isinstance(item, Anomaly):
            anomalies.append(item)
            if item.needs_reset and item.dp_rank is not None:
                index.reset_worker((item.source, item.dp_rank))
            continue
        index.apply(item.source, item.dp_rank, item.batch)
        applied += 1
    assert applied == expect_batches, (applied, expect_batches)
    return index, anomalies


def direct_index(specs: list[EngineSpec], expect_batches: int) -> BlockIndex:
    """The truth: an index fed straight from the engines' sockets (replayed from seq 0)."""
    sources = [
        ZmqSource(s.events_endpoint or "", b"", s.replay_endpoint, name=s.name) for s in specs
    ]
    with Subscriber(sources) as sub:
        index, anomalies = consume(sub, expect_batches)
    assert not [a for a in anomalies if a.needs_reset]
    return index


def test_relay_to_two_routers_matches_the_engines(nats_server: LocalNatsServer) -> None:
    cfg = ClusterConfig(num_engines=2, engine=SimEngineConfig())
    with SimCluster(cfg) as cluster:
        specs = engine_specs(cluster)
        relay = JetStreamRelay(nats_server.url, specs)
        stop = threading.Event()
        t = threading.Thread(target=relay.run, args=(stop,), daemon=True)
        t.start()
        try:
            drive(cluster, 40, seed=1)
            published = sum(w.engine.stats.batches_published for w in cluster)
            assert wait_until(lambda: relay.stats.appended >= published), relay.stats
            direct = direct_index(specs, published)
        finally:
            stop.set()
            t.join(10)
            relay.close()
        with JetStreamSubscriber(nats_server.url) as sa:
            a, anomalies_a = consume(sa, published)
        with JetStreamSubscriber(nats_server.url) as sb:
            b, anomalies_b = consume(sb, published)
        assert holdings(a) == holdings(b) == holdings(direct)
        assert a.resident_count > 0
        assert [x.kind for x in anomalies_a] == [x.kind for x in anomalies_b]
        assert not [x for x in anomalies_a if x.needs_reset]
