"""The ``kvevents serve`` HTTP application (Starlette on uvicorn, httpx upstream).

Routes:

* ``POST /v1/completions``, ``POST /v1/chat/completions``: tokenise (the engine's
  ``/tokenize`` or a local tokenizer), build the request key, rank the engine ranks that
  are up with the routing policy, and forward the body unchanged to the best one
  (``X-data-parallel-rank: r`` for a rank r > 0), streaming the answer back byte for byte
  with ``x-kvevents-worker: NAME:RANK``.  A connection refused or dropped before any
  byte was answered marks the engine down and the request goes to the next engine; once
  bytes flowed, a broken upstream is counted (and, in an SSE stream, reported as a last
  ``data: {"error": ...}`` event).  When the answer carries
  ``usage.prompt_tokens_details.cached_tokens``, the prediction is checked against it.
* ``GET /v1/models``: the engines' model lists merged (by id).
* ``POST /route``: scores only, ``{"ranked": [{"engine", "rank", "gpu", "cpu",
  "storage", "load", "cost"}, ...]}`` best first.
* ``GET /workers``, ``GET /metrics``, ``GET /healthz``, ``GET /readyz``, and the
  dashboard at ``GET /``.

Bad input gets a 400 with OpenAI's error shape ``{"error": {"message", "type", "param",
"code"}}``; no engine available gets a 503 in the same shape.

One job: the Starlette application, its routes and its lifecycle, composed from the
rooms that do the work: :mod:`~kvevents.serve.upstream` (engine clients, scrapes,
``/tokenize``), :mod:`~kvevents.serve.proxy` (forwarding and the truth check),
:mod:`~kvevents.serve.status` (``/workers``), :mod:`~kvevents.serve.answers` (body
shapes).  Imports Starlette (the ``serve`` extra) and those rooms.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from kvevents.capture import CaptureWriter
from kvevents.errors import ConfigError
from kvevents.request import RequestKey
from kvevents.serve.answers import decode_json_body
from kvevents.serve.answers import error_body as error_body  # re-exported
from kvevents.serve.config import ServeConfig
from kvevents.serve.fleet import Fleet, RankState
from kvevents.serve.proxy import Forwarder, RankStats
from kvevents.serve.routing import LoadTracker, Ranked, RoutingPolicy
from kvevents.serve.status import WorkersReport
from kvevents.serve.telemetry import ServeMetrics
from kvevents.serve.tokens import (
    BadRequest,
    LocalTokenizer,
    build_key,
    check_body,
    tokenize_body,
    tokenize_request_body,
)
from kvevents.serve.upstream import GAUGES as GAUGES  # re-exported
from kvevents.serve.upstream import EngineClients, parse_engine_metrics

__all__ = ["ServeApp", "parse_engine_metrics"]


class ServeApp:
    """One service instance: the fleet, the policy, the upstream clients, the metrics.

    Parts: ``fleet`` (event streams and index), ``policy`` and ``loads`` (routing),
    ``upstream`` (:class:`EngineClients`), ``forwarder`` (:class:`Forwarder`),
    ``report`` (:class:`WorkersReport`), ``metrics``; ``app`` is the ASGI application.
    """

    def __init__(self, config: ServeConfig, capture: CaptureWriter | None = None) -> None:
        config.validate()
        self.config = config
        self.local = LocalTokenizer(config.tokenizer) if config.tokenizer else None
        self.fleet = Fleet(config, capture)
        self.loads = LoadTracker(config.load_tokens)
        self.policy = RoutingPolicy(self.fleet, config.policy, self.loads, config.seed)
        sub = self.fleet.subscriber
        self.metrics = ServeMetrics(
            [("subscriber", sub), ("index", self.fleet.index), ("decoder", sub.decoder)]
        )
        self.upstream = EngineClients(config, self.fleet, self.loads, self.metrics)
        self.forwarder = Forwarder(
            self.fleet,
            self.loads,
            self.metrics,
            self.upstream.clients,
            self.upstream.loras,
            self.tokens,
            self.rank,
        )
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
                Route("/", self._dashboard, methods=["GET"]),
            ],
            lifespan=self._lifespan,
        )

    # --- what the parts hold, under the names callers used ---------------------------------
    @property
    def loras(self) -> set[str]:
        """Model ids that are LoRA adapters (cards with a ``parent``)."""
        return self.upstream.loras

    @property
    def engine_models(self) -> dict[str, set[str]]:
        """Model ids (base models and adapters) each engine listed in ``/v1/models``."""
        return self.upstream.engine_models

    @property
    def models(self) -> dict[str, dict[str, Any]]:
        """Every model card seen, by id."""
        return self.upstream.models

    @property
    def gauges(self) -> dict[str, dict[str, float]]:
        """Per worker label, the engine gauges last scraped."""
        return self.upstream.gauges

    @property
    def clients(self) -> dict[str, httpx.AsyncClient]:
        """One upstream client per engine name (open while the service runs)."""
        return self.upstream.clients

    @property
    def rank_stats(self) -> dict[str, RankStats]:
        """Per worker label, what was routed to it and the truth check."""
        return self.forwarder.rank_stats

    @property
    def requests_total(self) -> int:
        """Requests received on the OpenAI routes."""
        return self.forwarder.requests_total

    @property
    def started(self) -> float:
        """When the service was built (``time.time()`` seconds)."""
        return self.report.started

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
        self._tasks.append(asyncio.create_task(self.upstream.scrape_loop()))

    async def stop(self) -> None:
        """Stop scraping, close the clients and the fleet."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        await self.upstream.close()
        self.fleet.close()

    async def scrape_once(self, models: bool = False) -> None:
        """Read every engine's ``/metrics`` (and ``/v1/models``) once."""
        await self.upstream.scrape_once(models)

    # --- tokens and ranking --------------------------------------------------------------
    def _up_ranks(self) -> list[RankState]:
        now = time.monotonic()
        return [st for st in self.fleet.ranks if self.fleet.is_up(st.engine.name, now)]

    async def tokens(self, body: dict[str, Any], chat: bool) -> list[int]:
        """Token ids of a checked request ``body``: its own ``prompt_token_ids``, the
        local tokenizer when configured, else an engine's ``/tokenize``."""
        tokens = tokenize_body(body, chat, self.local)
        if tokens is not None:
            return tokens
        payload = tokenize_request_body(body, chat)
        if payload is None:  # pragma: no cover - tokenize_body handled it
            raise BadRequest("nothing to tokenise")
        return await self.upstream.tokenize(payload)

    def rank(self, key: RequestKey, model: str | None = None) -> list[Ranked]:
        """The up engine ranks for ``key``, best first.  With ``model``, only engines
        that list it in ``/v1/models`` are candidates, when any does (an engine whose
        list is unknown yet stays a candidate)."""
        ranks = self._up_ranks()
        if model is not None and any(model in m for m in self.engine_models.values()):
            ranks = [st for st in ranks if model in self.engine_models.get(st.engine.name, {model})]
        return self.policy.rank(key, ranks)

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
            merged = dict(self.models)
        return JSONResponse({"object": "list", "data": list(merged.values())})

    # --- service routes ------------------------------------------------------------------------
    async def _route(self, request: Request) -> Response:
        try:
            body = decode_json_body(await request.body())
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            chat = "messages" in body
            if not chat and "prompt" not in body and "prompt_token_ids" not in body:
                raise BadRequest("give 'prompt', 'prompt_token_ids' or 'messages'")
            check_body(body, chat)
            lora = body.get("lora_name")
            if lora is not None and not isinstance(lora, str):
                raise BadRequest("'lora_name' must be a string")
            tokens = await self.tokens(body, chat)
            key = build_key(tokens, body, self.loras)
            if lora:
                key = RequestKey(key.tokens, lora_name=lora, cache_salt=key.cache_salt)
        except BadRequest as exc:
            return self.forwarder.error("/route", str(exc), exc.status)
        except ConfigError as exc:
            return self.forwarder.error("/route", str(exc), 400)
        model = body.get("model")
        ranked = self.rank(key, model if isinstance(model, str) else None)
        self.metrics.requests.labels("/route", "200").inc()
        return JSONResponse({"tokens": len(tokens), "ranked": [r.as_json() for r in ranked]})

    def workers_json(self) -> dict[str, Any]:
        """What ``GET /workers`` answers (and the dashboard shows)."""
        return self.report.workers_json()

    async def _workers(self, request: Request) -> Response:
        return JSONResponse(self.workers_json())

    async def _metrics(self, request: Request) -> Response:
        self.workers_json()  # refresh the per-rank gauges
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
        if missing:
            return JSONResponse(
                {"ready": False, "not_ready": missing, "down": down}, status_code=503
            )
        return JSONResponse({"ready": True, "down": down})

    async def _dashboard(self, request: Request) -> Response:
        page = resources.files("kvevents.serve").joinpath("static/dashboard.html").read_text()
        return HTMLResponse(page)
