"""The compiled record table (``kvevents_native.RecordTable``) answers exactly as the
dict it replaces in ``GroupState.meta``, and the compiled retained order
(``kvevents_native.RetainedQueue``) as the OrderedDict of ``Retention.records``: random sets (new keys last, known keys in
place), deletions, deletion and re-insertion (to the end), clears, growth past
rehashes and compaction after mass deletion, records of every width up to 192 bits,
and keys or records that do not fit (bytes and negative hashes, wider ints, tuples),
after which a Python dict holds the same items in the same order; retirements, forgets
and trims of the oldest, keys that do not fit.  Skipped without
``kvevents-native``."""

from __future__ import annotations

import gc
from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

kn = pytest.importorskip("kvevents_native")

HASHES = st.one_of(st.integers(0, 60), st.sampled_from([2**64 - 1, 2**63, 1 << 40]))
RECORDS = st.one_of(
    st.integers(1, 2**64),
    st.integers(1, 2**192 - 1),
    st.sampled_from([1, 1 << 171, (1 << 192) - 1, (5 << 171) | (16 << 85) | 7]),
)
MISFITS: list[tuple[Any, Any]] = [
    (b"\x01" * 32, 1 << 100),  # a bytes hash (vLLM <= 0.23)
    (-5, 3),  # a negative hash
    (2**64, 3),  # a hash beyond 64 bits
    (7, 1 << 192),  # a record beyond 192 bits
    (8, (None, 2, None, 16, "lora", None, None, 1)),  # a wide (tuple) record
    (9, 0),  # zero: never a record, kept by the dict
]


def same(table: Any, spec: dict[Any, Any]) -> None:
    assert table.items() == list(spec.items())
    assert table.keys() == list(spec)
    assert table.values() == list(spec.values())
    assert list(table) == list(spec)
    assert len(table) == len(spec)
    assert table == spec
    for h, m in spec.items():
        assert table[h] == m and table.get(h) == m and h in table


class RecordsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = kn.RecordTable()
        self.spec: dict[Any, Any] = {}

    @rule(h=HASHES, m=RECORDS)
    def set(self, h: int, m: int) -> None:
        self.table[h] = m
        self.spec[h] = m

    @rule(h=HASHES)
    def delete(self, h: int) -> None:
        if h in self.spec:
            del self.table[h]
            del self.spec[h]
        else:
            with pytest.raises(KeyError):
                del self.table[h]

    @rule(h=HASHES)
    def move_to_end(self, h: int) -> None:  # the stores' "del then set"
        if h in self.spec:
            m = self.spec.pop(h)
            del self.table[h]
            self.table[h] = self.spec[h] = m

    @rule(first=st.integers(100, 5_000), n=st.integers(1, 400), m=RECORDS)
    def many(self, first: int, n: int, m: int) -> None:
        for h in range(first, first + n):
            self.table[h] = self.spec[h] = m

    @rule(first=st.integers(100, 5_000), n=st.integers(1, 400), step=st.sampled_from([1, 2, 3]))
    def drop_many(self, first: int, n: int, step: int) -> None:
        for h in range(first, first + n, step):
            if h in self.spec:
                del self.table[h]
                del self.spec[h]

    @precondition(lambda self: len(self.spec) < 50)
    @rule()
    def clear(self) -> None:
        self.table.clear()
        self.spec.clear()

    @rule(which=st.integers(0, len(MISFITS) - 1))
    def misfit(self, which: int) -> None:
        h, m = MISFITS[which]
        self.table[h] = m
        self.spec[h] = m
        assert self.table.spilled

    @rule(hs=st.lists(HASHES, max_size=5))
    def disjoint(self, hs: list[int]) -> None:
        assert self.table.isdisjoint(hs) == self.spec.keys().isdisjoint(hs)

    @invariant()
    def alike(self) -> None:
        same(self.table, self.spec)
        for h in (61, 2**64 - 2, None, "x", b"y", -1, 2**70):
            if h not in self.spec:
                assert h not in self.table and self.table.get(h, "no") == "no"


TestRecordsMachine = RecordsMachine.TestCase
TestRecordsMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


def test_missing_keys_raise_key_error() -> None:
    t = kn.RecordTable()
    t[1] = 5
    for h in (2, -1, b"x", None):
        with pytest.raises(KeyError):
            t[h]
        with pytest.raises(KeyError):
            del t[h]
    assert not t.spilled and t.nbytes > 0


def test_a_spilled_table_holding_itself_is_collected() -> None:
    t = kn.RecordTable()
    t[1] = 5
    t[b"self"] = t  # a reference cycle through the Python dict it spilled to
    assert t.spilled
    del t
    assert gc.collect() >= 1


def test_a_table_of_a_million_entries_stays_compact() -> None:
    t = kn.RecordTable()
    n = 1_000_000
    for h in range(n):
        t[h * 0x9E3779B97F4A7C15 % 2**64] = (1 << 171) | (16 << 85) | h
    assert len(t) == n and t.nbytes / n <= 56  # 32 B entries, 4 B index slots
    for h in range(0, n, 2):
        del t[h * 0x9E3779B97F4A7C15 % 2**64]
    assert len(t) == n // 2 and t.nbytes / (n // 2) <= 2 * 56


# --- the retained order: kvevents_native.RetainedQueue against an OrderedDict ----------

WIDS = st.sampled_from([("a", 0), ("a", 1), ("tcp://b:5557", 0), "plain"])
ENTRY_KEYS = st.tuples(WIDS, st.sampled_from([0, 1, 7, 2**32 - 1]), HASHES)
ODD_KEYS: list[Any] = [
    (("a", 0), 0, b"\x02" * 32),  # bytes hash
    (("a", 0), -1, 5),  # negative group
    (("a", 0), 2**32, 5),  # group beyond 32 bits
    (("a", 0), 0, -3),  # negative hash
    "not a tuple",
]


class RetainedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.queue = kn.RetainedQueue()
        self.spec: OrderedDict[Any, None] = OrderedDict()

    @rule(key=ENTRY_KEYS)
    def retire(self, key: Any) -> None:
        self.queue[key] = None
        self.spec[key] = None

    @rule(key=ENTRY_KEYS)
    def forget(self, key: Any) -> None:
        assert self.queue.pop(key, None) is self.spec.pop(key, None)

    @rule(n=st.integers(1, 5))
    def trim(self, n: int) -> None:
        for _ in range(n):
            if not self.spec:
                with pytest.raises(KeyError):
                    self.queue.popitem(last=False)
                return
            assert self.queue.popitem(last=False) == self.spec.popitem(last=False)

    @rule(wid=WIDS, first=st.integers(100, 5_000), n=st.integers(1, 300))
    def many(self, wid: Any, first: int, n: int) -> None:
        for h in range(first, first + n):
            self.queue[(wid, 0, h)] = self.spec[(wid, 0, h)] = None

    @rule(which=st.integers(0, len(ODD_KEYS) - 1))
    def odd_key(self, which: int) -> None:
        self.queue[ODD_KEYS[which]] = None
        self.spec[ODD_KEYS[which]] = None
        assert self.queue.spilled

    @invariant()
    def alike(self) -> None:
        assert self.queue.items() == list(self.spec.items())
        assert self.queue.keys() == list(self.spec) == list(self.queue)
        assert len(self.queue) == len(self.spec)
        for key in self.spec:
            assert key in self.queue
        assert (("never", 9), 0, 1) not in self.queue


TestRetainedMachine = RetainedMachine.TestCase
TestRetainedMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


def test_retained_pop_without_default_raises_key_error() -> None:
    q = kn.RetainedQueue()
    q[(("a", 0), 0, 1)] = None
    with pytest.raises(KeyError):
        q.pop((("a", 0), 0, 2))
    assert q.pop((("a", 0), 0, 1)) is None and len(q) == 0
    q[(("a", 0), 0, 1)] = "a value other than None"  # kept, by the OrderedDict
    assert q.spilled and q.items() == [((("a", 0), 0, 1), "a value other than None")]
