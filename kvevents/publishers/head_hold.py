"""Holding the first batches of a connecting publisher until its collector subscribed.

One job.  A PUB socket that connects out (vLLM's connect mode, to a bound SUB or XSUB)
sends a message only to peers whose subscription it has received; before the TCP
connection, the ZMTP handshake and the subscription have come through, a message is
dropped without a trace, so the first batches after start-up were lost.  The socket is
an XPUB (the same wire protocol) whose subscriptions the sender reads
(:mod:`~kvevents.publishers.subscriptions`): :class:`HeadHold` keeps the encoded batches
published before the first matching subscription arrives, bounded in bytes and
batches, and hands them back, in seq order, once it has.  Imports the standard library.
"""

from __future__ import annotations

from collections import deque

__all__ = ["HeadHold"]


class HeadHold:
    """The batches held until the first subscription arrives.

    ``max_bytes`` bounds the payload bytes held and ``max_batches`` (0: none) their
    number; :meth:`hold` refuses a batch beyond either.  Only the sender thread calls
    the methods.
    """

    def __init__(self, max_bytes: int, max_batches: int) -> None:
        self.max_bytes = max_bytes
        self.max_batches = max_batches
        self.subscribed = False
        """Whether a subscription has arrived (then nothing is held any more); the
        sender sets it from :class:`~kvevents.publishers.subscriptions.SubscriptionCounter`."""
        self.held: deque[tuple[int, bytes, int]] = deque()
        """``(seq, payload, events)`` in seq order."""
        self.held_bytes = 0

    def hold(self, seq: int, payload: bytes, events: int) -> bool:
        """Keep one encoded batch; False (nothing kept) when the bound is reached."""
        if self.held_bytes + len(payload) > self.max_bytes or (
            self.max_batches and len(self.held) >= self.max_batches
        ):
            return False
        self.held.append((seq, payload, events))
        self.held_bytes += len(payload)
        return True

    def release(self) -> list[tuple[int, bytes, int]]:
        """Take every held batch (oldest first)."""
        held = list(self.held)
        self.held.clear()
        self.held_bytes = 0
        return held
