"""Forwarding one OpenAI request: pick the best engine rank, send the body unchanged,
stream the answer back byte for byte, fail over when an engine is gone before it
answered, and check the prediction against the ``cached_tokens`` it reports.  A request
split into prefill and decode steps (:mod:`~kvevents.serve.disagg`) is sent twice: the
prefill step to a prefill engine, then the decode step, whose answer is streamed back
with ``x-kvevents-prefill`` and ``x-kvevents-worker`` naming the two ranks; the prefill
step's ``cached_tokens`` is what gets checked.

One job: the ``/v1/completions`` and ``/v1/chat/completions`` path.  Imports httpx and
Starlette (the ``serve`` extra), the fleet, routing, telemetry, answers and plan rooms: a
request is planned (checked, tokenised, keyed and ranked) by the
:class:`~kvevents.serve.plan.Planner` it is given, the one ``/route`` uses too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvevents.serve.answers import (
    BODY_CAP_BYTES,
    HOP_HEADERS,
    SSE_TAIL_BYTES,
    cached_tokens,
    error_body,
)
from kvevents.serve.disagg import Disaggregator, answer_params, decode_body, prefill_body
from kvevents.serve.fleet import Fleet, RankState
from kvevents.serve.plan import Planner, RequestPlan
from kvevents.serve.reservations import Reservations
from kvevents.serve.routing import LoadTracker, Ranked
from kvevents.serve.telemetry import ServeMetrics
from kvevents.serve.tokens import BadRequest

_ENGINE_GONE = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
)
"""Errors after which nothing was answered: the engine is gone, the next one is tried."""

__all__ = ["Forwarder", "RankStats"]


@dataclass(frozen=True)
class _Answer:
    """An engine's answer to one step: the candidate that gave it, the response (its
    body not yet read when streamed), the prompt tokens its load was started with and
    its reservation (None: none taken)."""

    cand: Ranked
    resp: httpx.Response
    uncached: int
    rid: int | None


@dataclass(frozen=True)
class _Exhausted:
    """No candidate answered: each was down or gone (``last_error`` says the last)."""

    last_error: str


@dataclass
class RankStats:
    """What the service saw of one engine rank: requests routed to it, the online truth
    check (tokens predicted and reported cached; exact/over/under/unchecked answers;
    the last 50 ``(predicted, reported)`` pairs) and upstream errors."""

    routed: int = 0
    predicted: int = 0
    reported: int = 0
    exact: int = 0
    over: int = 0
    under: int = 0
    unchecked: int = 0
    errors: int = 0
    checks: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=50))
    pending: int = 0
    """Pending tokens credited (part of ``predicted``): routed there before, unconfirmed."""
    pending_over: int = 0
    """Checks where pending credit was not reused (the engine reused less than
    confirmed + pending): over-credit with pending credit in it, counted apart."""
    pending_over_tokens: int = 0
    """Of those checks' over-credit, the tokens that came from pending."""
    pending_under: int = 0
    """Checks with pending credit where the engine reused more than confirmed + pending."""
    pending_under_tokens: int = 0
    prefills: int = 0
    """Prefill steps of disaggregated requests it answered (part of ``routed``)."""


class Forwarder:
    """Forwards requests to the engines.

    ``planner`` plans each request; ``disagg`` decides whether it is split into prefill
    and decode steps; ``reservations`` (when the service has a pending overlay) is told
    of every request sent and ended; ``clients`` maps engine names to their httpx clients
    (filled when the service starts); ``rank_stats`` holds one :class:`RankStats` per
    worker label; ``requests_total`` counts every request that reached :meth:`proxy`.
    """

    def __init__(
        self,
        fleet: Fleet,
        loads: LoadTracker,
        metrics: ServeMetrics,
        clients: dict[str, httpx.AsyncClient],
        planner: Planner,
        disagg: Disaggregator,
        reservations: Reservations | None = None,
    ) -> None:
        self.fleet = fleet
        self.loads = loads
        self.metrics = metrics
        self.clients = clients
        self.planner = planner
        self.disagg = disagg
        self.rank_stats: dict[str, RankStats] = {st.label: RankStats() for st in fleet.ranks}
        self.requests_total = 0
        self.reservations = reservations
        """The pending overlay's hooks (None: the service has no overlay)."""

    def error(
        self, route: str, message: str, status: int, param: str | None = None
    ) -> JSONResponse:
        """OpenAI's error answer, counted in ``kvevents_serve_requests``."""
        self.metrics.requests.labels(route, str(status)).inc()
        return JSONResponse(error_body(message, status, param), status_code=status)

    def refuse(self, route: str, exc: BadRequest) -> JSONResponse:
        """The error answer to a request that could not be planned."""
        return self.error(route, str(exc), exc.status, exc.param)

    async def proxy(self, request: Request, path: str, *, chat: bool) -> Response:
        """Forward ``request`` (a POST to ``path``) to the best rank that is up; a rank
        whose engine refuses or drops the connection before answering is marked down
        and the next one is tried; 503 when none is left.

        A request the :class:`~kvevents.serve.disagg.Disaggregator` splits runs in two
        steps: the prefill step (:meth:`_prefill`), then the decode step with the
        prefill answer's ``kv_transfer_params``, whose answer is streamed back.  When
        every prefill candidate fails, the request is served whole."""
        t0 = time.perf_counter()
        self.requests_total += 1
        try:
            plan = await self.planner.plan(await request.body(), chat)
        except BadRequest as exc:
            return self.refuse(path, exc)
        self.metrics.overhead.observe(time.perf_counter() - t0)
        if not plan.ranked:
            return self.error(path, "no engine is available", 503)
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in HOP_HEADERS
            and k.lower() not in ("accept-encoding", "x-data-parallel-rank")
        }
        route = self.disagg.route(plan)
        raw, cands, check = plan.raw, route.decode, True
        extra: dict[str, str] = {}
        if route.disaggregated:
            try:
                step = await self._prefill(plan, route.prefill, headers, path)
            except BadRequest as exc:
                return self.refuse(path, exc)
            if isinstance(step, Response):
                return step
            if step is None:
                # every prefill engine failed before answering: served whole
                self.metrics.pd_requests.labels("prefill_failed").inc()
                cands = route.whole
            else:
                cand, params, cached = step
                extra["x-kvevents-prefill"] = cand.state.label
                if cached is not None:
                    extra["x-kvevents-prefill-cached-tokens"] = str(cached)
                if params is not None:
                    raw, check = decode_body(plan.raw, params), False
                    self.metrics.pd_requests.labels("disaggregated").inc()
                else:
                    # no connector answered: the decode engine computes the prompt itself
                    self.metrics.pd_requests.labels("no_transfer_params").inc()
        else:
            self.metrics.pd_requests.labels(route.reason).inc()
        return await self._forward(plan, cands, raw, headers, path, t0, check, extra)

    async def _prefill(
        self, plan: RequestPlan, cands: list[Ranked], headers: dict[str, str], path: str
    ) -> tuple[Ranked, msgspec.Raw | None, int | None] | Response | None:
        """Run the prefill step on the first of ``cands`` that answers: ``(rank, the
        answer's kv_transfer_params, its cached_tokens)``; the engine's own answer when
        it is not a 200 (passed back to the client); None when every candidate failed
        before answering (each marked down)."""
        body = prefill_body(plan.raw)
        answer = await self._first_answer(plan, cands, body, headers, path, prefill=True)
        if isinstance(answer, _Exhausted):
            return None
        if isinstance(answer, Response):
            return answer
        cand, resp = answer.cand, answer.resp
        st = cand.state
        self.loads.answered(st.label, answer.uncached)
        self.loads.finished(st.label)
        if self.reservations is not None:
            self.reservations.finished(answer.rid)
        self.rank_stats[st.label].prefills += 1
        if resp.status_code != 200:
            self.metrics.requests.labels(path, str(resp.status_code)).inc()
            out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
            out["x-kvevents-prefill"] = st.label
            return Response(resp.content, status_code=resp.status_code, headers=out)
        self.check_truth(cand, resp.content, False)
        return cand, answer_params(resp.content), cached_tokens(resp.content, False)

    async def _first_answer(
        self,
        plan: RequestPlan,
        cands: list[Ranked],
        body: bytes,
        headers: dict[str, str],
        path: str,
        *,
        prefill: bool = False,
        charge: bool = True,
    ) -> _Answer | JSONResponse | _Exhausted:
        """Send ``body`` to the first of ``cands`` whose engine is up and answers: the
        failover loop of both steps.

        Each try starts the rank's load (``uncached`` prompt tokens, when ``charge``;
        else 0) and its reservation.  An engine gone before answering (``_ENGINE_GONE``)
        is marked down, its load released and its reservation dropped, and the next
        engine is tried; any other HTTP error ends the request (a 504 for a timeout,
        else 502).  The answer's rank is counted as routed; the caller owns its load and
        reservation from then on.  ``prefill``: the prefill step, whose answer is read
        whole (the whole request's is streamed).  :class:`_Exhausted` when no candidate
        answered."""
        what = "prefill engine" if prefill else "engine"
        n = len(plan.tokens)
        res = self.reservations
        tried: set[str] = set()
        last_error = "no engine is available"
        for cand in cands:
            st = cand.state
            name = st.engine.name
            if name in tried or not self.fleet.is_up(name):
                continue
            h = dict(headers)
            if st.engine.dp_size > 1:
                # pin the rank: without the header vLLM's front balances over its ranks
                h["X-data-parallel-rank"] = str(st.engine.http_rank(st.rank))
            uncached = max(0, n - cand.match.total - cand.pending) if charge else 0
            self.loads.started(st.label, uncached)
            rid = res.reserve(plan.key, st) if res is not None else None
            client = self.clients[name]
            req = client.build_request(
                "POST", st.engine.http_base() + path, content=body, headers=h
            )
            try:
                resp = await client.send(req, stream=not prefill)
            except _ENGINE_GONE as exc:
                # nothing was answered: the engine is gone; try the next one
                if res is not None:
                    res.dropped(rid)
                self._failed(st, path, exc, uncached)
                step = " (prefill)" if prefill else ""
                self.fleet.mark_down(name, f"{path}{step}: {type(exc).__name__}")
                self.metrics.retries.inc()
                tried.add(name)
                last_error = f"{what} {name} failed: {type(exc).__name__}"
                continue
            except httpx.HTTPError as exc:
                if res is not None:
                    res.finished(rid)
                self._failed(st, path, exc, uncached)
                status = 504 if isinstance(exc, httpx.TimeoutException) else 502
                return self.error(path, f"{what} {name} failed: {type(exc).__name__}", status)
            self.metrics.routed.labels(name, str(st.rank)).inc()
            self.rank_stats[st.label].routed += 1
            return _Answer(cand, resp, uncached, rid)
        return _Exhausted(last_error)

    def _failed(self, st: RankState, path: str, exc: Exception, uncached: int) -> None:
        """Count an upstream call to ``st`` that failed before answering (its load,
        ``uncached`` prompt tokens, released)."""
        self.loads.answered(st.label, uncached)
        self.loads.finished(st.label)
        self.metrics.upstream_errors.labels(st.engine.name, type(exc).__name__).inc()
        self.rank_stats[st.label].errors += 1

    async def _forward(
        self,
        plan: RequestPlan,
        cands: list[Ranked],
        raw: bytes,
        headers: dict[str, str],
        path: str,
        t0: float,
        check: bool,
        extra: dict[str, str],
    ) -> Response:
        """Send ``raw`` to the first of ``cands`` that answers and stream its answer
        back (the whole request, or a decode step when ``check`` is False: its
        ``cached_tokens`` count the transferred prefix, so it is not checked)."""
        answer = await self._first_answer(plan, cands, raw, headers, path, charge=check)
        if isinstance(answer, _Exhausted):
            return self.error(path, answer.last_error, 503)
        if isinstance(answer, Response):
            return answer
        resp = answer.resp
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
        out_headers["x-kvevents-worker"] = answer.cand.state.label
        out_headers.update(extra)
        return StreamingResponse(
            self._relay(
                resp, answer.cand, len(plan.tokens), answer.uncached, t0, path, plan.stream,
                answer.rid, check,
            ),
            status_code=resp.status_code,
            headers=out_headers,
        )  # fmt: skip

    async def _relay(
        self,
        resp: httpx.Response,
        cand: Ranked,
        n_tokens: int,
        uncached: int,
        t0: float,
        path: str,
        stream: bool,
        rid: int | None = None,
        check: bool = True,
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
                    if len(buf) > 2 * SSE_TAIL_BYTES:
                        del buf[:-SSE_TAIL_BYTES]
                elif len(buf) < BODY_CAP_BYTES:
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
            if self.reservations is not None:
                self.reservations.finished(rid)
            self.metrics.latency.labels(path).observe(time.perf_counter() - t0)
            status = resp.status_code if ok else (499 if gone else 502)
            self.metrics.requests.labels(path, str(status)).inc()
            if ok and resp.status_code == 200 and check:
                self.check_truth(cand, bytes(buf), stream)

    def check_truth(self, cand: Ranked, body: bytes, stream: bool) -> None:
        """Compare the prediction for ``cand`` with the ``cached_tokens`` the engine
        reported in its answer ``body``; counted in ``rank_stats`` and the metrics.

        The prediction is the confirmed match plus the pending tokens credited; when
        there were pending tokens, a miss is also counted apart as over- or under-credit
        with pending in it (``pending_over``/``pending_under``), so the truth of the
        events stays readable on its own."""
        st = cand.state
        stats = self.rank_stats[st.label]
        reported = cached_tokens(body, stream)
        name = st.engine.name
        if reported is None:
            stats.unchecked += 1
            self.metrics.unchecked.labels(name).inc()
            return
        pending = cand.pending
        predicted = cand.match.total + pending
        err = predicted - reported
        if pending:
            stats.pending += pending
            if err > 0:
                stats.pending_over += 1
                stats.pending_over_tokens += min(pending, err)
                self.metrics.pending_checks.labels(name, "over").inc()
            elif err < 0:
                stats.pending_under += 1
                stats.pending_under_tokens -= err
                self.metrics.pending_checks.labels(name, "under").inc()
            else:
                self.metrics.pending_checks.labels(name, "exact").inc()
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
        role = st.engine.role
        m.role_predictions.labels(role, outcome).inc()
        m.role_predicted_tokens.labels(role).inc(predicted)
        m.role_reported_tokens.labels(role).inc(reported)
