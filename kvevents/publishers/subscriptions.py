"""Reading the PUB socket's subscriptions: who can receive, and when the first came.

One job.  The publisher's PUB socket is an XPUB with ``XPUB_VERBOSER``: it speaks PUB's
protocol and hands the sender every subscription (``\\x01`` + prefix) and
unsubscription (``\\x00`` + prefix; ZeroMQ also makes one for each subscription of a
peer whose connection ended).  :class:`SubscriptionCounter` reads them without blocking
and counts the subscriptions whose prefix matches the publisher's topic: those are the
queues a batch goes to, and so what the live byte budget
(:mod:`~kvevents.publishers.live_budget`) divides by; and it notes the first one, which
ends the hold of a connecting publisher (:mod:`~kvevents.publishers.head_hold`).
Reading them also keeps ZeroMQ from piling them up.  Imports pyzmq only.
"""

from __future__ import annotations

from typing import Any, cast

import zmq

__all__ = ["SubscriptionCounter"]


class SubscriptionCounter:
    """Counts the subscriptions of ``xpub`` that match ``topic`` (the topic frame).

    A subscriber subscribed to two matching prefixes counts twice (it gets each batch
    once, so the count errs on the cautious side).  Only the sender thread calls
    :meth:`read`.
    """

    def __init__(self, xpub: zmq.Socket[Any], topic: bytes) -> None:
        self.xpub = xpub
        self.topic = topic
        self.count = 0
        """Matching subscriptions now."""
        self.subscribed = False
        """Whether a matching subscription has ever arrived."""

    def read(self) -> bool:
        """Read the (un)subscriptions waiting; True when the count changed."""
        xpub = self.xpub
        changed = False
        while cast(int, xpub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                message = xpub.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            if not message or not self.topic.startswith(message[1:]):
                continue
            if message[0] == 1:
                self.count += 1
                self.subscribed = changed = True
            elif message[0] == 0 and self.count:
                self.count -= 1
                changed = True
        return changed
