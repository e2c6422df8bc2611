"""A wake-up reads every ready source at once but decodes one read at a time: the
batches of the reads after the first are decoded only when the application has taken
what came before them, and nothing read is lost or reordered.  Within a read, batches
that follow one delivered in order on their stream take a short path: a read of many
messages must give exactly what reads of one message give."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.capture import CaptureWriter
from kvevents.codec import encode_batch
from kvevents.consumers import AsyncSubscriber, ReceivedBatch, Subscriber, SubscriberOptions
from kvevents.consumers.source_protocol import LIVE, SourceMessage

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
    with Subscriber(
        _captures(tmp_path, 4, 30), options=SubscriberOptions(receive_batch=128)
    ) as sub:
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


def test_closing_with_reads_held_drops_them(tmp_path):
    sub = Subscriber(_captures(tmp_path, 3, 10))
    assert isinstance(sub.receive(5), ReceivedBatch)
    assert sub.stats.batches == 10  # the other two engines' reads are held raw
    sub.close()
    rest = []  # what was processed before the close is still handed out; nothing more
    while (item := sub.receive(0.1)) is not None:
        rest.append(item)
    assert [b.seq for b in rest] == list(range(1, 10))
    assert {b.source for b in rest} == {"engine0#kv"}
    assert sub.take() is None and sub.stats.batches == 10


def test_a_step_before_the_previous_wake_up_is_taken_loses_nothing(tmp_path):
    """A caller with its own loop may step again early: the reads still held are
    processed first, then the new ones are read."""
    with Subscriber(
        _captures(tmp_path, 4, 100), options=SubscriberOptions(receive_batch=50)
    ) as sub:
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


class _ListSource:
    """A source that hands out prepared messages, ``limit`` per read (the thing under
    test is the subscriber's processing of a read, not a transport)."""

    name = "listed"
    can_replay = False
    replay_inband = False

    def __init__(self, msgs: list[SourceMessage]) -> None:
        self._msgs = msgs

    @property
    def exhausted(self) -> bool:
        return not self._msgs

    def sockets(self) -> list[object]:
        return []

    def receive(self, limit: int) -> list[SourceMessage]:
        out, self._msgs = self._msgs[:limit], self._msgs[limit:]
        return out

    def request_replay(self, start: int) -> None:
        raise AssertionError("no replay")

    def cancel_replay(self) -> None:
        pass

    def close(self) -> None:
        pass


# Streams as (origin as sent, topic, rank): two ranks behind one topic, a second topic,
# and a second origin on the first topic.
_STREAMS = [("", b"kv@a", 0), ("", b"kv@a", 1), ("", b"kv@b", 0), ("eng2", b"kv@a", 0)]

_steps = st.lists(
    st.tuples(
        st.integers(0, len(_STREAMS) - 1),  # which stream
        st.sampled_from([1, 1, 1, 0, 2, 4, -2]),  # first seq step: next, repeat, gap, back
        st.integers(1, 4),  # messages in the run (each after the first is the next seq)
        st.sampled_from(["ok", "ok", "ok", "other", "garbage"]),  # the first's payload
    ),
    max_size=25,
)


def _messages(steps: list[tuple[int, int, int, str]]) -> list[SourceMessage]:
    """Runs of messages per stream.  Streams count their seqs alike from 0, so a run of
    one stream often reaches the seq another stream expects next."""
    nxt = [0] * len(_STREAMS)
    msgs = []
    for stream, step, length, kind in steps:
        origin, topic, rank = _STREAMS[stream]
        for i in range(length):
            seq = max(0, nxt[stream] + step - 1) if i == 0 else nxt[stream]
            nxt[stream] = seq + 1
            if i == 0 and kind == "garbage":
                payload = b"\xc1 not msgpack"
            else:
                other = i == 0 and kind == "other"
                payload = encode_batch(make_batch(seq, rank, tag=stream + 10 * other))
            msgs.append(SourceMessage(LIVE, topic, seq, payload, 1.0, origin=origin))
    return msgs


def _outcome(msgs: list[SourceMessage], receive_batch: int) -> tuple[list[object], object]:
    with Subscriber(
        [_ListSource(list(msgs))],
        options=SubscriberOptions(receive_batch=receive_batch, catch_up=False, stale_after_s=None),
    ) as sub:
        items = list(sub)
    seen: list[object] = []
    for item in items:
        if isinstance(item, ReceivedBatch):
            seen.append(("B", item.source, item.dp_rank, item.seq, item.payload))
        else:
            seen.append((item.kind, item.source, item.dp_rank, item.first_seq, item.last_seq))
    stats = sub.stats
    return seen, (stats.batches, stats.events, dict(stats.dropped), dict(stats.anomalies))


@settings(max_examples=400, deadline=None)
@given(_steps)
def test_a_read_of_many_messages_gives_what_reads_of_one_message_give(steps):
    """Within one read, a batch following one delivered in order on its stream takes a
    short path; the items and counters must be exactly those of one-message reads,
    whatever the interleaving of streams, repeats, gaps and undecodable payloads."""
    msgs = _messages(steps)
    assert _outcome(msgs, 1000) == _outcome(msgs, 1)
