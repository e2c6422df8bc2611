"""Metrics are safe to scrape while a live stream changes every counter: real HTTP
scrapes against a real ZMQ-fed subscriber and index, zero errors; the index and
subscriber gauges read what they hold."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request

import pytest

from kvevents.consumers import BlockIndex, ReceivedBatch, Subscriber
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.metrics import StatsCollector, start_metrics_server
from tests.consumers._zmq_helpers import FaultyPublisher, drain, make_batch, wait_until

pytest.importorskip("prometheus_client")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _churny_batch(i: int) -> KVEventBatch:
    """A GPU store in a group of a new (not prefix-indexable) kind, so every batch adds a
    key to the index's ``skipped`` counter, and the removal of the previous block."""
    events = [
        BlockStored(
            block_hashes=[i + 1],
            parent_block_hash=None,
            token_ids=list(range(16)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=i % 3,
            kv_cache_spec_kind=f"kind_{i}",
        )
    ]
    if i:
        events.append(BlockRemoved(block_hashes=[i], medium="GPU", group_idx=(i - 1) % 3))
    return KVEventBatch(float(i), events, 0)


def _metric(body: str, name: str) -> float:
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the scrape")


def test_scrapes_racing_a_live_stream_never_fail() -> None:
    n = 6000
    with FaultyPublisher() as pub:
        sub = Subscriber([pub.endpoint], replay_endpoints=[pub.replay_endpoint])
        index = BlockIndex()
        collector = StatsCollector()
        collector.register("index", index)
        collector.register("subscriber", sub)
        collector.register("decoder", sub.decoder)
        port = _free_port()
        start_metrics_server(port, collector)
        url = f"http://127.0.0.1:{port}/metrics"
        pub.wait_for_subscribers(1, pump=lambda: sub.receive(0.01))
        done = threading.Event()
        stop = threading.Event()  # the test ended early: the owner lets go of `sub`
        applied = [0]

        def owner() -> None:  # the subscriber's thread: receives and applies
            while applied[0] < n and not stop.is_set():
                item = sub.receive(0.5)
                if isinstance(item, ReceivedBatch):
                    index.apply(item.source, item.dp_rank, item.batch)
                    applied[0] += 1
            done.set()

        t = threading.Thread(target=owner, daemon=True)
        t.start()
        errors: list[str] = []
        scrapes = 0
        try:
            for i in range(n):
                pub.publish(_churny_batch(i))
                if i % 20 == 0:
                    try:
                        urllib.request.urlopen(url, timeout=10).read()
                    except (urllib.error.URLError, OSError) as exc:
                        errors.append(repr(exc))
                    scrapes += 1
            while not done.is_set():  # keep scraping until the owner has applied all
                try:
                    urllib.request.urlopen(url, timeout=10).read()
                except (urllib.error.URLError, OSError) as exc:
                    errors.append(repr(exc))
                scrapes += 1
                done.wait(0.001)
        finally:
            stop.set()
            t.join(30)
            sub.close()
        assert errors == [] and scrapes >= n // 20
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert _metric(body, "kvevents_index_batches_total") == n
        assert _metric(body, "kvevents_index_resident_entries") == len(index) == 1
        assert _metric(body, "kvevents_index_pending_joins") == 0
        assert _metric(body, "kvevents_index_retained_metadata") == index.retained_count
        assert _metric(body, "kvevents_subscriber_workers") == 1
        assert _metric(body, "kvevents_subscriber_stale_workers") == 0
        assert body.count("kvevents_index_skipped_total{") == n  # one key per kind


def test_subscriber_gauges_show_stale_workers_and_replay_lag() -> None:
    with FaultyPublisher(hold_replay=True) as pub:
        sub = Subscriber([pub.endpoint], replay_endpoints=[pub.replay_endpoint])
        try:
            pub.wait_for_subscribers(1, pump=lambda: sub.receive(0.01))
            pub.publish(make_batch(0))
            got = drain(sub, lambda items: len(items) >= 1)
            last = got[0].recv_ts
            g = sub.gauges(now=last)
            assert g["workers"] == 1 and sub.stats.stale_workers == 0
            # seq 1 never arrives live: 2..4 wait behind the replay the publisher holds
            pub.publish_many([make_batch(i) for i in range(1, 5)], skip=[1])
            drain(sub, lambda items: any(getattr(x, "kind", "") == "gap" for x in items))
            wait_until(
                lambda: (sub.receive(0.01), sub.gauges()["replay_lag_batches"] == 3)[1], timeout=20
            )
            g = sub.gauges(now=last + 7.0)
            assert g["replays_in_flight"] == 1 and g["replay_lag_seconds"] == pytest.approx(7.0)
            pub.release.set()
            drain(sub, lambda items: sum(isinstance(x, ReceivedBatch) for x in items) >= 4)
            # the replay ends with its end marker, which may come after the last batch
            wait_until(
                lambda: (sub.receive(0.01), sub.gauges()["replays_in_flight"] == 0)[1], timeout=20
            )
            g = sub.gauges()
            assert g["replay_lag_batches"] == 0 and g["replays_in_flight"] == 0
            assert g["replay_lag_seconds"] == 0
        finally:
            sub.close()
