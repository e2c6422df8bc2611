"""The compiled prefix walk and assembly answer exactly as the Python ones: random walks
of every argument shape (late joins, credit rules, one or several next-tier chunk
classes, bitsets wider than a machine word), random per-slot ends (sparse and dense
paths, workers with several slots, positions without a worker), and whole routers over
random indexes, compared answer for answer.  Skipped without ``kvevents-native``."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

kn = pytest.importorskip("kvevents_native")

from kvevents.consumers.router import Router  # noqa: E402
from kvevents.consumers.router import walk as walk_module  # noqa: E402
from kvevents.consumers.router.walk import python_walk  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@st.composite
def walk_args(draw: st.DrawFn) -> dict[str, Any]:
    nslots = draw(st.sampled_from([1, 3, 8, 63, 64, 65, 130]))
    bits = st.integers(0, (1 << nslots) - 1)
    nkeys = draw(st.integers(0, 30))
    keys = [draw(st.integers(0, 2**64 - 1)) for _ in range(nkeys)]
    # a key is held by a random set of slots, and slots tend to hold prefixes
    marks: dict[int, int] = {}
    held = draw(bits)
    for k in keys:
        if draw(st.integers(0, 5)) == 0:
            continue  # nobody holds it
        held &= draw(st.one_of(bits, st.just((1 << nslots) - 1)))
        marks[k] = held | draw(st.sampled_from([0, 0, 0, draw(bits)]))
    step = draw(st.sampled_from([1, 2, 4]))
    ks = keys[step - 1 :: step]
    starts = {
        step * draw(st.integers(1, max(1, len(ks) + 1))): draw(bits)
        for _ in range(draw(st.integers(0, 3)))
    }
    classes = st.tuples(st.sampled_from([1, 2, 3, 4, 8]), bits)
    nxt = draw(st.one_of(st.just(()), st.lists(classes, min_size=1, max_size=3)))
    return {
        "ks": ks,
        "marks": marks,
        "step": step,
        "unit": draw(st.sampled_from([1, 16])),
        "first": draw(st.one_of(st.just(0), bits)),
        "starts": starts,
        "aligned": draw(bits),
        "nslots": nslots,
        "end": [draw(st.integers(0, 5)) for _ in range(nslots + 1)],
        "nxt": nxt,
    }


def run(fn: Any, a: dict[str, Any], use_get: bool) -> tuple[Any, list[int]]:
    end = list(a["end"])
    pos_bits = [0] + [1 << s for s in range(a["nslots"])]
    marks = a["marks"]
    get = marks.get if use_get else (lambda k, d: marks.get(k, d))
    out = fn(a["ks"], get, a["step"], a["unit"], a["first"], dict(a["starts"]), a["aligned"],
             end, pos_bits, a["nxt"])  # fmt: skip
    return out, end


@settings(max_examples=1500, deadline=None)
@given(walk_args(), st.booleans())
def test_random_walks_answer_alike(a: dict[str, Any], use_get: bool) -> None:
    assert run(kn.walk, a, use_get) == run(python_walk, a, use_get)


@pytest.mark.parametrize("every", [1, 3, 100])
def test_routers_answer_alike_with_either_walk(every: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from index import populate  # benchmarks/index.py: workers holding random prefixes

    rng = random.Random(every)
    prompt = [rng.randrange(50_000) for _ in range(2048)]
    router = Router(populate(150, prompt, rng, every))
    prompts = [prompt, prompt[:1000], prompt[:17], [rng.randrange(50_000) for _ in range(512)]]
    from kvevents.consumers.router.match import Match

    monkeypatch.setattr(walk_module, "walk", walk_module.named_walk(kn.walk))
    monkeypatch.setattr(walk_module, "assemble", kn.assembler(Match))
    native = [(router.find_matches(p), router.score(p)) for p in prompts]
    monkeypatch.setattr(walk_module, "walk", python_walk)
    monkeypatch.setattr(walk_module, "assemble", walk_module.python_assemble)
    python = [(router.find_matches(p), router.score(p)) for p in prompts]
    assert native == python
    assert any(m for m, _ in native)


def test_errors_surface_as_python_errors() -> None:
    with pytest.raises(IndexError):  # an end list too short for a slot, as in Python
        kn.walk([1], {1: 0b100}.get, 1, 1, 0b100, {}, 0, [0, 0], [0, 1, 2, 4], ())
    with pytest.raises(TypeError):
        kn.walk([1], None, 1, 1, 1, {}, 0, [0, 0], [0, 1], ())


@st.composite
def ends_args(draw: st.DrawFn) -> dict[str, Any]:
    nslots = draw(st.sampled_from([1, 5, 16, 64, 65, 200]))
    ends = st.lists(st.integers(0, 4096), min_size=nslots + 1, max_size=nslots + 1)
    gpu = draw(ends)
    cpu = draw(st.one_of(st.none(), ends))
    storage = draw(st.one_of(st.none(), ends))
    # ends grow tier by tier, as the walk leaves them
    if cpu is not None:
        cpu = [g + c for g, c in zip(gpu, cpu)]
    if storage is not None:
        base = cpu if cpu is not None else gpu
        storage = [b + s for b, s in zip(base, storage)]
    for lst in (gpu, cpu, storage):
        if lst is not None:
            lst[0] = 0
    wids: list[Any] = [None] + [
        draw(st.sampled_from([None, ("w", i), ("w", i // 2)])) for i in range(nslots)
    ]
    last = storage if storage is not None else cpu if cpu is not None else gpu
    exact = sum(1 << (p - 1) for p in range(1, nslots + 1) if last[p])
    hit = draw(st.sampled_from([-1, exact, exact | draw(st.integers(0, (1 << nslots) - 1))]))
    return {"nslots": nslots, "pos_wids": wids, "ends": (gpu, cpu, storage), "hit": hit}


@settings(max_examples=800, deadline=None)
@given(ends_args())
def test_random_assemblies_answer_alike(a: dict[str, Any]) -> None:
    from types import SimpleNamespace

    from kvevents.consumers.router.match import Match
    from kvevents.consumers.router.walk import python_assemble

    lay = SimpleNamespace(nslots=a["nslots"], pos_wids=a["pos_wids"],
                          pos_bits=[0] + [1 << s for s in range(a["nslots"])])  # fmt: skip
    native = kn.assembler(Match)(lay, *a["ends"], a["hit"])
    python = python_assemble(lay, *a["ends"], a["hit"])  # type: ignore[arg-type]
    assert native == python
    assert list(native) == list(python)  # the same order
    assert all(type(m) is Match for m in native.values())


def test_assembly_out_of_range_is_an_index_error() -> None:
    from types import SimpleNamespace

    from kvevents.consumers.router.match import Match

    lay = SimpleNamespace(nslots=64, pos_wids=[None, "a"])
    with pytest.raises(IndexError):
        kn.assembler(Match)(lay, [0, 16], None, None, 1 << 40)
