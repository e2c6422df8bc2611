"""``SeqLedger``: whatever order the records of one life arrive in, and however often a
batch is copied, each seq is one batch, every repeat a copy, and the seqs missing
between the lowest and the highest are the holes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvevents.capture_account import COPY, NEW, SeqLedger


@given(
    seqs=st.sets(st.integers(0, 300), min_size=1, max_size=120),
    copies=st.lists(st.integers(0, 10_000), max_size=60),
    order=st.randoms(use_true_random=False),
)
def test_each_seq_is_one_batch_and_each_repeat_a_copy(
    seqs: set[int], copies: list[int], order: object
) -> None:
    ordered = sorted(seqs)
    arrivals = [(s, False) for s in ordered]  # the live stream, in order
    pool = list(ordered)
    arrivals += [(pool[c % len(pool)], True) for c in copies]  # replayed copies, any order
    order.shuffle(arrivals)  # type: ignore[attr-defined]
    # replayed arrivals may come first; live ones stay in seq order among themselves
    live = iter(ordered)
    arrivals = [(next(live), False) if not r else (s, r) for s, r in arrivals]
    ledger = SeqLedger()
    verdicts = [ledger.observe("w#0", s, s * 7919, r) for s, r in arrivals]
    assert verdicts.count(NEW) == len(seqs)
    assert verdicts.count(COPY) == len(copies)
    assert ledger.restarts == 0
    holes = ledger.holes()
    missing = {s for h in holes for s in range(h.first, h.last + 1)}
    assert missing == set(range(ordered[0], ordered[-1] + 1)) - seqs
    assert ledger.spans() == {"w#0": [(ordered[0], ordered[-1])]}


@given(st.integers(1, 50), st.integers(1, 50))
def test_a_seq_with_another_payload_starts_a_new_life(first: int, second: int) -> None:
    ledger = SeqLedger()
    for s in range(first):
        assert ledger.observe("w#0", s, s, False) == NEW
    assert ledger.observe("w#0", 0, -1, False) == "restart"
    for s in range(1, second):
        assert ledger.observe("w#0", s, -1 - s, False) == NEW
    assert ledger.restarts == 1
    assert ledger.spans() == {"w#0": [(0, first - 1), (0, second - 1)]}
    assert ledger.holes() == []
