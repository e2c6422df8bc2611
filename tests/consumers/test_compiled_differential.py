"""The compiled core and pure Python give identical answers (differential, two processes).

The optional compiled core (``python -m kvevents.compiled build``) compiles the index's
and the router walk's modules with mypyc from the same source.  Each build runs the same
random workload in its own process (``_compiled_workload.py``: a msgpack stream with
placeholders, self-describing chunks, removals, clears and a small cap; LoRA, salted and
multimodal request keys; a hybrid worker), and every answer must match exactly:
``find_matches`` / ``select`` / ``score`` along the way, counters, gauges, summaries, the
snapshot's bytes, the restored index's answers, and each build restoring the other's
snapshot.  Skipped when no fresh compiled build is present (the default: a plain install
is pure Python).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvevents import compiled

WORKLOAD = Path(__file__).resolve().parent / "_compiled_workload.py"

_st = compiled.status()
if not _st.present:
    _why = "no compiled core built (python -m kvevents.compiled build)"
elif _st.stale:
    _why = f"the compiled core is stale ({_st.stale[0]} changed since the build)"
else:
    _why = ""
pytestmark = pytest.mark.skipif(bool(_why), reason=_why)


def _run(pure: bool, seed: int, *extra: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != compiled.PURE_ENV}
    if pure:
        env[compiled.PURE_ENV] = "1"
    out = subprocess.run(
        [sys.executable, str(WORKLOAD), str(seed), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize("seed", [1, 2])
def test_both_builds_answer_the_same_stream_identically(seed: int, tmp_path: Path) -> None:
    pure_snap, comp_snap = tmp_path / "pure.snap", tmp_path / "compiled.snap"
    pure = _run(True, seed, "--snapshot-out", str(pure_snap))
    comp = _run(False, seed, "--snapshot-out", str(comp_snap), "--restore", str(pure_snap))
    assert pure.pop("loaded") == []
    assert comp.pop("loaded") == [m for m in compiled.MODULES if m in _st.present]
    # the pure build restores the compiled build's snapshot, and answers as it did
    back = _run(True, seed, "--restore", str(comp_snap))
    assert back["cross_restored"] == comp["restored"]
    assert comp.pop("cross_restored") == pure["restored"]
    assert pure["stats"]["evicted_by_cap"] > 0 and pure["stats"]["joined_late"] > 0
    assert any(any(q) for q in pure["queries"])  # the queries found something
    for key in pure:
        assert comp[key] == pure[key], key
    assert comp == pure
