"""The compiled per-worker lookup (``kvevents_native.Lookups``) answers exactly as
:func:`~kvevents.consumers.router.lookup.lookup_matches` and its
:class:`~kvevents.consumers.router.lookup.WorkerLookup`, their specification: random
plans (full-attention, sliding-window and chunked-local groups of several block sizes,
groups of several slots, EAGLE's drop, unknown chunk sizes, blocked plans), random tier
marks (slots beyond one machine word, CPU and STORAGE chunks, empty tiers), with and
without the full-attention prefix, compared answer for answer and in the same order; and
whole routers over hybrid fleets answer alike with either lookup.  Skipped without
``kvevents-native``."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

kn = pytest.importorskip("kvevents_native")
if not hasattr(kn, "Lookups"):
    pytest.skip("kvevents-native built before Lookups: rebuild it", allow_module_level=True)

from kvevents.consumers.index import BlockIndex, LookupPlan, SpecGroup  # noqa: E402
from kvevents.consumers.router import Router  # noqa: E402
from kvevents.consumers.router.lookup import compiled_lookups, lookup_matches  # noqa: E402
from kvevents.consumers.router.match import Match  # noqa: E402
from kvevents.native import NATIVE  # noqa: E402
from kvevents.request import RequestKey  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@st.composite
def plan(draw: st.DrawFn, wid: int, unit: int, nslots: int) -> LookupPlan:
    """One worker's plan, shaped as :func:`~kvevents.consumers.index.layout.lookup_plan`
    builds them (full-attention groups first, alignment the lcm of the block sizes)."""
    members = []  # (cls, block size, window, slot)
    for _ in range(draw(st.integers(1, 4))):
        cls = draw(st.sampled_from(["full", "full", "sw", "local"]))
        size = unit * draw(st.sampled_from([1, 2, 3, 4]))
        window = 0 if cls == "full" else draw(st.integers(1, 12 * unit))
        members.append((cls, size, window, draw(st.integers(0, nslots - 1))))
    spec: dict[tuple[str, int, int], list[int]] = {}
    for cls, size, window, slot in members:
        slots = spec.setdefault((cls, size, window), [])
        if slot not in slots:
            slots.append(slot)
    order = sorted(spec.items(), key=lambda kv: kv[0][0] != "full")
    groups = tuple(
        SpecGroup(c, b, w, sum(1 << s for s in slots), tuple(slots)) for (c, b, w), slots in order
    )
    bpc = draw(st.sampled_from([0, 1, 2, 4]))
    chunk_groups = []
    for cls, size, window, slot in sorted(members, key=lambda m: m[0] != "full"):
        tpc = bpc * size
        wchunks = 0 if cls == "full" or not tpc else -(-window // tpc)
        chunk_groups.append((cls, size, wchunks, 1 << slot))
    return LookupPlan(
        wid=("w", wid),
        blocked=draw(st.sampled_from([None, None, None, None, "kind:mamba"])),
        unitary=len(members) == 1,
        spec_groups=groups,
        align=math.lcm(*(m[1] for m in members)),
        chunk_groups=tuple(chunk_groups),
        windowed=any(m[0] != "full" for m in members),
        bpc=bpc,
        lookahead=0,
        eagle=draw(st.booleans()) and not any(m[0] == "local" for m in members),
    )


@st.composite
def lookup_args(draw: st.DrawFn) -> dict[str, Any]:
    nslots = draw(st.sampled_from([2, 5, 64, 70]))
    unit = draw(st.sampled_from([1, 2, 16]))
    n = draw(st.integers(2, 60)) * unit + draw(st.integers(0, unit - 1))
    keys = [draw(st.integers(0, 2**64 - 1)) for _ in range(n // unit)]
    bits = st.integers(0, (1 << nslots) - 1)
    every = (1 << nslots) - 1
    tiers: list[dict[int, int]] = []
    for tier in range(3):
        marks: dict[int, int] = {}
        if tier == 0 or draw(st.booleans()):
            held = draw(st.one_of(bits, st.just(every)))
            for k in keys:  # slots tend to hold prefixes, windows tails
                if draw(st.integers(0, 6)) == 0:
                    held = draw(st.one_of(bits, st.just(every)))
                v = held & draw(st.one_of(st.just(every), bits))
                if v:
                    marks[k] = v
        tiers.append(marks)
    plans = [draw(plan(w, unit, nslots)) for w in range(draw(st.integers(1, 6)))]
    prefix = None
    if draw(st.booleans()):
        cap = (n - 1) // unit * unit
        prefix = [0] + [draw(st.integers(0, cap)) for _ in range(nslots)]
    return {"unit": unit, "n": n, "keys": keys, "tiers": tiers, "plans": plans, "prefix": prefix}


def native_answer(a: dict[str, Any]) -> dict[Any, Match]:
    marks = []
    for tier in a["tiers"]:
        m = kn.SlotMarks()
        for k, v in tier.items():
            m.load(k, v)
        marks.append(m)
    out: dict[Any, Match] = {}
    kn.Lookups(a["plans"], Match).matches(*marks, a["keys"], a["n"], a["unit"], a["prefix"], out)
    return out


def python_answer(a: dict[str, Any]) -> dict[Any, Match]:
    tiers = a["tiers"]
    index = SimpleNamespace(canonical_block_size=a["unit"], marks=lambda t: tiers[t])
    key = RequestKey([7] * a["n"])
    out: dict[Any, Match] = {}
    lookup_matches(cast(BlockIndex, index), key, a["keys"], a["prefix"], a["plans"], out)
    return out


@settings(max_examples=1500, deadline=None)
@given(lookup_args())
def test_random_lookups_answer_alike(a: dict[str, Any]) -> None:
    native = native_answer(a)
    python = python_answer(a)
    assert native == python
    assert list(native) == list(python)  # the same order
    assert all(type(m) is Match for m in native.values())


@pytest.mark.skipif(NATIVE is None, reason="the index keeps SlotMarks only with the core")
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hybrid_routers_answer_alike_with_either_lookup(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from index import populate_keyed  # benchmarks/index.py: hybrid workers, random prefixes

    rng = random.Random(seed)
    prompt = [rng.randrange(50_000) for _ in range(2048)]
    router = Router(populate_keyed(60, RequestKey(prompt), rng, window=256))
    prompts = [prompt, prompt[:1000], prompt[:17], [rng.randrange(50_000) for _ in range(512)]]
    assert router._compiled_lookups(router.index.layout()) is not None
    native = [(router.find_matches(p), router.score(p)) for p in prompts]
    monkeypatch.setattr(Router, "_compiled_lookups", lambda self, lay: None)
    python = [(router.find_matches(p), router.score(p)) for p in prompts]
    assert native == python
    assert [list(m) for m, _ in native] == [list(m) for m, _ in python]
    assert any(m for m, _ in native)


def test_what_the_compiled_lookup_takes() -> None:
    sg = SpecGroup("full", 16, 0, 0b1, (0,))
    base = LookupPlan(("w", 0), None, True, (sg,), 16, (("full", 16, 0, 1),), False, 4, 0, False)
    assert (compiled_lookups([base]) is not None) == (NATIVE is not None)
    ahead = LookupPlan(("w", 1), None, True, (sg,), 16, (), False, 4, 1, False)
    assert compiled_lookups([base, ahead]) is None  # lookahead: looked up in Python
    blocked = LookupPlan(("w", 1), "kind:mamba", True, (sg,), 16, (), False, 4, 1, False)
    assert len(kn.Lookups([base, blocked], Match)) == 1
    wrong = LookupPlan(("w", 2), None, True, (SpecGroup("full", 16, 0, 0b10, (0,)),), 16, (),
                       False, 4, 0, False)  # fmt: skip
    with pytest.raises(ValueError):  # bits that are not the group's slots
        kn.Lookups([wrong], Match)
    with pytest.raises(ValueError):  # a block shorter than a content-key unit
        m = kn.SlotMarks()
        kn.Lookups([base], Match).matches(m, m, m, [1, 2], 40, 32, None, {})
    with pytest.raises(IndexError):  # a full-attention slot past the prefix, as in Python
        m = kn.SlotMarks()
        kn.Lookups([base], Match).matches(m, m, m, [1, 2], 40, 16, [0], {})
