"""The ``kvevents`` command line: ``inspect`` (and, as they land, record, replay, demo).

Each subcommand imports what it needs lazily, so ``kvevents inspect`` starts fast and
never imports torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvevents.errors import KVEventsError

__all__ = ["build_parser", "main"]


def _cmd_inspect(args: argparse.Namespace) -> int:
    from kvevents.capture import CaptureReader
    from kvevents.inspection import EventFilter, dumps_event, format_event, iter_events, summarize

    flt = EventFilter(type=args.type, medium=args.medium, group=args.group, worker=args.worker)
    with CaptureReader(args.file) as reader:
        if args.summary:
            summary = summarize(reader, flt)
            summary.tail_error = reader.tail_error
            if args.json:
                print(json.dumps(summary.to_json()))
            else:
                print(summary.to_text())
        else:
            errors: list = []
            shown = 0
            for ev in iter_events(reader, errors=errors):
                if not flt.matches(ev):
                    continue
                print(dumps_event(ev) if args.json else format_event(ev))
                shown += 1
                if args.limit is not None and shown >= args.limit:
                    break
            for rec, reason in errors:
                print(
                    f"undecodable frame seq={rec.seq} from {rec.source}: {reason}", file=sys.stderr
                )
        if reader.tail_error:
            print(
                f"warning: {args.file}: {reader.tail_error}; the records before it were read",
                file=sys.stderr,
            )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvevents",
        description="Record, inspect and replay vLLM KV-cache event streams.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="print the events of a capture file")
    p.add_argument("file", help="capture file (.kvcap)")
    p.add_argument("--json", action="store_true", help="JSON lines instead of text")
    p.add_argument("--summary", action="store_true", help="counts by type, medium, group, worker")
    p.add_argument(
        "--type", help="only this event type (BlockStored, BlockRemoved, AllBlocksCleared)"
    )
    p.add_argument("--medium", help="only this medium (GPU, CPU, STORAGE)")
    p.add_argument("--group", type=int, help="only this KV-cache group")
    p.add_argument("--worker", help="only this source, or source#rank")
    p.add_argument("--limit", type=int, help="stop after this many events")
    p.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvevents`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KVEventsError as exc:
        print(f"kvevents: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `kvevents inspect f | head`
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
