"""The compiled core (``kvevents-native``) against the same run's baselines.

What runs natively today is the wire parser (with the content keys of every block it
reads), the content keys of a prompt, the index's tier marks, the router's prefix walk
and the assembly of its answer; the rest of the index and the per-worker hybrid rules are
Python in both modes.  Rows:

* ``stream``: block-events/s from msgpack bytes, 4 engines' streams as in
  ``benchmarks/index.py`` (GPU stores of 8-16 blocks, CPU placeholders, one-hash
  removals).  Baseline: vLLM 0.33's typed decoder (``msgspec.msgpack.Decoder`` of its
  ``KVEventBatch``; the stand-in of ``benchmarks/vs_vllm.py`` when vLLM is absent) merely
  decoding the same bytes.  Ours: the native parse alone, and the native parse plus the
  content key of every stored block (chained from the root: the parent's key is the
  index's business), against the Python path doing the same (``BatchDecoder.decode`` plus
  ``content.chain_units`` per block).
* ``prompt keys``: the 512 content keys of an 8,192-token prompt, native vs the Python
  chain (``kvevents.consumers.content`` with the core switched off), in ms.
* ``find_matches``: an 8,192-token prompt over 1,000 workers (100 with ``--quick``), all
  of them or 1% holding a random prefix of it and the others as much of another prompt
  (``benchmarks/index.py``'s ``populate``), p50 and p99 in ms.  The compiled core (prompt
  keys, the index's tables in flat native storage, walk, assembly) against the goal's
  floor (a Python loop of one dict lookup per block over the prompt's 512 keys, sampled
  alternately), the goal's p99 (0.25 ms), and the same index kept and walked by the
  Python core (measured next, each core's index alone in the process: a full garbage
  collection walks every Python container alive).

Run: ``python benchmarks/native.py [--quick]`` (skips, saying so, when the core does not
run: ``pip install ./native``, and ``KVEVENTS_NATIVE`` not ``0``).
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec
from _common import best_rate, parse_args, report, result
from index import BS, block_events, engine_stream, populate
from vs_vllm import reference

import kvevents.consumers.content as content
import kvevents.consumers.index.marks as marks_module
import kvevents.consumers.router.walk as walk_module
from kvevents import BatchDecoder, BlockStored, encode_batch
from kvevents.consumers.router import Router
from kvevents.native import NATIVE as kn
from kvevents.native import core_name

UNIT = 16
P99_GOAL_MS = 0.25
"""The issue's goal for find_matches' p99, 8,192 tokens x 1,000 workers."""


def bench_stream(quick: bool) -> list[dict[str, Any]]:
    streams = [engine_stream(60 if quick else 600, seed) for seed in range(4)]
    payloads = [encode_batch(b) for s in streams for b in s]
    total = sum(block_events(s) for s in streams)
    ref, label = reference(verbose=False)
    vllm_decoder = msgspec.msgpack.Decoder(ref.KVEventBatch)
    decoder = BatchDecoder()
    parse = kn.parse_batch
    chain = content.chain_units
    kw: dict[str, Any] = {"repeat": 1 if quick else 5, "min_time": 0.05 if quick else 0.5}
    for p in payloads:  # every payload of this stream is read natively
        if parse(p) is None:
            raise AssertionError("a payload fell back to the Python decoder")

    def vllm_decode() -> int:
        for p in payloads:
            vllm_decoder.decode(p)
        return total

    def native_parse() -> int:
        for p in payloads:
            parse(p)
        return total

    def native_keyed() -> int:
        for p in payloads:
            b = parse(p)
            for i in range(len(b)):
                if b.kind(i) == 0:
                    b.block_keys(i, 0, UNIT)
        return total

    def python_keyed() -> int:
        for p in payloads:
            for ev in decoder.decode(p).events:
                if type(ev) is BlockStored and ev.block_size and ev.token_ids:
                    k, bs, toks = 0, ev.block_size, ev.token_ids
                    for j in range(len(ev.block_hashes)):
                        k = chain(k, toks[j * bs : (j + 1) * bs], UNIT)
        return total

    saved = content.NATIVE
    content.NATIVE = None  # the Python chain for the Python row
    try:
        rates = {}
        for name, fn in (
            ("vllm", vllm_decode),
            ("parse", native_parse),
            ("keyed", native_keyed),
            ("python", python_keyed),
        ):
            rates[name] = best_rate(fn, **kw) / 1e6
    finally:
        content.NATIVE = saved
    base = rates["vllm"]
    return [
        result(f"stream: {label} typed decode of the bytes (baseline)", base, "M block-events/s"),
        result("stream: native parse (vs vLLM decode)", rates["parse"], "M block-events/s", base),
        result(
            "stream: native parse + content key per block (vs vLLM decode)",
            rates["keyed"],
            "M block-events/s",
            base,
        ),
        result(
            "stream: Python decode + content key per block (vs vLLM decode)",
            rates["python"],
            "M block-events/s",
            base,
        ),
    ]


def _pct(s: list[float], q: float) -> float:
    s = sorted(s)
    return s[min(len(s) - 1, int(len(s) * q))] * 1e3


def use_core(on: bool) -> None:
    """Switch the compiled prompt keys and walk on or off (the Python index below keeps
    dict marks, which the Python walk reads)."""
    content.NATIVE = kn if on else None
    walk_module.walk = walk_module.named_walk(kn.walk) if on else walk_module.python_walk


def python_index(workers: int, prompt: list[int], seed: int, every: int) -> Any:
    """``populate``'s index with the Python core's marks (``TierMarks``)."""
    saved = marks_module.NATIVE
    marks_module.NATIVE = None
    try:
        return populate(workers, prompt, random.Random(seed), every)
    finally:
        marks_module.NATIVE = saved


def bench_keys_and_find(quick: bool) -> list[dict[str, Any]]:
    """``find_matches`` with the compiled core against the goal's floor (a Python loop of
    one dict lookup per block over the prompt's keys) and the same index kept and walked
    by the Python core."""
    rng = random.Random(7)
    workers = 100 if quick else 1000
    prompt = [rng.randrange(50_000) for _ in range(8192)]
    rows = []
    reps = 20 if quick else 300
    use_core(False)
    keys = content.prompt_keys(prompt, UNIT)
    use_core(True)
    if content.prompt_keys(prompt, UNIT) != keys:
        raise AssertionError("the native and the Python prompt keys differ")
    for every, what in ((1, "all hold a prefix"), (100, "1% hold a prefix")):
        # each core's index alone in the process: a full garbage collection walks every
        # Python container alive, the other core's index's included
        native = Router(populate(workers, prompt, random.Random(every), every))
        want = native.find_matches(prompt)
        gpu = dict(native.index.marks(0).items())
        find_n: list[float] = []
        floor: list[float] = []
        for _ in range(reps):  # alternately, so the machine's drift hits both
            t0 = time.perf_counter()
            native.find_matches(prompt)
            t1 = time.perf_counter()
            get = gpu.get
            for k in keys:
                get(k)
            t2 = time.perf_counter()
            find_n.append(t1 - t0)
            floor.append(t2 - t1)
        del native, gpu
        python = Router(python_index(workers, prompt, every, every))
        find_p: list[float] = []
        try:
            use_core(False)
            if python.find_matches(prompt) != want:
                raise AssertionError("the native and the Python core route differently")
            for _ in range(reps):
                t0 = time.perf_counter()
                python.find_matches(prompt)
                find_p.append(time.perf_counter() - t0)
        finally:
            use_core(True)
        del python
        label = f"find_matches 8k tok x {workers} w, {what}"
        rows += [
            result(f"{label}: p50 (vs floor)", _pct(find_n, 0.5), "ms", _pct(floor, 0.5)),
            result(f"{label}: p99 (vs goal)", _pct(find_n, 0.99), "ms", P99_GOAL_MS),
            result(f"{label}: p50 (vs Python core)", _pct(find_n, 0.5), "ms", _pct(find_p, 0.5)),
            result(f"{label}: p99 (vs Python core)", _pct(find_n, 0.99), "ms", _pct(find_p, 0.99)),
        ]
    return rows


def bench_prompt_keys(quick: bool) -> list[dict[str, Any]]:
    rng = random.Random(8)
    prompt = [rng.randrange(50_000) for _ in range(8192)]
    native: list[float] = []
    python: list[float] = []
    for _ in range(20 if quick else 300):
        for on, out in ((True, native), (False, python)):
            use_core(on)
            t0 = time.perf_counter()
            content.prompt_keys(prompt, UNIT)
            out.append(time.perf_counter() - t0)
    use_core(True)
    return [
        result("prompt keys 8k tok p50 (vs Python)", _pct(native, 0.5), "ms", _pct(python, 0.5))
    ]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    if kn is None:
        print(f"the compiled core does not run ({core_name()}): nothing to compare")
        report("native", [])
        return
    assert BS % UNIT == 0
    report(
        "native",
        bench_stream(args.quick) + bench_prompt_keys(args.quick) + bench_keys_and_find(args.quick),
    )


if __name__ == "__main__":
    main()
