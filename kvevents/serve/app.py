"""The ``kvevents serve`` HTTP application (Starlette on uvicorn, httpx upstream).

Routes:

* ``POST /v1/completions``, ``POST /v1/chat/completions``: tokenise (the engine's
  ``/tokenize`` or a local tokenizer), build the request key, rank the engine ranks that
  are up with the routing policy, and forward the body unchanged to the best one
  (``X-data-parallel-rank: r - R`` for global rank r of a front serving ranks ``R..``
  when it serves several, see :meth:`~kvevents.engines.EngineSpec.http_rank`), streaming
  the answer back byte for byte with ``x-kvevents-worker: NAME:RANK``.  A connection refused or dropped before any
  byte was answered marks the engine down and the request goes to the next engine; once
  bytes flowed, a broken upstream is counted (and, in an SSE stream, reported as a last
  ``data: {"error": ...}`` event).  When the answer carries
  ``usage.prompt_tokens_details.cached_tokens``, the prediction is checked against it.
* ``GET /v1/models``: the engines' model lists merged (by id); each card adds
  ``kvevents_engines``: the engines that serve it, with their roles.
* ``POST /route``: the same plan as the OpenAI routes (the same checks and the same
  key) without forwarding: ``{"tokens": N, "ranked": [{"engine", "rank", "gpu", "cpu",
  "storage", "pending", "load", "cost"}, ...]}`` best first (``pending``: tokens the
  service just routed there, not yet confirmed by the engine's events), with the path
  chosen: ``disaggregated``, ``reason``, ``prefill`` (the prefill step's rank, or null)
  and ``decode`` (the rank that decodes, or serves the request whole).
* In a fleet with ``prefill`` and ``decode`` engines, a request may run as two steps in
  vLLM's KV-connector protocol (:mod:`~kvevents.serve.disagg`); the answer then has
  ``x-kvevents-prefill: NAME:RANK`` besides ``x-kvevents-worker``.
* ``GET /workers``, ``GET /metrics``, ``GET /healthz``, ``GET /readyz`` (200 once every
  rank has caught up and every up engine's index is complete, unless
  ``ready_when_incomplete``), and the dashboard at ``GET /``.
* ``GET /snapshot``: the index snapshot with every stream's resume point
  (:mod:`~kvevents.serve.bootstrap`), for a peer started with ``--bootstrap-from``; it
  needs the admin token when one is configured, and without one answers only on a
  loopback address.

Bad input gets a 400 with OpenAI's error shape ``{"error": {"message", "type":
"invalid_request_error", "param", "code"}}``, ``param`` naming the field at fault; no
engine available gets a 503 in the same shape.

One job: the Starlette application, its routes and its lifecycle, composed from the
rooms that do the work: :mod:`~kvevents.serve.plan` (parse, tokens, key, rank),
:mod:`~kvevents.serve.upstream` (engine clients, scrapes, ``/tokenize``),
:mod:`~kvevents.serve.proxy` (forwarding and the truth check),
:mod:`~kvevents.serve.status` (``/workers``), :mod:`~kvevents.serve.answers` (body
shapes).  Imports Starlette (the ``serve`` extra) and those rooms.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from kvevents.capture import CaptureWriter
from kvevents.serve.bootstrap import SNAPSHOT_MEDIA_TYPE, fetch_snapshot, is_loopback
from kvevents.serve.config import ServeConfig
from kvevents.serve.disagg import Disaggregator
from kvevents.serve.exchange import ReservationExchange
from kvevents.serve.fleet import Fleet
from kvevents.serve.plan import Planner
from kvevents.serve.proxy import Forwarder
from kvevents.serve.reservations import Reservations, pending_overlay
from kvevents.serve.routing import LoadTracker, RoutingPolicy
from kvevents.serve.status import WorkersReport
from kvevents.serve.telemetry import ServeMetrics, StreamCollector
from kvevents.serve.tokens import BadRequest, LocalTokenizer
from kvevents.serve.upstream import EngineClients

__all__ = ["ServeApp"]

logger = logging.getLogger(__name__)


class ServeApp:
    """One service instance: the fleet, the policy, the upstream clients, the metrics.

    Parts: ``fleet`` (event streams and index), ``policy`` and ``loads`` (routing),
    ``reservations`` and ``exchange`` (the pending overlay and its NATS exchange; None
    when off), ``upstream`` (:class:`EngineClients`), ``planner`` (:class:`Planner`),
    ``forwarder`` (:class:`Forwarder`), ``report`` (:class:`WorkersReport`), ``metrics``;
    ``app`` is the ASGI application.  Each part is given what it uses when it is built.
    """

    def __init__(self, config: ServeConfig, capture: CaptureWriter | None = None) -> None:
        config.validate()
        self.config = config
        boot = None
        if config.bootstrap_from is not None:
            t0 = time.perf_counter()
            boot = fetch_snapshot(config.bootstrap_from, config.admin_token)
            logger.warning(
                "bootstrap: fetched %s (%d bytes, %d streams) in %.2f s",
                config.bootstrap_from, len(boot.index), len(boot.streams),
                time.perf_counter() - t0,
            )  # fmt: skip
        self.fleet = Fleet(config, capture, boot)
        self.loads = LoadTracker(config.load_tokens)
        overlay = pending_overlay(config)
        self.policy = RoutingPolicy(
            self.fleet, config.policy, self.loads, config.seed,
            pending=overlay, pending_weight=config.pending_weight,
        )  # fmt: skip
        router = self.policy.router
        self.exchange = ReservationExchange.for_config(config, self.fleet, overlay, router)
        res = self.reservations = (
            Reservations(self.fleet, overlay, router, self.exchange)
            if overlay is not None
            else None
        )
        sub = self.fleet.subscriber
        self.metrics = ServeMetrics(
            [("subscriber", sub), ("index", self.fleet.index), ("decoder", sub.decoder)]
            + ([("pending", res)] if res is not None else [])
            + ([("pending_exchange", self.exchange)] if self.exchange is not None else [])
        )
        self.metrics.registry.register(StreamCollector(self.fleet))
        self.upstream = EngineClients(config, self.fleet, self.loads, self.metrics)
        local = LocalTokenizer(config.tokenizer) if config.tokenizer else None
        self.planner = Planner(self.fleet, self.policy, self.upstream, local)
        self.disagg = Disaggregator(config.policy, config.pd_min_uncached_tokens, config.seed)
        self.forwarder = Forwarder(
            self.fleet, self.loads, self.metrics, self.upstream.clients, self.planner,
            self.disagg, res,
        )  # fmt: skip
        self.report = WorkersReport(
            config, self.fleet, self.loads, self.metrics, self.upstream, self.forwarder
        )
        self._tasks: list[asyncio.Task[Any]] = []
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/route", self._route, methods=["POST"]),
                Route("/workers", self._workers, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/healthz", self._healthz, methods=["GET"]),
                Route("/readyz", self._readyz, methods=["GET"]),
                Route("/snapshot", self._snapshot, methods=["GET"]),
                Route("/", self._dashboard, methods=["GET"]),
            ],
            lifespan=self._lifespan,
        )

    # --- lifecycle ---------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def start(self) -> None:
        """Start following the engines' events, open the clients, start scraping."""
        self.fleet.start()
        self.upstream.open()
        if self.exchange is not None:
            await self.exchange.start()
        self._tasks.append(asyncio.create_task(self.upstream.scrape_loop()))

    async def stop(self) -> None:
        """Stop scraping, close the clients and the fleet."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self.exchange is not None:
            await self.exchange.stop()
        await self.upstream.close()
        self.fleet.close()

    # --- OpenAI routes -----------------------------------------------------------------------
    async def _completions(self, request: Request) -> Response:
        return await self.forwarder.proxy(request, "/v1/completions", chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self.forwarder.proxy(request, "/v1/chat/completions", chat=True)

    async def _models(self, request: Request) -> Response:
        merged: dict[str, dict[str, Any]] = {}
        lists = await asyncio.gather(
            *(
                self.upstream.fetch_models(s.name, s.http_base())
                for s in self.config.engines
                if self.fleet.is_up(s.name)
            )
        )
        for cards in lists:
            for c in cards:
                merged.setdefault(c["id"], c)
        if not merged:
            merged = dict(self.upstream.models)
        roles = {s.name: s.role for s in self.config.engines}
        data = []
        for mid, card in merged.items():
            serving = {
                name: roles[name]
                for name, ids in self.upstream.engine_models.items()
                if mid in ids and name in roles
            }
            data.append({**card, "kvevents_engines": serving})
        return JSONResponse({"object": "list", "data": data})

    # --- service routes ------------------------------------------------------------------------
    async def _route(self, request: Request) -> Response:
        try:
            plan = await self.planner.plan(await request.body())
        except BadRequest as exc:
            return self.forwarder.refuse("/route", exc)
        self.metrics.requests.labels("/route", "200").inc()
        ranked = [r.as_json() for r in plan.ranked]
        route = self.disagg.route(plan) if plan.ranked else None
        body: dict[str, Any] = {"tokens": len(plan.tokens), "ranked": ranked}
        if route is not None:
            body.update(route.as_json())
        return JSONResponse(body)

    async def _workers(self, request: Request) -> Response:
        return JSONResponse(self.report.workers_json())

    async def _metrics(self, request: Request) -> Response:
        self.report.workers_json()  # refresh the per-rank gauges
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def _healthz(self, request: Request) -> Response:
        if self.fleet.error is not None:
            return JSONResponse(
                {"status": "error", "detail": f"consumer thread failed: {self.fleet.error!r}"},
                status_code=503,
            )
        return JSONResponse({"status": "ok"})

    async def _readyz(self, request: Request) -> Response:
        missing = self.fleet.not_ready()
        now = time.monotonic()
        down = [e.name for e in self.config.engines if not self.fleet.is_up(e.name, now)]
        incomplete = self.fleet.incomplete(now)
        body: dict[str, Any] = {"ready": True, "down": down, "incomplete": incomplete}
        if missing:
            body.update(ready=False, not_ready=missing)
        elif incomplete and not self.config.ready_when_incomplete:
            body["ready"] = False
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    async def _snapshot(self, request: Request) -> Response:
        """The index snapshot with every stream's resume point (``--bootstrap-from``)."""
        token = self.config.admin_token
        if token is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return self.forwarder.error("/snapshot", "a valid admin token is required", 401)
        elif not is_loopback(self.config.host):
            return self.forwarder.error(
                "/snapshot",
                "the service listens beyond loopback: start it with --admin-token to serve "
                "/snapshot",
                403,
            )
        snap = await asyncio.to_thread(self.fleet.snapshot)
        self.metrics.requests.labels("/snapshot", "200").inc()
        return Response(snap.encode(), media_type=SNAPSHOT_MEDIA_TYPE)

    async def _dashboard(self, request: Request) -> Response:
        page = resources.files("kvevents.serve").joinpath("static/dashboard.html").read_text()
        return HTMLResponse(page)
