"""The bodies of the ``serve`` and ``sim serve`` subcommands (the two HTTP servers).

One job: run a parsed server command (:mod:`kvevents.serve.cli` defines the parsers).
Imports the service (:mod:`kvevents.serve.app`), the simulated HTTP engines
(:mod:`kvevents.sim.http`) and uvicorn, that is the ``serve`` extra, at module level, so
:mod:`kvevents.serve.cli` imports this module only when one of these commands runs, after
checking the extra is installed: building the parser (``kvevents --help``) stays fast and
never needs the extra.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import socket
import sys
from dataclasses import replace
from typing import Any

import uvicorn

from kvevents.errors import ConfigError
from kvevents.serve import load_config
from kvevents.serve.app import ServeApp
from kvevents.sim.http import SimHTTPConfig, default_http_engine, run_sim_fleet

__all__ = ["cmd_serve", "cmd_sim_serve", "freeze_startup_heap"]


def freeze_startup_heap() -> None:
    """Collect, then put every object alive now out of the garbage collector's reach
    (``gc.freeze``): the imported modules and the service just built, its indexes'
    retention rooms included.  They live as long as the process, and a full collection
    no longer traverses them: in a router process with a 1,000-worker index, full
    passes went from 17-24 ms to about 3 ms (``benchmarks/router_gc.py``).  Objects
    made later are collected as usual; reference counting still frees frozen ones."""
    gc.collect()
    gc.freeze()


def cmd_serve(args: argparse.Namespace) -> int:
    """``kvevents serve``: listen on the configured address and route until stopped."""
    config = load_config(
        config_file=args.config,
        engines=args.engine or (),
        options={
            "host": args.host,
            "port": args.port,
            "policy": args.policy,
            "tokenizer": args.tokenizer,
            "blocks_per_chunk": args.blocks_per_chunk,
            "load_tokens": args.load_tokens,
            "scrape_interval_s": args.scrape_interval,
            "scrape_timeout_s": args.scrape_timeout,
            "scrape_failures": args.scrape_failures,
            "seed": args.seed,
            "nats_url": args.nats,
            "nats_stream": args.stream,
            "stale_after_s": args.stale_after,
            "bootstrap_from": args.bootstrap_from,
            "admin_token": args.admin_token,
            "ready_when_incomplete": args.ready_when_incomplete,
            "pending_weight": args.pending_weight,
            "pending_ttl_s": args.pending_ttl,
            "pending_max_bytes": (
                None if args.pending_max_mib is None else int(args.pending_max_mib * (1 << 20))
            ),
            "pending_nats": args.pending_nats,
            "replica": args.replica,
            "pd_min_uncached_tokens": args.pd_min_uncached_tokens,
        },
    )
    service = ServeApp(config)
    freeze_startup_heap()
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
        # listen now, not when uvicorn starts serving after the app's startup: a client
        # that read the "listening" line is queued in the backlog, not refused
        sock.listen(2048)
    except OSError as exc:
        service.fleet.close()
        raise ConfigError(f"cannot listen on {config.host}:{config.port}: {exc}") from exc
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            service.app,
            log_level=args.log_level,
            access_log=args.access_log,
            timeout_keep_alive=30,
            server_header=False,  # the engine's own headers come through unchanged
            date_header=False,
        )
    )
    names = ", ".join(e.name for e in config.engines)
    print(
        f"kvevents serve: listening on http://{config.host}:{port} "
        f"(policy {config.policy}; engines {names})",
        flush=True,
    )
    server.run(sockets=[sock])
    return 0


def cmd_sim_serve(args: argparse.Namespace) -> int:
    """``kvevents sim serve``: run simulated engines until SIGINT/SIGTERM."""
    engine = default_http_engine()
    over: dict[str, Any] = {}
    if args.gpu_blocks is not None:
        over["num_gpu_blocks"] = args.gpu_blocks
    if args.cpu_chunks is not None:
        over["num_cpu_chunks"] = args.cpu_chunks
    if args.blocks_per_chunk is not None:
        over["blocks_per_chunk"] = args.blocks_per_chunk
    if over:
        engine = replace(engine, **over)
    engine.validate()
    if args.buffer_steps is not None and args.buffer_steps < 1:
        raise ConfigError("--buffer-steps must be >= 1")
    config = SimHTTPConfig(
        engine=engine,
        buffer_steps=args.buffer_steps if args.buffer_steps is not None else 10_000,
        step_s=args.step_ms / 1000.0,
        prefill_s_per_token=args.prefill_us_per_token / 1e6,
        loras=tuple(x for x in (args.lora or "").split(",") if x),
    )

    def on_ready(specs: list[str]) -> None:
        for s in specs:
            sys.stdout.write(f"--engine {s}\n")
        sys.stdout.flush()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        split = bool(args.prefill or args.decode)
        await run_sim_fleet(
            args.engines if args.engines is not None else (0 if split else 1),
            prefill=args.prefill,
            decode=args.decode,
            prefix=args.name_prefix,
            config=config,
            host=args.host,
            http_base=args.http_port,
            events_base=args.events_port,
            stop=stop,
            on_ready=on_ready,
        )

    asyncio.run(main())
    return 0
