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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import httpx
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvevents.capture import CaptureWriter
from kvevents.errors import ConfigError
from kvevents.request import RequestKey
from kvevents.serve.config import ServeConfig
from kvevents.serve.fleet import Fleet, RankState
from kvevents.serve.routing import LoadTracker, Ranked, RoutingPolicy
from kvevents.serve.telemetry import ServeMetrics
from kvevents.serve.tokens import (
    BadRequest,
    LocalTokenizer,
    build_key,
    check_body,
    tokenize_body,
    tokenize_request_body,
)

__all__ = ["ServeApp", "parse_engine_metrics"]

logger = logging.getLogger(__name__)

_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}
_TAIL = 1 << 16
_BODY_CAP = 8 << 20
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def error_body(message: str, status: int) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = {
        400: "invalid_request_error",
        404: "not_found_error",
        502: "upstream_error",
        503: "service_unavailable",
        504: "upstream_timeout",
    }.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


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


@dataclass
class _RankStats:
    routed: int = 0
    predicted: int = 0
    reported: int = 0
    exact: int = 0
    over: int = 0
    under: int = 0
    unchecked: int = 0
    errors: int = 0
    checks: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=50))


class ServeApp:
    """One service instance: the fleet, the policy, the upstream client, the metrics."""

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
        self.loras: set[str] = set()
        self.engine_models: dict[str, set[str]] = {}
        """Model ids (base models and adapters) each engine listed in ``/v1/models``."""
        self.models: dict[str, dict[str, Any]] = {}
        self.rank_stats: dict[str, _RankStats] = {st.label: _RankStats() for st in self.fleet.ranks}
        self.gauges: dict[str, dict[str, float]] = {}
        self.clients: dict[str, httpx.AsyncClient] = {}
        """One upstream client per engine: httpx scans every pooled connection of a client
        on each request, so one shared pool grows slower with every engine added."""
        self.started = time.time()
        self._tok_next = 0
        self._summary: tuple[float, dict[Any, Any]] = (-1e9, {})
        self._summary_cost = 0.0
        self._tasks: list[asyncio.Task[Any]] = []
        self.requests_total = 0
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

    # --- lifecycle ---------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def start(self) -> None:
        self.fleet.start()
        cfg = self.config
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        tls = ssl.create_default_context()  # one for all: building one costs ~40 ms
        for spec in cfg.engines:
            self.clients[spec.name] = httpx.AsyncClient(timeout=timeout, limits=limits, verify=tls)
        self._tasks.append(asyncio.create_task(self._scrape_loop()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        for client in self.clients.values():
            await client.aclose()
        self.clients.clear()
        self.fleet.close()

    # --- engine metrics and models ---------------------------------------------------------
    async def _scrape_loop(self) -> None:
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
        timeout = httpx.Timeout(max(1.0, self.config.scrape_interval_s * 2), connect=1.0)
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
            self.fleet.mark_up(name)
            if models or not self.models:
                await self._fetch_models(spec.name, spec.http_base())
        except httpx.TransportError as exc:
            self.metrics.upstream_errors.labels(name, "scrape").inc()
            self.fleet.mark_down(name, f"/metrics: {type(exc).__name__}")

    async def _fetch_models(self, name: str, url: str) -> list[dict[str, Any]]:
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

    # --- helpers -----------------------------------------------------------------------------
    def _error(self, route: str, message: str, status: int) -> JSONResponse:
        self.metrics.requests.labels(route, str(status)).inc()
        return JSONResponse(error_body(message, status), status_code=status)

    def _up_ranks(self) -> list[RankState]:
        now = time.monotonic()
        return [st for st in self.fleet.ranks if self.fleet.is_up(st.engine.name, now)]

    async def _tokens(self, body: dict[str, Any], chat: bool) -> list[int]:
        tokens = tokenize_body(body, chat, self.local)
        if tokens is not None:
            return tokens
        payload = tokenize_request_body(body, chat)
        if payload is None:  # pragma: no cover - tokenize_body handled it
            raise BadRequest("nothing to tokenise")
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
                raise BadRequest(_message(answer) or f"tokenisation failed ({r.status_code})")
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if not isinstance(tokens, list):
                raise BadRequest(f"{spec.name}'s /tokenize answered without 'tokens'", 502)
            return [int(t) for t in tokens]
        raise BadRequest("no engine could tokenise the request", 503)

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
        return await self._proxy(request, "/v1/completions", chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self._proxy(request, "/v1/chat/completions", chat=True)

    async def _proxy(self, request: Request, path: str, *, chat: bool) -> Response:
        t0 = time.perf_counter()
        self.requests_total += 1
        raw = await request.body()
        try:
            body = check_body(_json(raw), chat)
            tokens = await self._tokens(body, chat)
            key = build_key(tokens, body, self.loras)
        except BadRequest as exc:
            return self._error(path, str(exc), exc.status)
        except ConfigError as exc:
            return self._error(path, str(exc), 400)
        model = body.get("model")
        ranked = self.rank(key, model if isinstance(model, str) else None)
        self.metrics.overhead.observe(time.perf_counter() - t0)
        if not ranked:
            return self._error(path, "no engine is available", 503)
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _HOP
            and k.lower() not in ("accept-encoding", "x-data-parallel-rank")
        }
        tried: set[str] = set()
        stream = bool(body.get("stream"))
        last_error = "no engine is available"
        for cand in ranked:
            st = cand.state
            name = st.engine.name
            if name in tried or not self.fleet.is_up(name):
                continue
            h = dict(headers)
            if st.rank > 0:
                h["X-data-parallel-rank"] = str(st.rank)
            uncached = max(0, len(tokens) - cand.match.total)
            self.loads.started(st.label, uncached)
            client = self.clients[name]
            req = client.build_request("POST", st.engine.http_base() + path, content=raw, headers=h)
            try:
                resp = await client.send(req, stream=True)
            except (
                httpx.ConnectError,
                httpx.ConnectTimeout,
                httpx.RemoteProtocolError,
                httpx.ReadError,
            ) as exc:
                # nothing was answered: the engine is gone; try the next one
                self.loads.answered(st.label, uncached)
                self.loads.finished(st.label)
                self.metrics.upstream_errors.labels(name, type(exc).__name__).inc()
                self.rank_stats[st.label].errors += 1
                self.fleet.mark_down(name, f"{path}: {type(exc).__name__}")
                self.metrics.retries.inc()
                tried.add(name)
                last_error = f"engine {name} failed: {type(exc).__name__}"
                continue
            except httpx.HTTPError as exc:
                self.loads.answered(st.label, uncached)
                self.loads.finished(st.label)
                self.metrics.upstream_errors.labels(name, type(exc).__name__).inc()
                self.rank_stats[st.label].errors += 1
                status = 504 if isinstance(exc, httpx.TimeoutException) else 502
                return self._error(path, f"engine {name} failed: {type(exc).__name__}", status)
            self.metrics.routed.labels(name, str(st.rank)).inc()
            self.rank_stats[st.label].routed += 1
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            out_headers["x-kvevents-worker"] = st.label
            return StreamingResponse(
                self._relay(resp, cand, len(tokens), uncached, t0, path, stream),
                status_code=resp.status_code,
                headers=out_headers,
            )
        return self._error(path, last_error, 503)

    async def _relay(
        self,
        resp: httpx.Response,
        cand: Ranked,
        n_tokens: int,
        uncached: int,
        t0: float,
        path: str,
        stream: bool,
    ) -> AsyncIterator[bytes]:
        st = cand.state
        label = st.label
        first = True
        ok = False
        gone = False
        buf = bytearray()
        try:
            async for chunk in resp.aiter_raw():
                if first:
                    first = False
                    self.metrics.ttfb.labels(path).observe(time.perf_counter() - t0)
                    self.loads.answered(label, uncached)
                if stream:
                    buf += chunk
                    if len(buf) > 2 * _TAIL:
                        del buf[:-_TAIL]
                elif len(buf) < _BODY_CAP:
                    buf += chunk
                yield chunk
            ok = True
        except httpx.HTTPError as exc:
            self.metrics.upstream_errors.labels(
                st.engine.name, "stream_" + type(exc).__name__
            ).inc()
            self.rank_stats[label].errors += 1
            if isinstance(exc, (httpx.ReadError, httpx.RemoteProtocolError)):
                self.fleet.mark_down(st.engine.name, f"{path}: answer broken off")
            if stream:
                err = error_body(f"engine {label} broke off the answer: {type(exc).__name__}", 502)
                yield b"data: " + json.dumps(err).encode() + b"\n\n"
        except (GeneratorExit, asyncio.CancelledError):
            gone = True  # the client went away: counted as 499, nothing to check
            raise
        finally:
            await resp.aclose()
            if first:
                self.loads.answered(label, uncached)
            self.loads.finished(label)
            self.metrics.latency.labels(path).observe(time.perf_counter() - t0)
            status = resp.status_code if ok else (499 if gone else 502)
            self.metrics.requests.labels(path, str(status)).inc()
            if ok and resp.status_code == 200:
                self._truth(cand, bytes(buf), stream)

    def _truth(self, cand: Ranked, body: bytes, stream: bool) -> None:
        """Compare the prediction with the engine's ``cached_tokens``."""
        st = cand.state
        stats = self.rank_stats[st.label]
        reported = _cached_tokens(body, stream)
        name = st.engine.name
        if reported is None:
            stats.unchecked += 1
            self.metrics.unchecked.labels(name).inc()
            return
        predicted = cand.match.total
        err = predicted - reported
        stats.predicted += predicted
        stats.reported += reported
        stats.checks.append((predicted, reported))
        outcome = "exact" if err == 0 else ("over" if err > 0 else "under")
        setattr(stats, outcome, getattr(stats, outcome) + 1)
        m = self.metrics
        m.pred_error.labels(name).observe(err)
        m.pred_outcome.labels(name, outcome).inc()
        m.predicted_tokens.labels(name).inc(predicted)
        m.reported_tokens.labels(name).inc(reported)

    async def _models(self, request: Request) -> Response:
        merged: dict[str, dict[str, Any]] = {}
        lists = await asyncio.gather(
            *(
                self._fetch_models(s.name, s.http_base())
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
            body = _json(await request.body())
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            chat = "messages" in body
            if not chat and "prompt" not in body and "prompt_token_ids" not in body:
                raise BadRequest("give 'prompt', 'prompt_token_ids' or 'messages'")
            check_body(body, chat)
            lora = body.get("lora_name")
            if lora is not None and not isinstance(lora, str):
                raise BadRequest("'lora_name' must be a string")
            tokens = await self._tokens(body, chat)
            key = build_key(tokens, body, self.loras)
            if lora:
                key = RequestKey(key.tokens, lora_name=lora, cache_salt=key.cache_salt)
        except BadRequest as exc:
            return self._error("/route", str(exc), exc.status)
        except ConfigError as exc:
            return self._error("/route", str(exc), 400)
        model = body.get("model")
        ranked = self.rank(key, model if isinstance(model, str) else None)
        self.metrics.requests.labels("/route", "200").inc()
        return JSONResponse({"tokens": len(tokens), "ranked": [r.as_json() for r in ranked]})

    def _index_summary(self) -> dict[Any, Any]:
        """Per-worker tier holdings, recomputed at most every second, and less often as
        the index grows: the walk holds the index lock (about 0.4 µs per entry), so it
        runs at most 5 % of the time."""
        now = time.monotonic()
        at, cached = self._summary
        if now - at < max(1.0, 20 * self._summary_cost):
            return cached
        t0 = time.perf_counter()
        with self.fleet.lock:
            summary = self.fleet.index.summary()
        self._summary_cost = time.perf_counter() - t0
        self._summary = (now, summary)
        return summary

    def workers_json(self) -> dict[str, Any]:
        """What ``GET /workers`` answers (and the dashboard shows)."""
        now_m = time.monotonic()
        now = time.time()
        summary = self._index_summary()
        out = []
        for st in self.fleet.ranks:
            ws = summary.get(self.fleet.worker_id(st))
            blocks = {
                tier: {"entries": t.entries, "tokens": t.tokens}
                for tier, t in (ws.tiers.items() if ws is not None else [])
            }
            for tier in ("GPU", "CPU", "STORAGE"):
                blocks.setdefault(tier, {"entries": 0, "tokens": 0})
            rs = self.rank_stats[st.label]
            up = self.fleet.is_up(st.engine.name, now_m)
            out.append(
                {
                    "worker": st.label,
                    "engine": st.engine.name,
                    "rank": st.rank,
                    "url": st.engine.http_base(),
                    "events_endpoint": st.events_endpoint,
                    "replay_endpoint": st.replay_endpoint,
                    "up": up,
                    "down_reason": self.fleet.down_reason.get(st.engine.name),
                    "state": "live" if up and st.connected else "stale",
                    "ready": st.ready,
                    "connected": st.connected,
                    "replay_answered": st.replay_answered,
                    "last_seq": st.last_seq,
                    "batches": st.batches,
                    "events": st.events,
                    "events_per_s": round(st.events_per_s(now_m), 2),
                    "lag_s": None
                    if st.last_event_ts is None
                    else round(max(0.0, now - st.last_event_ts), 3),
                    "anomalies": dict(st.anomalies),
                    "recent_anomalies": list(st.recent_anomalies),
                    "blocks": blocks,
                    "in_flight": self.loads.inflight.get(st.label, 0),
                    "load": round(self.loads.load(st.label), 1),
                    "engine_gauges": self.gauges.get(st.label, {}),
                    "routed": rs.routed,
                    "predicted_cached_tokens": rs.predicted,
                    "reported_cached_tokens": rs.reported,
                    "truth": {
                        "exact": rs.exact,
                        "over": rs.over,
                        "under": rs.under,
                        "unchecked": rs.unchecked,
                    },
                    "recent_checks": [list(c) for c in rs.checks][-20:],
                    "upstream_errors": rs.errors,
                }
            )
            self.metrics.inflight.labels(st.engine.name, str(st.rank)).set(
                self.loads.inflight.get(st.label, 0)
            )
            self.metrics.load.labels(st.engine.name, str(st.rank)).set(self.loads.load(st.label))
        for spec in self.config.engines:
            self.metrics.engine_up.labels(spec.name).set(1 if self.fleet.is_up(spec.name) else 0)
        return {
            "time": now,
            "uptime_s": round(now - self.started, 1),
            "policy": self.config.policy,
            "ready": not self.fleet.not_ready(),
            "requests": self.requests_total,
            "consumer_error": None if self.fleet.error is None else repr(self.fleet.error),
            "workers": out,
        }

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


def _json(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise BadRequest("the request body is not valid JSON") from None


def _message(answer: Any) -> str | None:
    if isinstance(answer, Mapping):
        if isinstance(answer.get("error"), Mapping):
            return str(answer["error"].get("message"))
        if answer.get("message"):
            return str(answer["message"])
        if answer.get("detail"):
            return str(answer["detail"])
    return None


def _cached_tokens(body: bytes, stream: bool) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an answer (the last SSE event
    carrying usage when streamed), or None."""
    docs: list[Any] = []
    if stream:
        for event in reversed(body.split(b"\n\n")):
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and b'"usage"' in line:
                    with contextlib.suppress(ValueError):
                        docs.append(json.loads(line[5:].strip()))
            if docs:
                break
    else:
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            docs.append(json.loads(body))
    for doc in docs:
        usage = doc.get("usage") if isinstance(doc, dict) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and not isinstance(cached, bool):
            return cached
    return None
