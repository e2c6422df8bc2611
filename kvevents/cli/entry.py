"""The ``kvevents`` entry point: parse, run the subcommand, turn errors into one line and
an exit status (0 success; 1 ran with nothing to work on, as ``record`` hearing no
publisher; 2 usage or input error, or a service that cannot be reached; 130 interrupted).

May import :mod:`kvevents.cli.parser` and :mod:`kvevents.errors`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvevents.cli.parser import build_parser
from kvevents.errors import KVEventsError

__all__ = ["main"]


class _NotAnAnomaly(logging.Filter):
    """Drops the subscriber's own warnings: each is an ``Anomaly`` that the commands print
    (or count) themselves, so logging it too would show every anomaly twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith("kvevents.consumers.subscriber")


@contextmanager
def _cli_logging() -> Iterator[None]:
    """kvevents' warnings as ``kvevents: warning: ...`` lines on stderr, anomalies once."""
    log = logging.getLogger("kvevents")
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("kvevents: warning: %(message)s"))
    handler.addFilter(_NotAnAnomaly())
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvevents`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        with _cli_logging():
            return int(args.func(args))
    except KVEventsError as exc:
        print(f"kvevents: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `kvevents inspect f | head`
        return 0
    except OSError as exc:  # e.g. an output directory that does not exist
        print(f"kvevents: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
