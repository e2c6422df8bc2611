"""The compiled tier marks (``kvevents_native.SlotMarks``) answer exactly as the Python
:class:`~kvevents.consumers.index.marks.TierMarks`, their specification: random
sequences of marks and unmarks (repeated references, slots beyond one machine word,
keys marked again after their last holder left, tables growing and shrinking) compared
key for key, bitset for bitset and in the same order; the snapshot form and the restore
give them back; and the compiled walk reads them as it reads a dict.  Skipped without
``kvevents-native``."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

kn = pytest.importorskip("kvevents_native")

from kvevents.consumers.index.marks import TierMarks, adopt, as_tier_marks  # noqa: E402
from kvevents.consumers.router.walk import python_walk  # noqa: E402

KEYS = st.one_of(st.integers(0, 40), st.sampled_from([2**64 - 1, 2**63, 1 << 40]))
SLOTS = st.one_of(st.integers(0, 5), st.sampled_from([63, 64, 65, 127, 128, 700]))


def same(native: Any, python: TierMarks) -> None:
    """Every answer of the two marks alike, order included."""
    assert native.items() == list(python.items())
    assert native.keys() == list(python)
    assert list(native) == list(python)
    assert len(native) == len(python)
    assert native.dup_items() == list(python.dups.items())
    for k in python:
        assert native[k] == python[k]
        assert native.get(k, 0) == python.get(k, 0)
        assert k in native


class MarksMachine(RuleBasedStateMachine):
    """Random marks and unmarks on both kinds at once."""

    def __init__(self) -> None:
        super().__init__()
        self.native = kn.SlotMarks()
        self.python = TierMarks()

    @rule(ck=KEYS, slot=SLOTS)
    def mark(self, ck: int, slot: int) -> None:
        self.native.mark(ck, slot)
        self.python.mark(ck, slot)

    @rule(ck=KEYS, slot=SLOTS)
    def unmark(self, ck: int, slot: int) -> None:
        self.native.unmark(ck, slot)
        self.python.unmark(ck, slot)

    @rule(ck=KEYS)
    def unmark_every_holder(self, ck: int) -> None:
        bits = self.python.get(ck, 0)
        for slot in range(bits.bit_length()):
            if bits >> slot & 1:
                self.native.unmark(ck, slot)
                self.python.unmark(ck, slot)

    @rule(first=st.integers(100, 10_000), n=st.integers(1, 300), slot=SLOTS)
    def many_keys(self, first: int, n: int, slot: int) -> None:  # growth past rehashes
        for ck in range(first, first + n):
            self.native.mark(ck, slot)
            self.python.mark(ck, slot)

    @rule(first=st.integers(100, 10_000), n=st.integers(1, 300), slot=SLOTS)
    def drop_keys(self, first: int, n: int, slot: int) -> None:  # shrinking, shifts back
        for ck in range(first, first + n):
            self.native.unmark(ck, slot)
            self.python.unmark(ck, slot)

    @invariant()
    def alike(self) -> None:
        same(self.native, self.python)

    @invariant()
    def snapshot_form_and_restore(self) -> None:
        form = as_tier_marks(self.native)
        assert type(form) is TierMarks
        assert list(form.items()) == list(self.python.items())
        assert list(form.dups.items()) == list(self.python.dups.items())
        restored = adopt(form)  # the running core's kind (TierMarks with KVEVENTS_NATIVE=0)
        if type(restored) is TierMarks:
            assert list(restored.items()) == list(self.python.items())
            assert restored.dups == self.python.dups
        else:
            same(restored, self.python)


TestMarksMachine = MarksMachine.TestCase
TestMarksMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_misses_and_foreign_keys_answer_like_a_dict() -> None:
    m = kn.SlotMarks()
    m.mark(3, 2)
    assert m.get(4) is None and m.get(4, 0) == 0
    for key in (-1, 2**64, "3", 3.5, None):  # no content key equals these
        assert m.get(key, "none") == "none" and key not in m
    with pytest.raises(KeyError):
        m[4]
    with pytest.raises(TypeError):
        m.mark(-1, 0)  # content keys are unsigned 64-bit
    m.unmark(3, 9)  # a slot that does not hold it: nothing changes
    m.unmark(99, 0)
    assert m.items() == [(3, 4)]
    assert m.nbytes > 0


def dict_of(marks: dict[int, int]) -> Any:
    out = kn.SlotMarks()
    for k, bits in marks.items():
        out.load(k, bits)
    return out


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from([1, 64, 65, 130]).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.integers(0, 50), min_size=0, max_size=25),
            st.dictionaries(st.integers(0, 50), st.integers(1, (1 << n) - 1), max_size=40),
            st.integers(0, (1 << n) - 1),
            st.sampled_from([1, 2, 3]),
        )
    )
)
def test_the_walk_reads_slot_marks_as_a_dict(
    a: tuple[int, list[int], dict[int, int], int, int],
) -> None:
    nslots, keys, marks, first, step = a
    native = dict_of(marks)
    assert dict(native.items()) == marks
    ks = [*keys[step - 1 :: step], 2**64 + 5, -3]  # keys no table holds, at the end

    def run(fn: Any, get: Any) -> tuple[Any, list[int]]:
        end = [0] * (nslots + 1)
        pos_bits = [0] + [1 << s for s in range(nslots)]
        nxt = ((2 * step, (1 << nslots) - 1),)
        return fn(ks, get, step, 16, first, {}, 0, end, pos_bits, nxt), end

    expected = run(python_walk, marks.get)
    assert run(kn.walk, native.get) == expected
    assert run(python_walk, native.get) == expected
