"""The consumer loop the examples share: feed a ``BlockIndex`` from a subscriber,
handling every anomaly as a router must, until a stop condition.

* a ``ReceivedBatch`` is applied to the index;
* an ``Anomaly`` is counted; when it says the worker's state can no longer be trusted
  (``needs_reset``: a publisher restart, or a gap replay could not fill), that worker is
  reset in the index and rebuilt from the events that follow; the others (``gap``
  repaired by replay, ``duplicate``, a skipped ``undecodable`` payload) are
  informational, and the stream goes on.

``follow_engines.py``, ``async_consumer.py``, ``prometheus_consumer.py`` and
``route_prompts.py`` import it: run as scripts (``python examples/NAME.py``), the
examples directory is on ``sys.path``.  To take one example elsewhere, copy this file
beside it.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvevents.consumers import Anomaly, AsyncSubscriber, BlockIndex, ReceivedBatch, Subscriber

__all__ = [
    "StopRule",
    "add_follow_arguments",
    "apply_item",
    "catch_up",
    "follow",
    "follow_async",
    "print_anomaly",
]

OnAnomaly = Callable[[Anomaly, bool], None]
"""Called with each anomaly and whether its worker was reset."""


def add_follow_arguments(p: argparse.ArgumentParser, *, stop: bool = True) -> None:
    """The options every consumer example takes: ``ENDPOINT...``, ``--replay-endpoint``
    and, with ``stop``, ``--duration`` / ``--count`` / ``--idle`` (see :class:`StopRule`)."""
    p.add_argument("endpoints", nargs="*", default=["tcp://127.0.0.1:5557"], metavar="ENDPOINT")
    p.add_argument(
        "--replay-endpoint",
        action="append",
        metavar="ENDPOINT",
        help="the replay endpoint of each ENDPOINT, in the same order",
    )
    if stop:
        p.add_argument("--duration", type=float, help="stop after S seconds")
        p.add_argument("--count", type=int, help="stop after N batches")
        p.add_argument("--idle", type=float, help="stop when nothing arrived for S seconds")


class StopRule:
    """When a consumer loop stops: after ``count`` batches, ``duration_s`` seconds, or
    ``idle_s`` seconds without an item once a batch has arrived (None: no such limit).
    The clock starts when the rule is made."""

    def __init__(
        self, count: int | None = None, duration_s: float | None = None, idle_s: float | None = None
    ) -> None:
        self.count = count
        self.duration_s = duration_s
        self.idle_s = idle_s
        self.start = self.last = time.monotonic()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StopRule:
        """The rule of ``--count``, ``--duration`` and ``--idle``."""
        return cls(args.count, args.duration, args.idle)

    def heard(self) -> None:
        """Something arrived: the idle clock starts again."""
        self.last = time.monotonic()

    def reached(self, batches: int) -> bool:
        """Whether to stop, ``batches`` having been applied."""
        if self.count is not None and batches >= self.count:
            return True
        now = time.monotonic()
        if self.duration_s is not None and now - self.start >= self.duration_s:
            return True
        return self.idle_s is not None and batches > 0 and now - self.last >= self.idle_s


def print_anomaly(item: Anomaly, reset: bool) -> None:
    """One line per anomaly: ``anomaly KIND SOURCE#RANK: DETAIL`` (and the reset)."""
    action = "; worker reset, rebuilding from the next events" if reset else ""
    print(f"anomaly {item.kind} {item.source}#{item.dp_rank}: {item.detail}{action}", flush=True)


def apply_item(
    index: BlockIndex,
    item: Any,
    anomalies: Counter[str] | None = None,
    on_anomaly: OnAnomaly | None = None,
) -> bool:
    """Apply one subscriber item to ``index``; returns whether it was a batch.

    An anomaly is counted in ``anomalies`` by kind; one that ``needs_reset`` resets its
    worker in the index; then ``on_anomaly(item, reset)`` is called.
    """
    if isinstance(item, ReceivedBatch):
        index.apply(item.source, item.dp_rank, item.batch)
        return True
    if isinstance(item, Anomaly):
        if anomalies is not None:
            anomalies[item.kind] += 1
        reset = item.needs_reset and item.dp_rank is not None
        if reset:
            index.reset_worker((item.source, item.dp_rank))
        if on_anomaly is not None:
            on_anomaly(item, reset)
    return False


def catch_up(sub: Subscriber, index: BlockIndex, timeout: float = 0.0) -> int:
    """Apply every item ``sub`` has ready (waiting up to ``timeout`` seconds for the
    first); returns the batches applied."""
    applied = 0
    item = sub.receive(timeout=timeout)
    while item is not None:
        applied += apply_item(index, item)
        item = sub.receive(timeout=0)
    return applied


def follow(
    sub: Subscriber,
    index: BlockIndex,
    stop: StopRule,
    anomalies: Counter[str] | None = None,
    on_anomaly: OnAnomaly | None = None,
) -> int:
    """Apply ``sub``'s stream to ``index`` until ``stop`` or Ctrl-C; returns the batches
    applied."""
    batches = 0
    try:
        while not stop.reached(batches):
            item = sub.receive(timeout=0.1)
            if item is None:
                continue
            stop.heard()
            batches += apply_item(index, item, anomalies, on_anomaly)
    except KeyboardInterrupt:
        pass
    return batches


async def follow_async(
    sub: AsyncSubscriber,
    index: BlockIndex,
    stop: StopRule,
    anomalies: Counter[str] | None = None,
    on_anomaly: OnAnomaly | None = None,
) -> int:
    """:func:`follow` on asyncio: other tasks run while it waits for items."""
    batches = 0
    while not stop.reached(batches):
        item = await sub.receive(timeout=0.1)
        if item is None:
            continue
        stop.heard()
        batches += apply_item(index, item, anomalies, on_anomaly)
    return batches
