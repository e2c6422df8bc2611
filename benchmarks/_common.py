"""Shared output shape for the benchmark scripts.

Every script prints a readable table, then, as its last line, one JSON object::

    {"benchmark": NAME, "results": [{"metric", "value", "unit", "baseline", "ratio"}, ...],
     "machine": {...}}

``baseline`` is the same work done by a reference measured in the same run (or None),
and ``ratio`` is ``value / baseline`` (or None).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any


def arg_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the option every script takes, ``--quick``; a script adds its own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    return p


def parse_args(description: str) -> argparse.Namespace:
    return arg_parser(description).parse_args()


def count(text: str) -> int:
    """An argparse ``type`` for counts of at least 1 (rounds, repeats)."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"takes a count of at least 1, got {n}")
    return n


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    try:
        import msgspec

        info["msgspec"] = msgspec.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        import zmq

        info["pyzmq"] = zmq.__version__
    except ImportError:  # pragma: no cover
        pass
    if "torch" in sys.modules:
        info["torch"] = sys.modules["torch"].__version__
    return info


def best_rate(fn: Callable[[], int], *, repeat: int = 5, min_time: float = 0.2) -> float:
    """Run ``fn`` (which returns the number of items it processed) until ``min_time``
    has passed, ``repeat`` times; return the best items/second."""
    best = 0.0
    for _ in range(repeat):
        items = 0
        start = time.perf_counter()
        while True:
            items += fn()
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        best = max(best, items / elapsed)
    return best


def result(metric: str, value: float, unit: str, baseline: float | None = None) -> dict[str, Any]:
    ratio = (value / baseline) if baseline else None
    return {"metric": metric, "value": value, "unit": unit, "baseline": baseline, "ratio": ratio}


def report(name: str, results: list[dict[str, Any]]) -> None:
    """Print the table and the final JSON line."""
    rows = [("metric", "value", "unit", "baseline", "ratio")]
    for r in results:
        rows.append(
            (
                r["metric"],
                _fmt(r["value"]),
                r["unit"],
                _fmt(r["baseline"]) if r["baseline"] is not None else "-",
                f"{r['ratio']:.2f}" if r["ratio"] is not None else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(widths[j]) for j, cell in enumerate(row)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print(json.dumps({"benchmark": name, "results": results, "machine": machine()}))


def _fmt(v: float) -> str:
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"
