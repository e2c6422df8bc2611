"""The router's latency tail and the garbage collector.

``Router.find_matches`` for an 8k-token prompt over 1,000 workers (the index of
``benchmarks/floors.py``: every worker holds a random-length prefix), called back to
back.  Each call builds about 2,000 container objects (a ``Match`` per worker, the answer
and the walk's per-slot lists), so the collector's first generation runs about once a
call, and what is alive during those passes is promoted until a full collection runs:
one that traverses every tracked object of the process, the imported modules and the
index's retention room (an ``OrderedDict`` the collector cannot untrack) included.

Three modes, each in a fresh process, alternated over ``--rounds`` rounds:

* ``as is``: the index loaded, one ``gc.collect()``;
* ``frozen at start``: ``gc.collect(); gc.freeze()`` once the modules are imported and
  the empty index is built, before it is loaded (what ``kvevents serve`` does at start);
* ``frozen after loading``: the same once the index is loaded.

The rows give each mode's p50, p99, p99.9 and worst call, the full collections' count
and mean duration, and one ``gc.collect()`` after the calls; the frozen modes' rows
have the ``as is`` figure as baseline.  ``--quick`` runs 100 workers and a few hundred
calls, one round.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import arg_parser, count, report, result
from index import BPC, populate

from kvevents.consumers import BlockIndex, Router

MODES = ("as is", "frozen at start", "frozen after loading")


class _FullCollections:
    """Durations (seconds) of the collector's full (generation 2) passes while active."""

    def __init__(self) -> None:
        self.durations: list[float] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif info["generation"] == 2:
            self.durations.append(time.perf_counter() - self._start)

    def __enter__(self) -> _FullCollections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def run_mode(mode: str, workers: int, calls: int) -> dict[str, Any]:
    """One mode in this process: call times and full-collection times, in seconds."""
    rng = random.Random(7)
    prompt = [rng.randrange(50_000) for _ in range(8192)]
    gc.collect()
    index = BlockIndex(blocks_per_chunk=BPC)
    if mode == "frozen at start":
        gc.collect()
        gc.freeze()
    populate(workers, prompt, rng, 1, index)
    router = Router(index)
    router.find_matches(prompt)
    gc.collect()
    if mode == "frozen after loading":
        gc.freeze()
    times: list[float] = []
    with _FullCollections() as full:
        for _ in range(calls):
            t0 = time.perf_counter()
            router.find_matches(prompt)
            times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    gc.collect()
    return {"times": times, "full": full.durations, "collect": time.perf_counter() - t0}


def _pct(sorted_s: list[float], q: float) -> float:
    return sorted_s[min(len(sorted_s) - 1, int(len(sorted_s) * q))] * 1e3


def main() -> None:
    p = arg_parser(__doc__ or "")
    p.add_argument("--rounds", type=count, default=2, help="alternated rounds (default 2)")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # (a child process)
    args = p.parse_args()
    workers = 100 if args.quick else 1000
    calls = 300 if args.quick else 3000
    if args.mode:
        print(json.dumps(run_mode(args.mode, workers, calls)))
        return
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for _ in range(1 if args.quick else args.rounds):
        for mode in MODES:  # a fresh process each: one mode's heap never meets another's
            cmd = [sys.executable, __file__, "--mode", mode] + (["--quick"] if args.quick else [])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[mode].append(json.loads(out.splitlines()[-1]))
    stats: dict[str, dict[str, float]] = {}
    for mode, rs in runs.items():
        s = sorted(t for r in rs for t in r["times"])
        full = [d for r in rs for d in r["full"]]
        stats[mode] = {
            "p50": _pct(s, 0.5),
            "p99": _pct(s, 0.99),
            "p99.9": _pct(s, 0.999),
            "worst": s[-1] * 1e3,
            "full": len(full) / len(rs),
            "full_ms": sum(full) / len(full) * 1e3 if full else 0.0,
            "collect": min(r["collect"] for r in rs) * 1e3,
        }
    label = f"find_matches 8k tok x {workers} w"
    rows = []
    for key, name, unit in (
        ("p50", "p50", "ms"),
        ("p99", "p99", "ms"),
        ("p99.9", "p99.9", "ms"),
        ("worst", "worst call", "ms"),
        ("full", f"full collections per {calls} calls", "passes"),
        ("full_ms", "full collection, mean", "ms"),
        ("collect", "gc.collect() afterwards", "ms"),
    ):
        base = stats["as is"][key]
        for mode in MODES:
            tail = "" if mode == "as is" else " (vs as is)"
            rows.append(
                result(
                    f"{label}, {name}: {mode}{tail}",
                    stats[mode][key],
                    unit,
                    None if mode == "as is" else base or None,
                )
            )
    report("router_gc", rows)


if __name__ == "__main__":
    main()
