"""``kvevents relay``: copy engines' ZMQ event streams into a NATS JetStream stream (the
work is :func:`kvevents.jetstream.cli.run_relay`; this module only wires the signals).

May import :mod:`kvevents.jetstream.cli` (lazily: it needs the ``nats`` extra) and the
CLI's shared helpers.
"""

from __future__ import annotations

import argparse
import threading

from kvevents.cli.common import stop_on_signals

__all__ = ["cmd_relay"]


def cmd_relay(args: argparse.Namespace) -> int:
    from kvevents.jetstream.cli import run_relay

    stop = threading.Event()
    with stop_on_signals(stop):
        return run_relay(args, stop)
