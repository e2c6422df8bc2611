"""A wake-up reads every ready source at once but decodes one read at a time: the
batches of the reads after the first are decoded only when the application has taken
what came before them, and nothing read is lost or reordered."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from kvevents.capture import CaptureWriter
from kvevents.codec import encode_batch
from kvevents.consumers import AsyncSubscriber, ReceivedBatch, Subscriber

sys.path.insert(0, os.path.dirname(__file__))
from _zmq_helpers import make_batch

pytestmark = pytest.mark.timeout(60)


def _captures(tmp_path: Path, engines: int, batches: int) -> list[str]:
    """One capture file per engine, ``batches`` live batches each (seq 0 on)."""
    paths = []
    for e in range(engines):
        path = tmp_path / f"engine{e}.kvcap"
        with CaptureWriter(path) as w:
            for seq in range(batches):
                w.write(f"engine{e}", b"kv", seq, encode_batch(make_batch(seq, tag=e)))
        paths.append(f"capture:{path}")
    return paths


def _per_engine(items: list[ReceivedBatch]) -> dict[str, list[int]]:
    seqs: dict[str, list[int]] = {}
    for item in items:
        seqs.setdefault(item.source, []).append(item.seq)
    return seqs


def test_only_the_first_read_of_a_wake_up_is_decoded_before_it_is_taken(tmp_path):
    with Subscriber(_captures(tmp_path, 4, 30), receive_batch=128) as sub:
        first = sub.receive(5)
        assert isinstance(first, ReceivedBatch)
        # All four files were read in this wake-up; one engine's read was decoded.
        assert sub.stats.batches == 30
        assert not sub.finished()
        rest = [first] + [item for item in sub if isinstance(item, ReceivedBatch)]
    assert sub.stats.batches == 120
    # Reads come out whole and in read order: each engine's batches together, in seq order.
    engines = [item.source for item in rest]
    assert [engines[i] for i in range(0, 120, 30)] == sorted(set(engines))
    assert _per_engine(rest) == {name: list(range(30)) for name in set(engines)}


def test_a_step_before_the_previous_wake_up_is_taken_loses_nothing(tmp_path):
    """A caller with its own loop may step again early: the reads still held are
    processed first, then the new ones are read."""
    with Subscriber(_captures(tmp_path, 4, 100), receive_batch=50) as sub:
        got: list[ReceivedBatch] = []
        for _ in range(2):  # two wake-ups, nothing taken in between
            sub.step(None, time.monotonic())
        while not sub.finished():
            item = sub.take()
            if item is None:
                sub.step(None, time.monotonic())
            elif isinstance(item, ReceivedBatch):
                got.append(item)
    assert len(got) == 400
    assert _per_engine(got) == {f"engine{e}#kv": list(range(100)) for e in range(4)}


def test_the_asyncio_subscriber_also_decodes_one_read_at_a_time(tmp_path):
    async def scenario() -> tuple[int, list[ReceivedBatch]]:
        async with AsyncSubscriber(_captures(tmp_path, 4, 30)) as sub:
            first = await sub.receive(5)
            decoded = sub.stats.batches
            got = [first]
            while (item := await sub.receive(5)) is not None:
                got.append(item)
        return decoded, [x for x in got if isinstance(x, ReceivedBatch)]

    decoded, got = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert decoded == 30
    assert len(got) == 120
    assert all(seqs == list(range(30)) for seqs in _per_engine(got).values())
