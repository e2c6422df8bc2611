"""The optional compiled core against pure Python, on the index's and router's hot paths.

Both builds cannot share a process, so each measurement runs in a fresh process, the
builds alternating: pure (``KVEVENTS_PURE_PYTHON=1``), compiled, pure, compiled, ...
(5 rounds each, ``KVEVENTS_BENCH_ROUNDS`` to change; 1 with ``--quick``).  Times are the
process's CPU time (``time.process_time``), not wall time: on a shared machine the
others' load shows far less in it, and the work is single-threaded.  Each process runs
the workloads of ``benchmarks/index.py``:

* ``apply``: block-events/s of the four-engine stream, decode excluded and included
  (best of 7 passes, each into a fresh index);
* ``find_matches`` and ``Router.select`` p50 for an 8k-token prompt over 100 and 1,000
  workers (all or 1% hold it; 100 only with ``--quick``);
* ``find_matches`` p50 for a LoRA request and for a hybrid (full + sliding-window) fleet
  of 100 workers.

For each metric the table shows the compiled build's median over the rounds with the
pure build's median as the baseline (``ratio`` = compiled / pure: above 1 is faster for
rates, below 1 is faster for latencies); the JSON line keeps every round.  Without a
compiled build (``python -m kvevents.compiled build``) it prints one line and exits 0.

Run: ``python benchmarks/compiled.py [--quick]``.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import report, result

from kvevents import compiled

ROOT = Path(__file__).resolve().parent.parent


#: CPU time of this process: on a shared machine other processes' load shows in wall time
#: far more than in it, and both builds do the same single-threaded work.
clock = time.process_time


def _p50(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2] * 1e3


def _best(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def work(quick: bool) -> list[dict[str, Any]]:
    """One process's measurements (the build is whatever imports picked)."""
    from index import BPC, block_events, engine_stream, populate, populate_keyed

    from kvevents.codec import BatchDecoder, encode_batch
    from kvevents.consumers.index import BlockIndex
    from kvevents.consumers.router import Router
    from kvevents.request import RequestKey

    streams = [engine_stream(60 if quick else 600, seed) for seed in range(4)]
    payloads = [[encode_batch(b) for b in s] for s in streams]
    total = sum(block_events(s) for s in streams)
    decoder = BatchDecoder()

    def run_index() -> None:
        index = BlockIndex(blocks_per_chunk=BPC)
        for e, s in enumerate(streams):
            for b in s:
                index.apply("engine", e, b)

    def run_decode_index() -> None:
        index = BlockIndex(blocks_per_chunk=BPC)
        for e, ps in enumerate(payloads):
            for p in ps:
                index.apply("engine", e, decoder.decode(p))

    repeat = 3 if quick else 7
    rows = [
        {"metric": "apply, decode excluded", "value": total / _best(run_index, repeat),
         "unit": "block-events/s"},
        {"metric": "apply, decode included", "value": total / _best(run_decode_index, repeat),
         "unit": "block-events/s"},
    ]  # fmt: skip
    rng = random.Random(7)
    prompt = [rng.randrange(50_000) for _ in range(8192)]
    reps = 20 if quick else 200
    for workers in (100,) if quick else (100, 1000):
        for every, label in ((1, "all hold it"), (100, "1% hold it")):
            router = Router(populate(workers, prompt, rng, every))
            router.find_matches(prompt)
            router.select(prompt)
            gc.collect()
            find: list[float] = []
            select: list[float] = []
            for _ in range(reps):  # alternately, so drift hits both alike
                t0 = clock()
                router.find_matches(prompt)
                t1 = clock()
                router.select(prompt)
                t2 = clock()
                find.append(t1 - t0)
                select.append(t2 - t1)
            name = f"8k tok x {workers} w, {label} p50"
            rows.append({"metric": f"find_matches {name}", "value": _p50(find), "unit": "ms"})
            rows.append({"metric": f"select {name}", "value": _p50(select), "unit": "ms"})
            del router
            gc.collect()
    for label, key, window in (
        ("LoRA request", RequestKey(prompt, lora_name="adapter-7"), 0),
        ("hybrid full + sliding window", RequestKey(prompt), 1024),
    ):
        router = Router(populate_keyed(100, key, random.Random(5), window=window))
        query: Any = key if window == 0 else prompt
        assert router.find_matches(query), label
        samples = []
        for _ in range(reps if window == 0 else reps // 4):
            t0 = clock()
            router.find_matches(query)
            samples.append(clock() - t0)
        name = f"find_matches 8k tok x 100 w, {label} p50"
        rows.append({"metric": name, "value": _p50(samples), "unit": "ms"})
    return rows


def _run_worker(pure: bool, quick: bool) -> list[dict[str, Any]]:
    env = dict(os.environ)
    env.pop(compiled.PURE_ENV, None)
    if pure:
        env[compiled.PURE_ENV] = "1"
    cmd = [sys.executable, __file__, "--worker", "pure" if pure else "compiled"]
    out = subprocess.run(
        cmd + (["--quick"] if quick else []),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    rows: list[dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])
    return rows


def main() -> None:
    argv = sys.argv[1:]
    quick = "--quick" in argv
    if "--worker" in argv:
        want = argv[argv.index("--worker") + 1]
        rows = work(quick)
        loaded = compiled.status().loaded
        if (want == "compiled") != bool(loaded):
            raise SystemExit(f"asked for the {want} build, got compiled modules {loaded}")
        print(json.dumps(rows))
        return
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return
    st = compiled.status()
    if not st.active:
        print(f"compiled core: not measured ({compiled.describe()})")
        return
    rounds = 1 if quick else int(os.environ.get("KVEVENTS_BENCH_ROUNDS", "5"))
    runs: dict[str, list[list[dict[str, Any]]]] = {"pure": [], "compiled": []}
    for r in range(rounds):
        for build in ("pure", "compiled"):
            t0 = time.perf_counter()
            runs[build].append(_run_worker(build == "pure", quick))
            load = os.getloadavg()[0]
            print(f"round {r + 1} {build}: {time.perf_counter() - t0:.0f} s, load {load:.2f}")
    results = []
    for i, row in enumerate(runs["compiled"][0]):
        comp = statistics.median(run[i]["value"] for run in runs["compiled"])
        pure = statistics.median(run[i]["value"] for run in runs["pure"])
        res = result(row["metric"] + " (compiled vs pure)", comp, row["unit"], pure)
        res["rounds"] = {b: [run[i]["value"] for run in runs[b]] for b in runs}
        results.append(res)
    report("compiled", results)


if __name__ == "__main__":
    main()
