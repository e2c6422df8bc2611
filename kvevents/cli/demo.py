"""``kvevents demo``: simulated engines behind ``kvevents serve``, each routing policy
compared over HTTP, results printed before the plot is written.

May import :mod:`kvevents.sim` (lazily: it pulls in the HTTP stack) and the CLI's shared
helpers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

from kvevents.cli.progress import StatusLine
from kvevents.errors import ConfigError, require_module

__all__ = ["cmd_demo"]


# --- demo --------------------------------------------------------------------------------
def _demo_engine(args: argparse.Namespace, default: Any) -> Any:
    """The demo's engine shape with the command-line overrides, or None if none given."""
    from dataclasses import replace

    from kvevents.sim import KVCacheGroupSpec

    changes: dict[str, Any] = {}
    if args.block_sizes:
        try:
            sizes = [int(x) for x in args.block_sizes.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(
                f"--block-sizes wants integers like 16,32, got {args.block_sizes!r}"
            ) from None
        if not sizes:
            raise ConfigError("--block-sizes needs at least one block size")
        changes["groups"] = tuple(KVCacheGroupSpec(b) for b in sizes)
    for flag, name in (
        ("gpu_blocks", "num_gpu_blocks"),
        ("cpu_chunks", "num_cpu_chunks"),
        ("blocks_per_chunk", "blocks_per_chunk"),
        ("cpu_policy", "cpu_cache_policy"),
    ):
        value = getattr(args, flag)
        if value is not None:
            changes[name] = value
    if not changes:
        return None
    engine = replace(default, **changes)
    engine.validate()
    return engine


def cmd_demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvevents.demo import (
        DemoConfig,
        format_report,
        report_to_json,
        run_demo,
        write_plot,
    )

    base = DemoConfig.quick() if args.quick else DemoConfig()
    overrides: dict[str, Any] = {}
    for name in ("engines", "requests", "seed", "dp_ranks"):
        value = getattr(args, name)
        if value is not None:
            overrides[name] = value
    if args.policy:
        overrides["policies"] = tuple(dict.fromkeys(args.policy))
    if args.endpoint and args.host is not None:
        raise ConfigError("give --endpoint (its host included) or --host, not both")
    if args.endpoint:
        overrides["bind"] = args.endpoint
    else:
        host = "127.0.0.1" if args.host is None else args.host.strip() or "*"
        overrides["bind"] = f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"
    if args.device:
        dev = args.device
        if dev != "cpu" and dev != "cuda" and not (dev[5:].isdigit() and dev[:5] == "cuda:"):
            raise ConfigError(f"--device wants cpu, cuda or cuda:N, got {dev!r}")
        overrides["device"] = args.device
        if args.device != "cpu":
            require_module("torch", "offload", f"--device {args.device}")
    plot_dir = os.path.dirname(args.plot) if args.plot else ""
    if plot_dir and not os.path.isdir(plot_dir):  # fail before the run, not after it
        raise ConfigError(f"--plot {args.plot}: directory {plot_dir} does not exist")
    if args.record:
        overrides["record_path"] = args.record
    engine = _demo_engine(args, base.engine_config())
    if engine is not None:
        overrides["engine"] = engine
    hold = args.hold if args.hold is not None else (2.0 if args.endpoint else 0.0)
    if hold < 0:
        raise ConfigError("--hold must be >= 0")
    overrides["hold_s"] = hold
    config = replace(base, **overrides)
    status = StatusLine(sys.stderr, enabled=not args.quiet)

    def progress(policy: str, done: int, total: int) -> None:
        status.update(f"demo: {policy}: {done}/{total} requests routed", force=done == total)

    def on_start(policy: str, cluster: Any) -> None:
        if args.quiet:
            return
        status.done()
        print(f"demo: {policy}: {len(cluster.workers)} engine rank(s) publishing:", file=sys.stderr)
        for w in cluster.workers:
            print(
                f"  {w.engine.name:<14} {w.endpoint}  replay {w.replay_endpoint}",
                file=sys.stderr,
            )

    if args.disaggregated:
        return _disaggregated(args, config, progress, status)
    try:
        report = run_demo(config, progress=progress, on_start=on_start)
    finally:
        status.done()
    if importlib.util.find_spec("torch") is None and report.engine.num_cpu_chunks:
        report.notes.append(
            "CPU tier without byte copies: torch is not installed (hit rates and events are "
            "the same; pip install 'kvevents[offload]' to move real bytes)"
        )
    # The results come first: a plot that cannot be written loses nothing.
    why_not: str | None = "no --plot file"
    plot_error: str | None = None
    if args.json:
        if args.plot:
            why_not, plot_error = _write_plot(write_plot, report, args.plot)
        out = report_to_json(report)
        out["plot"] = None if why_not else args.plot
        print(json.dumps(out), flush=True)
    else:
        print(format_report(report), flush=True)
        if args.plot:
            why_not, plot_error = _write_plot(write_plot, report, args.plot)
            if plot_error is None:
                print(f"plot skipped: {why_not}" if why_not else f"plot written to {args.plot}")
    if plot_error is not None:
        print(f"kvevents: error: {plot_error}", file=sys.stderr)
        return 2
    return 0


def _disaggregated(args: argparse.Namespace, config: Any, progress: Any, status: Any) -> int:
    """``kvevents demo --disaggregated``: the prefill/decode scenario's table (or JSON)."""
    from kvevents.demo.disagg import DISAGG_POLICIES, format_disagg, run_disagg

    if args.pd_min_uncached_tokens < 0:
        raise ConfigError("--pd-min-uncached-tokens must be >= 0")
    policies = [p for p in (args.policy or DISAGG_POLICIES)]
    try:
        results = run_disagg(
            config,
            prefill=args.prefill,
            decode=args.decode,
            min_uncached=args.pd_min_uncached_tokens,
            policies=policies,
            progress=progress,
        )
    finally:
        status.done()
    if args.json:
        print(json.dumps({"disaggregated": [r.as_json() for r in results]}), flush=True)
    else:
        print(format_disagg(results), flush=True)
    return 0 if all(r.failed == 0 for r in results) else 1


def _write_plot(write_plot: Any, report: Any, path: str) -> tuple[str | None, str | None]:
    """Write the demo's plot: (why it was skipped or None, an error line or None)."""
    try:
        return write_plot(report, path), None
    except Exception as exc:  # unwritable path, a format matplotlib lacks, ...: the
        # results are already computed (and printed in text mode), so one line suffices
        return "not written", f"--plot {path}: the plot was not written: {exc}"
