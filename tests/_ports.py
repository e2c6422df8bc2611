"""Free TCP ports for tests that must name a port before something binds it."""

from __future__ import annotations

import random
import socket


def free_port_block(n: int) -> int:
    """The first of ``n`` consecutive loopback ports that are all free now, taken from
    20000-32000: below Linux's ephemeral range, where the kernel picks the ports of
    outgoing connections (so no other test's client takes one in between).  A port can
    still be taken by another process before it is bound: callers that bind several
    ports should retry on "Address already in use"."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - n)
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise AssertionError(f"no {n} free consecutive ports")
