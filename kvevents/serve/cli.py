"""Subcommands ``serve``, ``sim serve`` and ``loadgen`` of the ``kvevents`` CLI.

:func:`add_parsers` adds them to the main parser.  This module imports the service's
configuration and the load generator (neither needs an extra at import); the servers'
bodies (:mod:`kvevents.serve.commands`, which needs the ``serve`` extra at import) are
imported when ``serve`` or ``sim serve`` runs, after a missing extra has been reported in
one line naming it (``loadgen`` checks the extra the same way before it runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from kvevents.errors import ConfigError
from kvevents.serve import require_serve_extra
from kvevents.serve.burstgen import BurstConfig, format_bursts, run_bursts
from kvevents.serve.config import POLICIES
from kvevents.serve.loadgen import LoadgenConfig, ProgressBar, format_loadgen, run_loadgen

__all__ = ["add_parsers"]


def _cmd_serve(args: argparse.Namespace) -> int:
    require_serve_extra("kvevents serve")
    from kvevents.serve.commands import cmd_serve  # needs the serve extra (uvicorn)

    return cmd_serve(args)


def _cmd_sim_serve(args: argparse.Namespace) -> int:
    require_serve_extra("kvevents sim serve")
    from kvevents.serve.commands import cmd_sim_serve  # needs the serve extra (uvicorn)

    return cmd_sim_serve(args)


def _cmd_loadgen(args: argparse.Namespace) -> int:
    require_serve_extra("kvevents loadgen")
    if args.burst is not None:
        bcfg = BurstConfig(
            urls=tuple(u.rstrip("/") for u in args.url),
            burst=args.burst,
            bursts=args.bursts,
            context_words=(args.context_words[0], args.context_words[1]),
            max_tokens=args.max_tokens,
            seed=args.seed,
            model=args.model,
        )
        bcfg.validate()
        breport = asyncio.run(run_bursts(bcfg))
        print(json.dumps(breport.to_json()) if args.json else format_bursts(breport))
        return 0 if all(r.ok for b in breport.bursts for r in b.requests) else 1
    if len(args.url) != 1:
        raise ConfigError("the chat workload takes one URL (several only with --burst)")
    cfg = LoadgenConfig(
        url=args.url[0].rstrip("/"),
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
    bar = ProgressBar(quiet=args.quiet)
    report = asyncio.run(run_loadgen(cfg, progress=bar))
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(format_loadgen(report))
    return 0 if report.ok else 1


def add_parsers(sub: Any) -> None:
    """Add ``serve``, ``sim`` (``sim serve``) and ``loadgen`` to the CLI's subparsers."""
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible KV-aware routing service in front of engines",
        description="Route OpenAI requests to the engine that holds their prefix (GPU, CPU "
        "and storage tiers, from the engines' own KV events), traded against load.  Serves "
        "/v1/completions, /v1/chat/completions, /v1/models, /route, /workers, /metrics, "
        "/healthz, /readyz and a live dashboard at /.  Needs: pip install 'kvevents[serve]'.",
    )
    p.add_argument(
        "--engine",
        action="append",
        metavar="SPEC",
        help="NAME=HTTP_URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT][;dp=N][;rank=R][;topic=T]"
        "[;role=ROLE] (repeatable; N data-parallel ranks from global rank R (default 1 from 0);"
        " ROLE: both (default), prefill or decode)",
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with [[engine]] tables and options")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000; 0: any free)")
    p.add_argument("--policy", choices=POLICIES, help="routing policy (default kv-aware)")
    p.add_argument(
        "--tokenizer", metavar="FILE", help="local tokenizer file (default: ask engines)"
    )
    p.add_argument(
        "--blocks-per-chunk", type=int, metavar="N", help="engines' GPU blocks per CPU chunk"
    )
    p.add_argument(
        "--load-tokens",
        type=float,
        metavar="T",
        help="cost of one request already in flight on an engine, in prompt tokens (64)",
    )
    p.add_argument(
        "--scrape-interval", type=float, metavar="S", help="engine /metrics interval (1)"
    )
    p.add_argument(
        "--scrape-timeout",
        type=float,
        metavar="S",
        help="time one engine /metrics read may take, connect included (2)",
    )
    p.add_argument(
        "--scrape-failures",
        type=int,
        metavar="N",
        help="consecutive failed /metrics reads that mark an engine down (3); a failed "
        "request marks it down at once",
    )
    p.add_argument("--seed", type=int, help="seed of the random policy")
    p.add_argument(
        "--nats",
        metavar="URL",
        help="read the engines' events from this NATS JetStream server (written there by "
        "kvevents relay) instead of their ZMQ sockets; engines are then NAME=HTTP_URL",
    )
    p.add_argument("--stream", help="JetStream stream with --nats (default KV_EVENTS)")
    p.add_argument(
        "--stale-after",
        type=float,
        metavar="S",
        help="an engine rank with no event and no replay answer for S seconds is untrusted: "
        "routed by load alone until its events return (30)",
    )
    p.add_argument(
        "--bootstrap-from",
        metavar="URL",
        help="restore the index of a running kvevents serve (its /snapshot) and catch each "
        "stream up from the snapshot's resume point",
    )
    p.add_argument(
        "--admin-token",
        metavar="TOKEN",
        help="bearer token /snapshot requires (also sent to --bootstrap-from); without it "
        "/snapshot answers only on a loopback address (env KVEVENTS_SERVE_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--ready-when-incomplete",
        action="store_true",
        default=None,
        help="/readyz does not wait for every engine's index to be complete",
    )
    p.add_argument(
        "--pending-weight",
        type=float,
        metavar="W",
        help="worth of a token just routed to a rank and not yet confirmed by its events, "
        "against a reused one (default 0.5; 0 turns the pending overlay off)",
    )
    p.add_argument("--pending-ttl", type=float, metavar="S", help="reservation lifetime (10 s)")
    p.add_argument(
        "--pending-max-mib", type=float, metavar="MIB", help="pending overlay memory bound (32)"
    )
    p.add_argument(
        "--pending-nats",
        metavar="URL",
        help="NATS server replicas exchange their reservations on (default: --nats)",
    )
    p.add_argument("--replica", metavar="NAME", help="this replica's name on the exchange")
    p.add_argument(
        "--pd-min-uncached-tokens",
        type=int,
        metavar="N",
        help="with prefill and decode engines, disaggregate a request only when the best "
        "prefill engine would compute at least N prompt tokens; shorter work is served "
        "whole by a decode-capable engine (256)",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn log level (warning)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("sim", help="simulated engines (sim serve)")
    simsub = p.add_subparsers(dest="sim_command", required=True)
    q = simsub.add_parser(
        "serve",
        help="simulated engines with OpenAI-compatible HTTP fronts and KV-event publishers",
        description="Start N simulated engines, each with an OpenAI-compatible HTTP front "
        "and a vLLM-shaped KV-event publisher with replay.  Once all listen, print one "
        "'--engine sim-I=http://...,tcp://...,tcp://...' line per engine (for kvevents "
        "serve); run until SIGINT/SIGTERM.",
    )
    q.add_argument(
        "--engines",
        type=int,
        help="number of engines of role both (1, or 0 with --prefill/--decode)",
    )
    q.add_argument(
        "--prefill", type=int, default=0, metavar="N", help="engines of role prefill (0)"
    )
    q.add_argument("--decode", type=int, default=0, metavar="M", help="engines of role decode (0)")
    q.add_argument(
        "--name-prefix", default="", metavar="P", help="prefix of every engine name ('')"
    )
    q.add_argument("--host", default="127.0.0.1", help="HTTP address (127.0.0.1)")
    q.add_argument("--http-port", type=int, metavar="BASE", help="engine I listens on BASE+I")
    q.add_argument(
        "--events-port",
        type=int,
        metavar="BASE",
        help="engine I publishes on BASE+2I and serves replay on BASE+2I+1",
    )
    q.add_argument("--gpu-blocks", type=int, metavar="N", help="GPU blocks per engine (1024)")
    q.add_argument("--cpu-chunks", type=int, metavar="N", help="CPU chunks per engine (512; 0 off)")
    q.add_argument("--blocks-per-chunk", type=int, metavar="N", help="GPU blocks per chunk (4)")
    q.add_argument("--step-ms", type=float, default=2.0, help="fixed cost of an engine step (2 ms)")
    q.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=20.0,
        help="step time added per prompt token computed (20 us)",
    )
    q.add_argument("--lora", metavar="A[,B...]", help="LoRA adapter names served besides the base")
    q.add_argument(
        "--buffer-steps",
        type=int,
        metavar="N",
        help="batches each engine keeps for replay (10000)",
    )
    q.set_defaults(func=_cmd_sim_serve)

    p = sub.add_parser(
        "loadgen",
        help="send a seeded multi-turn chat workload to an OpenAI endpoint",
        description="Multi-turn chats (shared system prompts per tenant, growing histories) "
        "at a concurrency or a rate; reports prefix reuse (from cached_tokens), time to "
        "first token and throughput.",
    )
    p.add_argument(
        "url",
        nargs="+",
        help="base URL of the OpenAI server (e.g. http://127.0.0.1:8000); with --burst, "
        "several: the siblings of a burst alternate between them",
    )
    p.add_argument(
        "--burst",
        type=int,
        metavar="K",
        help="send bursts of K concurrent siblings sharing a new long context instead of "
        "chats; reports recomputed prompt tokens and TTFT per burst",
    )
    p.add_argument("--bursts", type=int, default=10, help="bursts to send with --burst (10)")
    p.add_argument(
        "--context-words",
        type=int,
        nargs=2,
        default=(1500, 3000),
        metavar=("LO", "HI"),
        help="words of a burst's shared context (1500 3000: about 2k-8k tokens)",
    )
    p.add_argument("--requests", type=int, default=200, help="requests to send (200)")
    p.add_argument("--tenants", type=int, default=4, help="distinct system prompts (4)")
    p.add_argument("--sessions", type=int, default=16, help="conversations open at once (16)")
    p.add_argument("--max-tokens", type=int, default=32, help="answer length (32)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=8, help="requests in flight (8)")
    load.add_argument("--rate", type=float, help="requests per second (Poisson arrivals)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    p.add_argument("--model", help="model name to send")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_loadgen)
