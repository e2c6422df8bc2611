"""What stalled subscribers can make the publisher hold: a byte budget, not a message count.

A publisher in a subprocess sends ~14 kB batches at 1,000 a second while 20 SUB
connections that never read stall one after another (``benchmarks/live_budget.py``'s
scenario); its resident memory is read from ``/proc`` as it goes.  With the mark fixed
each stalled queue held other batches and the growth went on until 20 marks were full;
now the socket is re-created with a smaller mark as subscribers come, the growth goes
flat within the budget, and a healthy subscriber alongside repairs the gaps by replay.
"""

from __future__ import annotations

import logging
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from pubtest_helpers import recv, removed_batch, subscribe, wait_until

from kvevents import BlockRemoved, KVEventBatch
from kvevents.codec import encode_batch, unpack_seq
from kvevents.publishers import ZmqEventPublisher
from kvevents.publishers.live_budget import BLOCK_BATCHES, LiveBudget
from kvevents.publishers.publisher_stats import PublisherStats
from kvevents.ratelimit import RateLimitedLog

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import live_budget  # the scenario the benchmark measures

MiB = 1024 * 1024


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_twenty_subscribers_stalled_apart_pin_no_more_than_the_budget() -> None:
    """20 SUBs that never read connect one every 0.4 s to a publisher sending ~14 kB
    batches at 1,000 a second (each stalls at another point of the stream, so each
    holds other batches: up to 20 x 505 batches with the mark fixed, ~130 MiB); the
    publisher re-creates its socket as they come, its RSS goes flat within the 32 MiB
    budget (plus the 42 MiB ring), and a healthy subscriber alongside ends with every
    seq and the engine's index."""
    budget, per_client, ring = 32 * MiB, 8 * MiB, 3000
    run = live_budget.run_scenario(
        publisher={"live_max_client_bytes": per_client, "live_max_bytes_in_flight": budget},
        subscribers=20,
        stagger_s=0.4,
        seconds=12.0,
        ring=ring,
    )
    table = [(t, round(g / MiB, 1)) for t, g in run["rss"]]
    stats, healthy = run["stats"], run["healthy"]
    end = run["rss"][-1][1]
    ring_bytes = ring * 15_000
    assert end < budget + ring_bytes + 8 * MiB, table  # the allocator's slack
    # Flat once the last subscriber stalled (8 s): no more than a burst's worth later.
    assert end - live_budget.growth_at(run["rss"], 9.0) * MiB < 4 * MiB, table
    assert healthy["missing"] == 0, healthy
    assert healthy["index_equal"], healthy
    # Halving at 5, 10 and 19 subscribers (8 MiB each, then 32 MiB / n): log2 bounded.
    base = per_client // (16 * 1024 + 8 + 3 * 64)
    assert 1 <= stats["live_recreations"] <= base.bit_length(), stats
    assert set(stats["live_recreation_reasons"]) == {"subscribers"}, stats
    assert stats["live_pinned_bytes_bound"] <= budget, stats
    assert stats["live_budget_overruns"] == 0, stats
    assert stats["batches_published"] == run["total"]


def test_batches_far_above_the_hint_shrink_the_mark_and_subscribers_come_back(
    ctx: zmq.Context[Any],
) -> None:
    """The mark comes from the budget and a hint far below the batches sent; the first
    block of batches re-creates the socket with a mark the budget allows (reason
    ``batch_size``), and the subscribers reconnect by themselves and go on receiving."""
    with ZmqEventPublisher(
        endpoint="tcp://127.0.0.1:0",
        bind=True,
        live_max_client_bytes=4 * MiB,
        live_max_bytes_in_flight=16 * MiB,  # 4 subscribers: 4 MiB each
        live_batch_bytes_hint=16,
        warn_interval_s=3600,
    ) as pub:
        hwm = 4 * MiB // (16 + 8 + 3 * 64)
        assert pub.stats.live_hwm == hwm
        subs = [subscribe(ctx, pub.endpoint) for _ in range(4)]
        other = subscribe(ctx, pub.endpoint, b"another-topic")  # receives nothing
        n = 0

        def publish_until(pred: Any) -> None:
            nonlocal n

            def step() -> bool:
                nonlocal n
                pub.publish(removed_batch(n))
                n += 1
                return bool(pred())

            wait_until(step, what="the budget to follow")

        publish_until(lambda: pub.stats.live_recreations >= 1)
        size = pub.stats.live_batch_bytes
        assert size > 16
        allowed = 4 * MiB // (size + 8 + 3 * 64)
        assert pub.stats.live_recreation_reasons["batch_size"] == 1
        assert pub.stats.live_hwm <= allowed
        # Back: each subscriber receives a batch published after the re-creation.
        after = n
        for sub in subs:
            while True:
                pub.publish(removed_batch(n))
                n += 1
                if sub.poll(20) and unpack_seq(recv(sub)[1]) >= after:
                    break
        publish_until(lambda: pub.stats.live_subscribers == 4)
        assert pub.stats.live_pinned_bytes_bound <= 16 * MiB
        assert pub.stats.live_recreations == 1
        assert pub.stats.live_budget_overruns == 0
        assert not other.poll(0)
        for sub in [*subs, other]:
            sub.close()


def test_the_mark_grows_back_only_after_a_cooldown_and_a_bounded_number_of_times() -> None:
    """The decision alone (no socket): a smaller mark as soon as the budget is exceeded,
    halving from the base; a larger one only with four times the room, after the
    cooldown, with a factor of two to spare; subscribers coming and going every second
    for ten minutes re-create the socket at most twice a cooldown."""
    now = [0.0]
    stats = PublisherStats()
    budget = LiveBudget(
        stats,
        RateLimitedLog(logging.getLogger("test"), 3600),
        hwm=1024,
        per_subscriber_bytes=1024 * 1000,
        total_bytes=4096 * 1000,
        batch_bytes_hint=1000 - 8 - 3 * 64,
        envelope_bytes=8,
        grow_after_s=60.0,
        clock=lambda: now[0],
    )
    assert budget.wanted is None
    budget.set_subscribers(4)
    assert budget.wanted is None  # 4 x 1024 batches of 1,000 bytes: the budget exactly
    budget.set_subscribers(5)
    assert budget.wanted == (512, "subscribers")
    budget.recreated(512)
    budget.set_subscribers(5)
    assert budget.wanted is None
    for _ in range(BLOCK_BATCHES):  # batches 3x bigger: 512 x 3,000 x 5 > 4,096,000
        budget.observe(3000 - 8 - 3 * 64)
    assert budget.wanted == (256, "batch_size")
    budget.recreated(256)
    budget.set_subscribers(1)
    for _ in range(40 * BLOCK_BATCHES):  # 500 bytes: followed slowly
        budget.observe(500 - 8 - 3 * 64)
    assert budget.wanted is None  # room for 4 x 256, but within the cooldown
    now[0] += 61
    budget.set_subscribers(1)
    assert budget.wanted == (512, "grow")  # a factor of two to spare
    budget.recreated(512)
    recreations = 0
    for second in range(600):
        now[0] += 1
        budget.set_subscribers(1 if second % 2 else 40)
        if budget.wanted is not None:
            budget.recreated(budget.wanted[0])
            recreations += 1
    assert recreations <= 2 * 600 // 60 + 2


def test_without_a_budget_the_configured_hwm_stays(ctx: zmq.Context[Any]) -> None:
    with ZmqEventPublisher(
        endpoint="tcp://127.0.0.1:0",
        bind=True,
        hwm=777,
        live_max_client_bytes=None,
        live_max_bytes_in_flight=None,
    ) as pub:
        sub = subscribe(ctx, pub.endpoint)
        wait_until(lambda: (pub.publish(removed_batch(0)), sub.poll(20))[1])
        assert unpack_seq(recv(sub)[1]) >= 0
        assert pub.stats.live_hwm == 777
        sub.close()


def test_no_recreation_once_shutdown_has_begun(ctx: zmq.Context[Any]) -> None:
    """A block of batches far above the hint completes while the publisher shuts down:
    the socket is not re-created (that would drop the last batches queued for the
    subscriber, which shutdown waits to see written); the subscriber gets them all."""
    pub = ZmqEventPublisher(
        endpoint="tcp://127.0.0.1:0",
        bind=True,
        live_max_client_bytes=1 * MiB,
        live_batch_bytes_hint=16,
        warn_interval_s=3600,
    )
    sub = subscribe(ctx, pub.endpoint)
    wait_until(lambda: pub.stats.live_subscribers == 1, what="the subscription")
    pub._pause_sender()
    for i in range(BLOCK_BATCHES):
        pub.publish(removed_batch(i))
    stopper = threading.Thread(target=pub.shutdown, args=(10.0,))
    stopper.start()
    wait_until(lambda: pub._sender.closing.is_set(), what="the shutdown")
    pub._resume_sender()
    stopper.join()
    assert pub.stats.live_recreations == 0
    assert [unpack_seq(recv(sub)[1]) for _ in range(BLOCK_BATCHES)] == list(range(BLOCK_BATCHES))
    sub.close()


def test_a_wildcard_ipc_socket_is_never_recreated(
    ctx: zmq.Context[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libzmq removes a bound ``ipc://*`` address's file and folder as the old socket
    closes, so a socket re-created there would be unreachable: the budget only watches,
    and a subscriber arriving after batches far above the hint still receives."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where libzmq makes the wildcard's folder
    with ZmqEventPublisher(
        endpoint="ipc://*",
        live_max_client_bytes=1 * MiB,
        live_batch_bytes_hint=16,
        warn_interval_s=3600,
    ) as pub:
        for i in range(2 * BLOCK_BATCHES):
            pub.publish(removed_batch(i))
        wait_until(lambda: pub.queue_size == 0 and pub.stats.live_batch_bytes > 16)
        assert pub.stats.live_recreations == 0
        sub = subscribe(ctx, pub.endpoint)
        n = 2 * BLOCK_BATCHES
        while not sub.poll(20):
            pub.publish(removed_batch(n))
            n += 1
            assert n < 2 * BLOCK_BATCHES + 500, "the subscriber never received"
        sub.close()


def test_a_watch_only_socket_warns_once_when_one_subscriber_could_pin_above_its_budget(
    ctx_instance: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """An ``inproc://`` socket is never re-created: when batches far above the hint make
    one subscriber's queue able to hold more than ``live_max_client_bytes`` (the total
    budget far away), the publisher counts an overrun and warns, once while it lasts,
    and again when it comes back after the batches shrank."""
    big = KVEventBatch(0.0, [BlockRemoved(list(range(1 << 40, (1 << 40) + 100)), "GPU")])
    small = removed_batch(1)
    hint = len(encode_batch(small)) + 16  # small batches fit the mark with room to spare
    caplog.set_level(logging.WARNING, logger="kvevents.publishers.zmq_publisher")
    with ZmqEventPublisher(
        endpoint=f"inproc://kv-budget-{uuid.uuid4().hex}",
        live_max_client_bytes=1 * MiB,
        live_max_bytes_in_flight=1024 * MiB,
        live_batch_bytes_hint=hint,
        warn_interval_s=0,
    ) as pub:
        hwm = pub.stats.live_hwm
        assert hwm == 1 * MiB // (hint + 8 + 3 * 64)
        sub = subscribe(ctx_instance, pub.endpoint)
        wait_until(lambda: pub.stats.live_subscribers == 1, what="the subscription")

        def overruns_after(batch: KVEventBatch, pred: Any) -> int:
            def step() -> bool:
                for _ in range(BLOCK_BATCHES):
                    pub.publish(batch)
                return bool(pred())

            wait_until(step, what="the budget to follow")
            return pub.stats.live_budget_overruns

        # One block of ~1 kB batches: hwm x 1.2 kB is above 1 MiB, far below 1 GiB.
        assert overruns_after(big, lambda: pub.stats.live_batch_bytes > 500) == 1
        assert 1 * MiB < pub.stats.live_pinned_bytes_bound < 1024 * MiB
        for _ in range(3 * BLOCK_BATCHES):  # the same episode: no second count
            pub.publish(big)
        wait_until(lambda: pub.queue_size == 0, what="the batches to be sent")
        assert pub.stats.live_budget_overruns == 1
        # Small batches bring the bound back under the budget; big ones again: a new one.
        overruns_after(small, lambda: pub.stats.live_pinned_bytes_bound <= 1 * MiB)
        assert overruns_after(big, lambda: pub.stats.live_budget_overruns == 2) == 2
        assert pub.stats.live_recreations == 0
        assert pub.stats.live_hwm == hwm
        assert sub.poll(0)  # still the subscriber's socket
        sub.close()
    warnings = [r.getMessage() for r in caplog.records if "could pin" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert all(
        "one subscriber could pin" in w and "1048576-byte budget per subscriber" in w
        for w in warnings
    ), warnings
