"""``summarize`` counts seq anomalies as a StreamTracker without replay sees them."""

from __future__ import annotations

from kvevents.capture import CaptureRecord
from kvevents.codec import encode_batch
from kvevents.events import BlockRemoved, KVEventBatch
from kvevents.inspection import summarize


def _rec(seq: int, tag: int, source: str = "tcp://e:1") -> CaptureRecord:
    batch = KVEventBatch(ts=float(seq), events=[BlockRemoved(block_hashes=[tag], medium=None)])
    return CaptureRecord(1_700_000_000.0 + seq, source, b"", seq, encode_batch(batch))


def test_gaps_duplicates_late_batches_and_restarts_are_counted_once() -> None:
    records = [
        _rec(0, 0),
        _rec(1, 1),
        _rec(3, 3),  # gap: seq 2 missing
        _rec(3, 3),  # the same batch again: a duplicate, its event not counted twice
        _rec(2, 2),  # arrives after its seq was counted missing: late, not applied
        _rec(0, 99),  # another batch at seq 0: a new publisher process
        _rec(1, 100),
        _rec(5, 5, source="tcp://other:1"),  # another stream's first seq: no gap
    ]
    s = summarize(records)
    assert (s.seq_gaps, s.seq_missing) == (1, 1)
    assert (s.seq_duplicates, s.seq_restarts) == (2, 1)
    assert s.batches == 8 and s.events == 6
    assert s.by_worker == {"tcp://e:1#0": 5, "tcp://other:1#0": 1}
