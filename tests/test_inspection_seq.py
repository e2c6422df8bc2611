"""``summarize`` counts each batch once, at its first arrival, and a copy as a duplicate."""

from __future__ import annotations

from kvevents.capture import CaptureRecord
from kvevents.codec import encode_batch
from kvevents.events import BlockRemoved, KVEventBatch
from kvevents.inspection import EventFilter, summarize


def _rec(seq: int, tag: int, source: str = "tcp://e:1", replayed: bool = False) -> CaptureRecord:
    batch = KVEventBatch(ts=float(seq), events=[BlockRemoved(block_hashes=[tag], medium=None)])
    return CaptureRecord(1_700_000_000.0 + seq, source, b"", seq, encode_batch(batch), replayed)


def test_gaps_duplicates_late_batches_and_restarts_are_counted_once() -> None:
    records = [
        _rec(0, 0),
        _rec(1, 1),
        _rec(3, 3),  # seq 2 not here yet
        _rec(3, 3),  # the same batch again: a duplicate, its event not counted twice
        _rec(2, 2, replayed=True),  # seq 2 by replay, late: a batch, the gap is filled
        _rec(0, 99),  # another batch at seq 0: a new publisher process
        _rec(1, 100),
        _rec(3, 102),  # seq 2 of the new life never came: a gap
        _rec(5, 5, source="tcp://other:1"),  # another stream's first seq: no gap
    ]
    s = summarize(records)
    assert (s.seq_gaps, s.seq_missing) == (1, 1)
    assert (s.seq_duplicates, s.seq_restarts) == (1, 1)
    assert s.records == 9 and s.batches == 8 and s.events == 8
    assert s.by_worker == {"tcp://e:1#0": 7, "tcp://other:1#0": 1}


def test_a_late_join_counts_the_catch_up_once() -> None:
    """Live from seq 50, then the catch-up replay of 0..52: the replayed 50..52 are
    copies; 0..49 are first arrivals, not duplicates of anything."""
    records = [_rec(s, s) for s in range(50, 60)]
    records += [_rec(s, s, replayed=True) for s in range(0, 53)]
    s = summarize(records)
    assert s.records == 63
    assert s.batches == 60 and s.events == 60
    assert s.seq_duplicates == 3
    assert (s.seq_gaps, s.seq_missing, s.seq_restarts) == (0, 0, 0)


def test_the_worker_filter_counts_that_workers_records_and_batches() -> None:
    records = [_rec(s, s) for s in range(10)] + [_rec(s, s, source="tcp://f:1") for s in range(4)]
    s = summarize(records, EventFilter(worker="tcp://f:1"))
    assert (s.records, s.batches, s.events) == (4, 4, 4)
    s = summarize(records, EventFilter(worker="tcp://e:1#0"))
    assert (s.records, s.batches, s.events) == (10, 10, 10)
