"""What stalled subscribers can make the publisher hold: a byte budget, not a message count.

A publisher in a subprocess sends ~15 kB batches at 1,000 a second to 20 SUB connections
that never read; its resident memory is read from ``/proc`` as it goes.  Without the
budget every batch stayed queued for them (about 15 MiB more per second, without end);
with it the growth goes flat once the queues hold what the budget allows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from pubtest_helpers import recv, removed_batch, subscribe, wait_until

from kvevents.codec import unpack_seq
from kvevents.publishers import ZmqEventPublisher

REPO = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024

PUBLISHER = textwrap.dedent(
    """
    import json, sys, time
    from kvevents.events import BlockStored, KVEventBatch
    from kvevents.publishers import ZmqEventPublisher

    total, rate, budget = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    pub = ZmqEventPublisher(endpoint="tcp://127.0.0.1:0", bind=True, live_max_client_bytes=budget)
    print(pub.endpoint, flush=True)
    sys.stdin.readline()  # the subscribers are connected
    tokens = list(range(100_000, 103_000))  # ~15 kB encoded

    def batch(i):
        hashes = [i * 1000 + j for j in range(16)]
        return KVEventBatch(float(i), [BlockStored(hashes, None, tokens, 16, None, "GPU", None)])

    start = time.monotonic()
    n = 0
    while n < total:
        due = min(total, int((time.monotonic() - start) * rate) + 1)
        while n < due:
            pub.publish(batch(n))
            n += 1
            if n % 500 == 0:
                while pub.queue_size:  # so the count printed has reached the socket
                    time.sleep(0.001)
                print("published", n, flush=True)
                sys.stdin.readline()  # the parent has read our memory
        time.sleep(0.001)
    stats = {k: v for k, v in vars(pub.stats).items() if isinstance(v, int)}
    print(json.dumps(stats), flush=True)
    sys.stdin.readline()
    pub.shutdown(0)
    """
)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_twenty_stalled_subscribers_pin_no_more_than_the_budget(ctx: zmq.Context[Any]) -> None:
    total = 4000
    child = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, str(total), "1000", str(8 * MiB)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert child.stdin is not None and child.stdout is not None
    stalled = []
    try:
        endpoint = child.stdout.readline().strip()
        for _ in range(20):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 1)
            sub.setsockopt(zmq.RCVBUF, 4096)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            stalled.append(sub)  # never read
        base = rss_bytes(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
        growth: dict[int, int] = {}
        for line in child.stdout:
            if not line.startswith("published"):
                stats = json.loads(line)
                break
            growth[int(line.split()[1])] = rss_bytes(child.pid) - base
            child.stdin.write("\n")
            child.stdin.flush()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdin.close()
        child.stdout.close()
        for sub in stalled:
            sub.close()
    table = {n: round(g / MiB, 1) for n, g in growth.items()}
    # 2,000 more batches of ~15 kB would be ~29 MiB without a budget.
    assert growth[total] - growth[total // 2] < 6 * MiB, table
    assert growth[total] < 8 * MiB + 8 * MiB, table  # the budget, and the allocator's slack
    assert stats["live_subscribers"] == 20
    assert stats["live_hwm"] == 8 * MiB // (16 * 1024 + 8 + 3 * 64)
    # 20 queues of 505 batches of ~15 kB could hold 150 MiB if they had stalled apart.
    assert stats["live_pinned_bytes_bound"] <= 256 * MiB
    assert stats["live_budget_overruns"] == 0
    assert stats["batches_published"] == total


def test_the_mark_is_fixed_and_the_bound_follows_batch_size_and_subscribers(
    ctx: zmq.Context[Any],
) -> None:
    """The mark comes from the budget and the hint before the socket opens and never
    changes; the bound it gives follows the batch size seen and the subscriber count,
    and going above the total budget is counted once per crossing."""
    with ZmqEventPublisher(
        endpoint="tcp://127.0.0.1:0",
        bind=True,
        live_max_client_bytes=4 * MiB,
        live_max_bytes_in_flight=4 * MiB,
        live_batch_bytes_hint=16,  # far below the batches sent
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

        publish_until(lambda: pub.stats.live_subscribers == 4)
        size = pub.stats.live_batch_bytes
        assert size > 16
        assert pub.stats.live_pinned_bytes_bound == hwm * (size + 8 + 3 * 64) * 4
        # Batches bigger than the hint: the queues could pin more than 4 MiB; warned, once.
        assert pub.stats.live_budget_overruns == 1
        for sub in subs[2:]:
            sub.close()
        publish_until(lambda: pub.stats.live_subscribers == 2)
        assert pub.stats.live_hwm == hwm
        assert pub.stats.live_pinned_bytes_bound == hwm * (size + 8 + 3 * 64) * 2
        for sub in subs[:2]:
            while sub.poll(0):
                sub.recv_multipart()
        other.close()
        for sub in subs[:2]:
            sub.close()


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
