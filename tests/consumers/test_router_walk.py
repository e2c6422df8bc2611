"""The router's one prefix walk, against a slot-by-slot reading of its contract.

``walk`` serves every tier and step size of ``find_matches`` (the differential and fleet
tests check the whole); this checks the walk alone on arbitrary key sequences, late
joiners, aligned bases and next-tier chunk classes, one slot at a time.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.consumers.router.walk import walk

UNIT = 16


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    nslots = draw(st.integers(1, 12))
    nkeys = draw(st.integers(0, 14))
    step = draw(st.sampled_from([1, 2, 4]))
    ks = list(range(100, 100 + nkeys))
    full = (1 << nslots) - 1
    # mostly-held keys so that runs are long enough to matter
    marks = {k: draw(st.integers(0, full)) | draw(st.integers(0, full)) for k in ks}
    roles = draw(st.lists(st.sampled_from(["first", "late", "none"]), min_size=nslots,
                          max_size=nslots))  # fmt: skip
    first = 0
    starts: dict[int, int] = {}
    for s, role in enumerate(roles):
        if role == "first":
            first |= 1 << s
        elif role == "late":
            j = draw(st.integers(1, nkeys + 2)) * step
            starts[j] = starts.get(j, 0) | 1 << s
    aligned = draw(st.integers(0, full))
    nclasses = draw(st.integers(0, 2))
    nxt = []
    owner = [draw(st.integers(0, max(nclasses - 1, 0))) for _ in range(nslots)]
    for c in range(nclasses):
        mask = sum(1 << s for s in range(nslots) if owner[s] == c and draw(st.booleans()))
        nxt.append((draw(st.integers(1, 3)) * step, mask))
    return {"nslots": nslots, "ks": ks, "marks": marks, "step": step, "first": first,
            "starts": starts, "aligned": aligned, "nxt": nxt}  # fmt: skip


def reference(c: dict[str, Any]) -> tuple[int, dict[int, int], int, list[int]]:
    nslots, ks, marks, step = c["nslots"], c["ks"], c["marks"], c["step"]
    credited, naligned = 0, 0
    nstarts: dict[int, int] = {}
    end = [-1] * (nslots + 1)
    for s in range(nslots):
        bit = 1 << s
        if c["first"] & bit:
            join, late = step, False
        else:
            found = [j for j, b in c["starts"].items() if b & bit]
            if not found:
                continue
            join, late = found[0], True
        i = join // step - 1
        run = 0
        while i + run < len(ks) and marks[ks[i + run]] & bit:
            run += 1
        if not run:
            continue  # missed the key it joined at: no hit
        e = (i + run) * step
        if late and run == 1 and not c["aligned"] & bit:
            continue  # its run is the one chunk holding its unaligned base
        credited |= bit
        end[s + 1] = e * UNIT
        for v, mask in c["nxt"]:
            if mask & bit:
                f = (e // v + 1) * v
                nstarts[f] = nstarts.get(f, 0) | bit
                if e % v == 0:
                    naligned |= bit
    return credited, nstarts, naligned, end


@settings(max_examples=400, deadline=None)
@given(c=cases())
def test_walk_matches_its_contract_slot_by_slot(c: dict[str, Any]) -> None:
    nslots = c["nslots"]
    end = [-1] * (nslots + 1)
    pos_bits = [0] + [1 << s for s in range(nslots)]
    got = walk(c["ks"], c["marks"].get, c["step"], UNIT, c["first"], c["starts"],
               c["aligned"], end, pos_bits, c["nxt"])  # fmt: skip
    credited, nstarts, naligned, want_end = reference(c)
    assert end == want_end
    assert got[0] == credited
    if c["nxt"]:
        assert got[1] == nstarts
        assert got[2] == naligned
    else:
        assert got[1] == {}
