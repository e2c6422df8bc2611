"""A rate-limited warning log, shared by the publisher and the subscriber.

Hot paths (a dropped batch, a malformed frame) must say what happened without flooding
the log: :class:`RateLimitedLog` writes a warning for a key at most once per
``interval_s`` and reports how many similar warnings it held back meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """Log a warning per key at most once per ``interval_s`` seconds.

    The first warning for a key is written at once; later ones within ``interval_s`` are
    counted, and the next one written after the interval says how many were suppressed.
    Not thread-safe: give each thread its own instance.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 5.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._next: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def warning(self, key: str, msg: str, *args: object) -> None:
        """Log ``msg % args`` unless a warning for ``key`` was logged too recently."""
        now = time.monotonic()
        if now < self._next.get(key, 0.0):
            self._suppressed[key] += 1
            return
        suppressed = self._suppressed.pop(key, 0)
        self._next[key] = now + self.interval_s
        if suppressed:
            self.logger.warning(msg + " (%d similar suppressed)", *args, suppressed)
        else:
            self.logger.warning(msg, *args)
