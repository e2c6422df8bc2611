"""A fleet of simulated HTTP engines on numbered ports (``kvevents sim serve``).

One job: starting ``n`` :class:`~kvevents.sim.http.engine.SimHTTPEngine` and keeping
them up until told to stop.  Imports the engine and config rooms of this package.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvevents.errors import ConfigError
from kvevents.sim.http.config import SimHTTPConfig
from kvevents.sim.http.engine import SimHTTPEngine

__all__ = ["run_sim_fleet", "sim_specs_lines"]


async def run_sim_fleet(
    n: int,
    *,
    config: SimHTTPConfig | None = None,
    host: str = "127.0.0.1",
    http_base: int | None = None,
    events_base: int | None = None,
    stop: asyncio.Event,
    on_ready: Any = None,
    prefill: int = 0,
    decode: int = 0,
    prefix: str = "",
) -> list[str]:
    """Run ``n`` engines ``sim-0..sim-{n-1}`` (role ``both``), then ``prefill`` engines
    ``prefill-0..`` and ``decode`` engines ``decode-0..`` (roles ``prefill`` and
    ``decode``, written into their specs) until ``stop`` is set; every name starts
    with ``prefix``.

    Engine ``i`` (counted over all of them, in that order) listens on HTTP port ``http_base + i``, publishes on ``events_base +
    2i`` and serves replay on ``events_base + 2i + 1`` (free ports when a base is None).
    ``on_ready(specs)`` is called once every engine listens, with their ``--engine``
    values.  Returns those values.
    """
    if n < 0 or prefill < 0 or decode < 0 or n + prefill + decode < 1:
        raise ConfigError("--engines, --prefill and --decode must be >= 0, one of them >= 1")
    named = (
        [(f"{prefix}sim-{i}", "both") for i in range(n)]
        + [(f"{prefix}prefill-{i}", "prefill") for i in range(prefill)]
        + [(f"{prefix}decode-{i}", "decode") for i in range(decode)]
    )
    engines: list[SimHTTPEngine] = []
    try:
        for i, (name, role) in enumerate(named):
            # the publishers listen on the HTTP host too (loopback by default)
            eh = f"[{host}]" if ":" in host else host
            ev = f"tcp://{eh}:{events_base + 2 * i}" if events_base is not None else None
            rep = f"tcp://{eh}:{events_base + 2 * i + 1}" if events_base is not None else None
            engines.append(
                SimHTTPEngine(
                    name,
                    config,
                    role=role,
                    host=host,
                    http_port=http_base + i if http_base is not None else 0,
                    events=ev or f"tcp://{eh}:0",
                    replay=rep or f"tcp://{eh}:0",
                )
            )
        for e in engines:
            await e.start()
        specs = [e.spec() for e in engines]
        if on_ready is not None:
            on_ready(specs)
        await stop.wait()
        return specs
    finally:
        for e in engines:
            await e.stop()


def sim_specs_lines(specs: Sequence[str]) -> str:
    """The lines ``kvevents sim serve`` prints: one ``--engine SPEC`` per engine."""
    return "".join(f"--engine {s}\n" for s in specs)
