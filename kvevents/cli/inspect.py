"""``kvevents inspect``: print the events of a capture file, or a summary of them.

May import :mod:`kvevents.capture`, :mod:`kvevents.inspection` (lazily, so the parser
loads fast) and the CLI's shared helpers.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvevents.cli.common import json_default, skipped_json, warn_skipped
from kvevents.cli.progress import with_byte_progress

__all__ = ["cmd_inspect"]


def cmd_inspect(args: argparse.Namespace) -> int:
    from kvevents.capture import CaptureReader
    from kvevents.capture_account import CaptureAccount
    from kvevents.inspection import (
        CaptureValues,
        EventFilter,
        dumps_event,
        format_event,
        iter_events,
        summarize,
    )

    flt = EventFilter(type=args.type, medium=args.medium, group=args.group, worker=args.worker)
    values = CaptureValues()
    with CaptureReader(args.file) as reader:
        if args.summary:
            account = CaptureAccount()
            account.start(reader)
            records = with_byte_progress(reader, args.file, "summarizing")
            summary = summarize(
                records,
                flt,
                values if flt.active else None,
                account=account,
                offset=lambda: reader.good_bytes,
            )
            summary.tail_error = reader.tail_error
            summary.meta = dict(reader.meta)
            summary.account = account.finish(reader)
            if flt.active and summary.events == 0:
                values.check(flt)  # a value the capture does not hold: say which it holds
            if args.json:
                out = summary.to_json()
                out["skipped_ranges"] = skipped_json(reader.skipped)
                print(json.dumps(out, default=json_default))
            else:
                print(summary.to_text())
            shown = summary.events
        else:
            errors: list[Any] = []
            shown = 0
            for ev in iter_events(reader, errors=errors):
                if flt.active:
                    values.observe(ev)
                    if not flt.matches(ev):
                        continue
                print(dumps_event(ev) if args.json else format_event(ev))
                shown += 1
                if args.limit is not None and shown >= args.limit:
                    break
            for rec, reason in errors:
                if rec.malformed:
                    print(f"{reason} from {rec.source}", file=sys.stderr)
                else:
                    print(
                        f"undecodable frame seq={rec.seq} from {rec.source}: {reason}",
                        file=sys.stderr,
                    )
        warn_skipped(args.file, reader.skipped, "read")
    if flt.active and shown == 0:
        values.check(flt)
        print("no event matched all the filters together", file=sys.stderr)
    return 0
