"""``kvevents serve`` knows every engine rank's worker from its spec, before any event:
``/workers`` lists each rank with its index worker and ``/route`` ranks them all; a
batch whose data-parallel rank or topic is not what the spec gives the stream it came on
is counted and reported (``/workers``, ``/metrics``, the log) and never indexed, while
a batch that matches is indexed from the first one.

Real processes: the service and a simulated engine are ``kvevents`` subprocesses; the
data-parallel engine's three ranks are vLLM-compatible publishers
(:class:`~kvevents.publishers.ZmqEventPublisher`) on real loopback sockets, the stream
of rank r on port base + r as vLLM lays them out.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
import httpx
import zmq
from _ports import free_port_block

from kvevents.errors import KVEventsError
from kvevents.events import BlockStored, KVEventBatch
from kvevents.publishers import ZmqEventPublisher

from ._procs import Proc, serve, sim_engines, spec_parts, wait_until

DP = 3
WIRE = [(1, "kv"), (1, "kv@b"), (2, "kv")]
"""What the publisher at rank r's endpoint sends: ``(data_parallel_rank, topic)``.  The
spec says rank r, topic ``kv``: rank 0's stream carries another rank (an engine started
as rank 1), rank 1's a longer topic sharing the prefix the socket subscribes to, and
rank 2's is what the spec gives it."""


def _publishers() -> tuple[int, list[ZmqEventPublisher]]:
    """``(base port, one publisher per rank)``, retried when a port is taken meanwhile."""
    for _ in range(20):
        base = free_port_block(DP)
        pubs: list[ZmqEventPublisher] = []
        try:
            for r, (rank, topic) in enumerate(WIRE):
                # a publisher of rank k binds its endpoint's port + k (vLLM's offset)
                pubs.append(
                    ZmqEventPublisher(
                        data_parallel_rank=rank,
                        endpoint=f"tcp://127.0.0.1:{base + r - rank}",
                        topic=topic,
                        bind=True,
                    )
                )
        except BaseException as exc:
            for p in pubs:
                p.shutdown()
            if isinstance(exc, KVEventsError | zmq.ZMQError):
                continue  # a port was taken in between
            raise
        assert [p.endpoint for p in pubs] == [f"tcp://127.0.0.1:{base + r}" for r in range(DP)]
        return base, pubs
    raise AssertionError("no free ports for the publishers")


@pytest.fixture()
def rig() -> Iterator[tuple[str, Proc, list[ZmqEventPublisher]]]:
    procs: list[Proc] = []
    base, pubs = _publishers()
    try:
        sim, specs = sim_engines(1)
        procs.append(sim)
        _, http, _, _ = spec_parts(specs[0])
        svc, url = serve([specs[0], f"dp={http},tcp://127.0.0.1:{base};dp={DP};topic=kv"])
        procs.append(svc)
        yield url, svc, pubs
    finally:
        for p in reversed(procs):
            p.stop()
        for pub in pubs:
            pub.shutdown()


def _batch(r: int, i: int) -> KVEventBatch:
    """Batch ``i`` of the publisher at rank ``r``'s endpoint: one block of its own."""
    h = 100 * r + i + 1
    stored = BlockStored(
        block_hashes=[h],
        parent_block_hash=None,
        token_ids=list(range(16 * h, 16 * h + 16)),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return KVEventBatch(ts=time.time(), events=[stored], data_parallel_rank=None)


def _workers(url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(url + "/workers", timeout=10).json()
    return body


def _by_rank(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {w["worker"]: w for w in body["workers"]}


def test_every_rank_is_known_from_the_spec_and_unexpected_batches_are_counted(
    rig: tuple[str, Proc, list[ZmqEventPublisher]],
) -> None:
    url, svc, pubs = rig
    wait_until(lambda: httpx.get(url + "/readyz", timeout=5).status_code == 200, 60, "/readyz")

    # before any event: every rank of the spec, with the worker its batches will name
    before = _by_rank(_workers(url))
    assert {k: w["index_worker"] for k, w in before.items()} == {
        "sim-0:0": ["sim-0", 0],
        "dp:0": ["dp#kv", 0],
        "dp:1": ["dp@dp1#kv", 1],
        "dp:2": ["dp@dp2#kv", 2],
    }
    assert all(w["batches"] == 0 and w["unexpected_batches"] == {} for w in before.values())
    body = {"model": "m", "prompt_token_ids": list(range(48))}
    ranked = httpx.post(url + "/route", json=body, timeout=10).json()["ranked"]
    assert sorted((r["engine"], r["rank"]) for r in ranked) == [
        ("dp", 0), ("dp", 1), ("dp", 2), ("sim-0", 0),
    ]  # fmt: skip

    for r, pub in enumerate(pubs):
        for i in range(r + 2):  # 2, 3 and 4 batches
            pub.publish(_batch(r, i))

    def counted() -> bool:
        w = _by_rank(_workers(url))
        return (
            w["dp:0"]["unexpected_batches"] == {"dp_rank": 2}
            and w["dp:1"]["unexpected_batches"] == {"topic": 3}
            and w["dp:2"]["batches"] == 4
        )

    wait_until(counted, 30, "the batches counted")
    after = _workers(url)
    assert after["unexpected_batches"] == {"dp#kv:1": 2, "dp@dp1#kv@b:1": 3}
    w = _by_rank(after)
    # the unexpected batches were not indexed: no worker was made for them
    for k in ("dp:0", "dp:1"):
        assert w[k]["batches"] == 0 and w[k]["blocks"]["GPU"]["entries"] == 0
        assert any("unexpected_batch" in a for a in w[k]["recent_anomalies"])
    assert w["dp:2"]["unexpected_batches"] == {}

    # the batches that match their spec are indexed under the worker derived from it
    def indexed() -> bool:
        return bool(_by_rank(_workers(url))["dp:2"]["blocks"]["GPU"]["entries"] == 4)

    wait_until(indexed, 30, "dp:2's blocks in /workers")  # /workers' summary: 1 s cache
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert "\nkvevents_index_resident_entries 4.0\n" in metrics  # dp:2's blocks only
    assert (
        'kvevents_stream_unexpected_batches_total{engine="dp",rank="0",reason="dp_rank"} 2.0'
        in metrics
    )
    assert (
        'kvevents_stream_unexpected_batches_total{engine="dp",rank="1",reason="topic"} 3.0'
        in metrics
    )
    wait_until(lambda: svc.stderr_has("dp:0: batches of topic 'kv', data_parallel_rank 1"), 10)
