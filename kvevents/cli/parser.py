"""The ``kvevents`` argument parser: every subcommand's options, each bound to the
function that runs it.

May import the command modules of this package, and (lazily, from :func:`build_parser`)
the parsers that :mod:`kvevents.serve.cli` and :mod:`kvevents.jetstream.cli` add.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvevents.cli.demo import cmd_demo
from kvevents.cli.inspect import cmd_inspect
from kvevents.cli.record import cmd_record
from kvevents.cli.relay import cmd_relay
from kvevents.cli.replay import cmd_replay

__all__ = ["build_parser", "group_index", "positive_int", "positive_seconds"]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"want a whole number >= 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a number of seconds > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"want a number of seconds > 0, got {value:g}")
    return value


def group_index(text: str) -> int:
    """argparse type: a KV-cache group index (an integer >= 0)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a group index (0, 1, ...), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"want a group index (0, 1, ...), got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (``kvevents inspect: error: ...``) instead of the
    usage block; ``--help`` still shows the usage."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from kvevents import __version__
    from kvevents.native import core_name

    parser = _Parser(
        prog="kvevents",
        description="Record, inspect, replay and relay vLLM KV-cache event streams, route "
        "requests with them (serve), run simulated engines and the demo.",
    )
    parser.add_argument(
        "--version", action="version", version=f"kvevents {__version__} (core: {core_name()})"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser(
        "record",
        help="subscribe to publishers and write a capture file",
        description="Subscribe to one or more publishers (gaps are repaired by replay when a "
        "replay endpoint is given) and write every frame received to a capture file, in "
        "arrival order, before decoding (a payload that does not decode or a message "
        "without the [topic, seq, payload] shape is kept too, flagged).  Stops on "
        "Ctrl-C / SIGTERM, after --duration seconds or --count distinct good batches; the "
        "file is always left complete.  Exit status 1 when no publisher was heard.",
    )
    p.add_argument(
        "endpoints",
        nargs="+",
        metavar="ENDPOINT",
        help="publisher PUB endpoint(s) to connect to, e.g. tcp://ENGINE_HOST:5557 "
        "(an engine with vLLM's default tcp://*:5557 binds there)",
    )
    p.add_argument(
        "--listen",
        action="store_true",
        help="listen on the ENDPOINT(s) (tcp://*:PORT) for engines whose endpoint connects "
        "out (tcp://THIS_HOST:PORT) instead of connecting to engines that bind",
    )
    p.add_argument("-o", "--output", required=True, help="capture file to write (.kvcap)")
    p.add_argument(
        "--append",
        action="store_true",
        help="continue an existing capture at its end (intact records are never cut; only "
        "an incomplete last record is)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUTPUT if it exists (without --force or --append, an existing file "
        "is refused and left untouched)",
    )
    p.add_argument(
        "--replay-endpoint",
        action="append",
        metavar="ENDPOINT",
        help="replay (ROUTER) endpoint, once per ENDPOINT in the same order",
    )
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    p.add_argument(
        "--stream",
        default="KV_EVENTS",
        help="JetStream stream to read when ENDPOINT is nats://HOST:PORT (default KV_EVENTS)",
    )
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=positive_seconds, metavar="S", help="stop after S seconds")
    stop.add_argument(
        "--count",
        type=positive_int,
        metavar="N",
        help="stop after N distinct batches (a copy of one already written, as a replay "
        "may bring, is written but not counted)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no status line")
    p.set_defaults(func=cmd_record)

    p = sub.add_parser("inspect", help="print the events of a capture file")
    p.add_argument("file", help="capture file (.kvcap)")
    p.add_argument("--json", action="store_true", help="JSON lines instead of text")
    p.add_argument(
        "--summary",
        action="store_true",
        help="batches, copies, seq gaps, events by type, medium, group and worker, and the "
        "file added up (damaged byte ranges and the seqs missing around them)",
    )
    p.add_argument(
        "--type", help="only this event type (BlockStored, BlockRemoved, AllBlocksCleared)"
    )
    p.add_argument("--medium", help="only this medium (GPU, CPU, STORAGE)")
    p.add_argument("--group", type=group_index, help="only this KV-cache group (0, 1, ...)")
    p.add_argument("--worker", help="only this source, or source#rank")
    p.add_argument("--limit", type=positive_int, metavar="N", help="stop after N events (N >= 1)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "replay",
        help="feed a capture into a block index, or republish it over ZMQ",
        description="--into-index: apply the capture to a BlockIndex (as a live subscriber "
        "would) and print what it holds per worker and tier, and every anomaly.  "
        "--publish: republish it with the ZMQ publisher (with replay) at the recorded "
        "pace, --speed times faster, or --max-rate.",
    )
    p.add_argument("file", help="capture file (.kvcap)")
    p.add_argument("--into-index", action="store_true", help="replay into a BlockIndex")
    p.add_argument(
        "--blocks-per-chunk",
        type=int,
        metavar="N",
        help="GPU blocks per CPU chunk of the engines (default: learned from the stream)",
    )
    p.add_argument("--json", action="store_true", help="--into-index: print JSON")
    p.add_argument(
        "--publish",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="PUB endpoint to listen on, e.g. tcp://*:6700 (once per publisher in the "
        "capture; DP ranks use vLLM's port offsets)",
    )
    p.add_argument(
        "--replay-endpoint",
        action="append",
        metavar="ENDPOINT",
        help="replay ROUTER endpoint, once per --publish",
    )
    p.add_argument("--source", help="republish only this recorded publisher")
    p.add_argument(
        "--stream",
        default="KV_EVENTS",
        help="JetStream stream to append to when --publish is nats://HOST:PORT",
    )
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--speed", type=float, metavar="X", help="X times the recorded pace")
    pace.add_argument("--max-rate", action="store_true", help="as fast as possible")
    p.add_argument(
        "--buffer-steps", type=positive_int, default=10_000, help="replay buffer length (batches)"
    )
    p.add_argument(
        "--wait-subscribers",
        type=float,
        default=0.5,
        metavar="S",
        help="pause S seconds after binding each publisher so subscribers can connect (not "
        "part of the pace: the first batch goes out after it)",
    )
    p.add_argument(
        "--hold",
        type=float,
        default=0.0,
        metavar="S",
        help="keep the publishers (and their replay buffers) up S seconds after the last batch",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser(
        "demo",
        help="simulated engines behind kvevents serve: compare routing policies over HTTP",
        description="Run simulated engines on loopback (OpenAI HTTP fronts, KV-event "
        "publishers), put kvevents serve in front with each policy (the KV-aware router, "
        "the same router fed GPU events only, round-robin, random) and send a seeded "
        "multi-turn chat workload through it with the load generator; print hit rates per "
        "tier, time to first token and throughput, and write a plot.",
    )
    p.add_argument("--quick", action="store_true", help="a few-second run")
    p.add_argument("--engines", type=positive_int, help="number of engines")
    p.add_argument("--dp-ranks", type=positive_int, help="data-parallel ranks per engine")
    p.add_argument("--requests", type=positive_int, help="requests in the workload")
    p.add_argument("--seed", type=int, help="workload seed")
    p.add_argument(
        "--policy",
        action="append",
        choices=["kv-aware", "kv-aware-gpu", "round-robin", "random"],
        help="run only this policy (repeatable; default: all four; kv-aware-gpu: a "
        "KV-aware router fed GPU events only)",
    )
    p.add_argument(
        "--endpoint",
        metavar="ENDPOINT",
        help="PUB endpoint of engine 0, e.g. tcp://127.0.0.1:5557 (engine i, rank r: port + "
        "i*ranks + r; replay: port + 100 + ...); default: ephemeral ports on --host",
    )
    p.add_argument(
        "--host",
        metavar="HOST",
        help="address the engines bind (ephemeral ports): default 127.0.0.1 (loopback "
        "only); 0.0.0.0 or '*' for all interfaces",
    )
    p.add_argument(
        "--device",
        help="where the engines' simulated KV cache lives: cpu (default) or cuda",
    )
    p.add_argument(
        "--block-sizes",
        metavar="B[,B...]",
        help="KV-cache groups by block size in tokens, e.g. 16 or 16,32 (hybrid; default 16)",
    )
    p.add_argument("--gpu-blocks", type=int, metavar="N", help="GPU blocks per engine (96)")
    p.add_argument(
        "--cpu-chunks", type=int, metavar="N", help="CPU offload chunks per engine (128; 0: off)"
    )
    p.add_argument("--blocks-per-chunk", type=int, metavar="N", help="GPU blocks per CPU chunk (4)")
    p.add_argument("--cpu-policy", choices=["lru", "arc"], help="CPU cache policy (lru)")
    p.add_argument(
        "--hold",
        type=float,
        metavar="S",
        help="keep each policy's engines up S seconds before and after routing, so "
        "`kvevents record` can join and replay (default: 2 with --endpoint, else 0)",
    )
    p.add_argument(
        "--plot",
        default="kvevents-demo.png",
        metavar="FILE",
        help="PNG to write (default kvevents-demo.png; '' for none)",
    )
    p.add_argument(
        "--record",
        metavar="FILE",
        help="also write every batch the demo's subscriber receives to this capture file",
    )
    p.add_argument(
        "--disaggregated",
        action="store_true",
        help="the prefill/decode scenario instead: prefill and decode engines, the KV-aware "
        "prefill choice against round-robin, reuse on the prefill engines",
    )
    p.add_argument(
        "--prefill", type=positive_int, default=3, help="prefill engines with --disaggregated (3)"
    )
    p.add_argument(
        "--decode", type=positive_int, default=2, help="decode engines with --disaggregated (2)"
    )
    p.add_argument(
        "--pd-min-uncached-tokens",
        type=int,
        default=64,
        metavar="N",
        help="with --disaggregated, split a request when its best prefill engine would "
        "compute at least N tokens (64)",
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_demo)

    from kvevents.serve.cli import add_parsers as _add_serve_parsers

    _add_serve_parsers(sub)

    from kvevents.jetstream.cli import add_relay_parser

    add_relay_parser(sub).set_defaults(func=cmd_relay)
    return parser
