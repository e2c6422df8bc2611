"""The service's side-channel to its engines: one httpx client per engine, the periodic
``/metrics`` scrape (vLLM's load gauges) and ``/v1/models`` listing, and tokenising a
request through an engine's ``/tokenize``.

One job: talking to engines about anything but the forwarded request itself (that is
:mod:`kvevents.serve.proxy`).  Imports httpx (the ``serve`` extra), the fleet, the load
tracker, the metrics and :mod:`kvevents.serve.answers`.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import httpx

from kvevents.serve.answers import error_message
from kvevents.serve.config import ServeConfig
from kvevents.serve.fleet import Fleet
from kvevents.serve.routing import LoadTracker
from kvevents.serve.telemetry import ServeMetrics
from kvevents.serve.tokens import BadRequest

__all__ = ["GAUGES", "EngineClients", "parse_engine_metrics"]

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
"""The vLLM gauges the service reads from each engine's ``/metrics``."""


def parse_engine_metrics(text: str) -> dict[int, dict[str, float]]:
    """vLLM's gauges from a ``/metrics`` page: per rank (the ``engine`` label, 0 when
    absent), the value of each name in :data:`GAUGES` (summed over other labels)."""
    out: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        head, _, value = line.rpartition(" ")
        name, brace, labels = head.partition("{")
        if name not in GAUGES:
            continue
        rank = 0
        if brace:
            for part in labels.rstrip("}").split(","):
                k, _, v = part.partition("=")
                if k.strip() == "engine":
                    try:
                        rank = int(v.strip().strip('"'))
                    except ValueError:
                        rank = 0
        try:
            val = float(value)
        except ValueError:
            continue
        d = out.setdefault(rank, {})
        d[name] = d.get(name, 0.0) + val
    return out


class EngineClients:
    """The per-engine HTTP clients and what they learned.

    * ``clients``: one :class:`httpx.AsyncClient` per engine name (opened by
      :meth:`open`, closed by :meth:`close`): httpx scans every pooled connection of a
      client on each request, so one shared pool grows slower with every engine added;
    * ``gauges``: per worker label ``NAME:RANK``, the last scraped :data:`GAUGES`;
    * ``models``: every model card seen, by id; ``loras``: the ids that are adapters
      (cards with a ``parent``); ``engine_models``: the ids each engine listed.

    Every transport error is counted in ``kvevents_serve_upstream_errors``.  An engine
    whose ``/tokenize`` does not answer is marked down in the fleet at once; one whose
    ``/metrics`` does not answer within ``scrape_timeout_s`` only after
    ``scrape_failures`` such scrapes in a row (:meth:`Fleet.scrape_failed`); one whose
    ``/metrics`` answers is marked up.
    """

    def __init__(
        self, config: ServeConfig, fleet: Fleet, loads: LoadTracker, metrics: ServeMetrics
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.loads = loads
        self.metrics = metrics
        self.clients: dict[str, httpx.AsyncClient] = {}
        self.gauges: dict[str, dict[str, float]] = {}
        self.models: dict[str, dict[str, Any]] = {}
        self.loras: set[str] = set()
        self.engine_models: dict[str, set[str]] = {}
        self._tok_next = 0

    def open(self) -> None:
        """Open one client per engine (request and connect timeouts from the config)."""
        cfg = self.config
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        tls = ssl.create_default_context()  # one for all: building one costs ~40 ms
        for spec in cfg.engines:
            self.clients[spec.name] = httpx.AsyncClient(timeout=timeout, limits=limits, verify=tls)

    async def close(self) -> None:
        """Close every client."""
        for client in self.clients.values():
            await client.aclose()
        self.clients.clear()

    # --- /metrics and /v1/models ------------------------------------------------------------
    async def scrape_loop(self) -> None:
        """Scrape every ``scrape_interval_s`` seconds, model lists every tenth time;
        runs until cancelled."""
        n = 0
        while True:
            await self.scrape_once(models=n % 10 == 0)
            n += 1
            await asyncio.sleep(self.config.scrape_interval_s)

    async def scrape_once(self, models: bool = False) -> None:
        """Read every engine's ``/metrics`` (and ``/v1/models``) once."""
        await asyncio.gather(*(self._scrape(spec.name, models) for spec in self.config.engines))
        for spec in self.config.engines:
            self.metrics.engine_up.labels(spec.name).set(1 if self.fleet.is_up(spec.name) else 0)

    async def _scrape(self, name: str, models: bool) -> None:
        spec = next(e for e in self.config.engines if e.name == name)
        client = self.clients[name]
        timeout = httpx.Timeout(self.config.scrape_timeout_s)
        try:
            r = await client.get(spec.http_base() + "/metrics", timeout=timeout)
            if r.status_code == 200:
                per_rank = parse_engine_metrics(r.text)
                for rank, g in per_rank.items():
                    label = f"{name}:{rank}"
                    self.gauges[label] = g
                    self.loads.set_gauges(
                        label,
                        g.get(GAUGES[0], 0.0),
                        g.get(GAUGES[1], 0.0),
                        g.get(GAUGES[2], 0.0),
                    )
            self.fleet.scrape_ok(name)
            if models or not self.models:
                await self.fetch_models(spec.name, spec.http_base())
        except httpx.TransportError as exc:
            self.metrics.upstream_errors.labels(name, "scrape").inc()
            self.fleet.scrape_failed(name, f"/metrics: {type(exc).__name__}")

    async def fetch_models(self, name: str, url: str) -> list[dict[str, Any]]:
        """Engine ``name``'s ``/v1/models`` cards (``url`` is its base URL), recorded in
        ``models``, ``loras`` and ``engine_models``; ``[]`` if it does not answer."""
        try:
            r = await self.clients[name].get(url + "/v1/models", timeout=5.0)
            data = r.json().get("data", []) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError):
            return []
        cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
        for c in cards:
            self.models.setdefault(c["id"], c)
            if c.get("parent"):
                self.loras.add(c["id"])
        if cards:
            self.engine_models[name] = {c["id"] for c in cards}
        return cards

    # --- /tokenize --------------------------------------------------------------------------
    async def tokenize(self, payload: dict[str, Any]) -> list[int]:
        """Token ids of a ``/tokenize`` ``payload``, asked of the engines that are up in
        turn (round robin; an engine that fails at transport or with a 5xx is skipped).

        Raises :class:`BadRequest`: 503 when no engine is up or none could answer, the
        engine's own message (400) when it refuses the request, 502 when its answer
        has no ``tokens``.
        """
        specs = [s for s in self.config.engines if self.fleet.is_up(s.name)]
        if not specs:
            raise BadRequest("no engine is up to tokenise the request", 503)
        start = self._tok_next
        self._tok_next += 1
        for i in range(len(specs)):
            spec = specs[(start + i) % len(specs)]
            try:
                r = await self.clients[spec.name].post(spec.http_base() + "/tokenize", json=payload)
            except httpx.TransportError as exc:
                self.metrics.upstream_errors.labels(spec.name, "tokenize").inc()
                self.fleet.mark_down(spec.name, f"/tokenize: {type(exc).__name__}")
                continue
            if r.status_code >= 500:
                self.metrics.upstream_errors.labels(spec.name, "tokenize").inc()
                continue
            try:
                answer = r.json()
            except ValueError:
                answer = None
            if r.status_code != 200:
                raise BadRequest(error_message(answer) or f"tokenisation failed ({r.status_code})")
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if not isinstance(tokens, list):
                raise BadRequest(f"{spec.name}'s /tokenize answered without 'tokens'", 502)
            return [int(t) for t in tokens]
        raise BadRequest("no engine could tokenise the request", 503)
