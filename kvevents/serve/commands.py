"""The bodies of the ``serve``, ``sim serve`` and ``loadgen`` subcommands.

One job: run a parsed command (:mod:`kvevents.serve.cli` defines the parsers).  Imports
the service, its config and load generator, the simulated HTTP engines, and uvicorn (the
``serve`` extra) at module level, so :mod:`kvevents.serve.cli` imports this module only
when one of these commands runs, after checking the extra is installed: building the
parser (``kvevents --help``) stays fast and never needs the extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
from dataclasses import replace
from typing import Any

import uvicorn

from kvevents.errors import ConfigError
from kvevents.serve import load_config
from kvevents.serve.app import ServeApp
from kvevents.serve.loadgen import LoadgenConfig, ProgressBar, format_loadgen, run_loadgen
from kvevents.sim.http import SimHTTPConfig, default_http_engine, run_sim_fleet

__all__ = ["cmd_loadgen", "cmd_serve", "cmd_sim_serve"]


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
            "seed": args.seed,
            "nats_url": args.nats,
            "nats_stream": args.stream,
        },
    )
    service = ServeApp(config)
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
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
    config = SimHTTPConfig(
        engine=engine,
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
        await run_sim_fleet(
            args.engines,
            config=config,
            host=args.host,
            http_base=args.http_port,
            events_base=args.events_port,
            stop=stop,
            on_ready=on_ready,
        )

    asyncio.run(main())
    return 0


def cmd_loadgen(args: argparse.Namespace) -> int:
    """``kvevents loadgen``: send the workload; 0 when every request succeeded, else 1."""
    cfg = LoadgenConfig(
        url=args.url.rstrip("/"),
        requests=args.requests,
        tenants=args.tenants,
        sessions=args.sessions,
        max_tokens=args.max_tokens,
        concurrency=None if args.rate is not None else args.concurrency,
        rate=args.rate,
        seed=args.seed,
        model=args.model,
    )
    cfg.validate()
    bar = ProgressBar()
    bar.enabled = bar.enabled and not args.quiet
    report = asyncio.run(run_loadgen(cfg, progress=bar))
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(format_loadgen(report))
    return 0 if report.ok else 1
