"""Progress output of the ``kvevents`` commands: a tqdm bar or a self-overwriting status
line on stderr, shown only when stderr is a terminal.

May import the standard library, and tqdm lazily (a core dependency; a trimmed install
just has no bar).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["NoBar", "StatusLine", "is_tty", "progress", "with_byte_progress"]


def is_tty(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal (False for a closed or unusual stream)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


class StatusLine:
    """A single self-overwriting status line (a live counter) on a terminal; silent when
    the stream is not a terminal.  :meth:`update` redraws at most every ``interval_s``
    seconds unless forced; :meth:`done` ends the line."""

    def __init__(self, stream: IO[str], interval_s: float = 0.5, enabled: bool = True) -> None:
        self.stream = stream
        self.interval_s = interval_s
        self.tty = is_tty(stream)
        self.enabled = enabled and self.tty
        self._last = 0.0
        self._width = 0

    def update(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < self.interval_s):
            return
        self._last = now
        pad = max(0, self._width - len(text))
        self.stream.write("\r" + text + " " * pad)
        self._width = len(text)
        self.stream.flush()

    def done(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


class NoBar:
    """A progress bar that shows nothing (same ``update``/``close`` as tqdm's)."""

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str, *, unit: str = "batch", disable: bool) -> Any:
    """A tqdm bar on stderr (``total`` units, 0: unknown), or a :class:`NoBar` when
    disabled, when stderr is not a terminal, or when tqdm is missing."""
    if disable or not is_tty(sys.stderr):
        return NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # the `progress` extra: without it there is no bar
        return NoBar()
    return tqdm(
        total=total or None,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        file=sys.stderr,
        leave=False,
    )


def with_byte_progress(reader: Any, path: str, desc: str) -> Iterator[Any]:
    """``reader``'s records (a :class:`~kvevents.capture.CaptureReader`), with a progress
    bar over the file's bytes on a terminal."""
    try:
        total = os.path.getsize(path)
    except OSError:
        total = 0
    bar = progress(total, desc, unit="B", disable=False)
    done = reader.good_bytes
    bar.update(done)
    try:
        for i, rec in enumerate(reader):
            if i % 256 == 0:
                bar.update(reader.good_bytes - done)
                done = reader.good_bytes
            yield rec
        bar.update(reader.good_bytes - done)
    finally:
        bar.close()
