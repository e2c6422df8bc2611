"""Helpers every ``kvevents`` subcommand shares: stopping cleanly on a signal, printing an
anomaly, warning about skipped capture bytes, JSON for capture metadata.

May import only the standard library (it is loaded by every command, so it stays light).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import IO, Any

__all__ = ["json_default", "print_anomaly", "skipped_json", "stop_on_signals", "warn_skipped"]


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Set ``stop`` on SIGINT/SIGTERM while the block runs (main thread only), so a
    long-running command can finish cleanly instead of dying mid-write.  The previous
    handlers are restored on exit; off the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def json_default(value: Any) -> Any:
    """JSON for what ``json`` cannot encode itself (bytes in capture metadata become
    ``{"hex": ...}``; anything else its ``str``)."""
    if isinstance(value, (bytes, bytearray)):
        return {"hex": bytes(value).hex()}
    return str(value)


def print_anomaly(anomaly: Any, stream: IO[str]) -> None:
    """One line for a subscriber :class:`~kvevents.consumers.Anomaly`:
    ``anomaly KIND SOURCE#RANK seq A..B: detail``."""
    rank = "?" if anomaly.dp_rank is None else anomaly.dp_rank
    span = ""
    if anomaly.first_seq is not None:
        span = f" seq {anomaly.first_seq}"
        if anomaly.last_seq is not None and anomaly.last_seq != anomaly.first_seq:
            span += f"..{anomaly.last_seq}"
    detail = f": {anomaly.detail}" if anomaly.detail else ""
    print(f"anomaly {anomaly.kind} {anomaly.source}#{rank}{span}{detail}", file=stream)


def warn_skipped(path: str, skipped: Sequence[Any], verb: str) -> None:
    """One warning line on stderr per damaged byte range a capture reader skipped
    (``skipped`` holds :class:`~kvevents.capture.SkippedRange` values)."""
    for rng in skipped:
        print(
            f"warning: {path}: skipped bytes {rng.start}..{rng.end} ({rng.reason}); "
            f"the records around it were {verb}",
            file=sys.stderr,
        )


def skipped_json(skipped: Sequence[Any]) -> list[dict[str, Any]]:
    """The skipped byte ranges as JSON objects ``{"start", "end", "reason"}``."""
    return [{"start": r.start, "end": r.end, "reason": r.reason} for r in skipped]
