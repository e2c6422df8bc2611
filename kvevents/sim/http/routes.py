"""The routes of a simulated engine's HTTP server, as a vLLM OpenAI server has them:
``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /tokenize``,
``GET /v1/models``, ``GET /metrics``, ``GET /health``, and the test routes
``GET /sim/response-digest?id=...`` and ``GET /sim/kv-transfer?id=...`` (the
``kv_transfer_params`` a prefill step sent and a decode step received, as JSON text,
with the raw request bodies that carried them).

One job: mapping HTTP to the handlers of :class:`SimHandlers` (JSON decoding, the
``X-data-parallel-rank`` tally, errors in vLLM's shape).  Imports Starlette (the
``serve`` extra) only when :func:`build_app` is called, and the wire shapes of
:mod:`kvevents.sim.http.openai`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kvevents.errors import ConfigError
from kvevents.sim.http.openai import SimBadRequest, error_body

__all__ = ["SimHandlers", "build_app"]


class SimHandlers(Protocol):
    """What the routes call (a :class:`~kvevents.sim.http.engine.SimHTTPEngine`)."""

    dp_headers: dict[str, int]
    """Requests received per ``X-data-parallel-rank`` header value (the routes count)."""

    @property
    def digests(self) -> Mapping[str, str]:
        """sha256 of every response body sent, by response id."""
        ...

    async def complete(self, body: dict[str, Any], *, chat: bool) -> Any:
        """Answer a (chat) completion request body (a Starlette response)."""
        ...

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """Answer a ``/tokenize`` request body."""
        ...

    def kv_transfer(self, request_id: str) -> dict[str, Any]:
        """The ``kv_transfer_params`` sent and received for a prefill request id."""
        ...

    def note_raw(self, raw: bytes) -> None:
        """Keep a completion request's raw body (those with ``kv_transfer_params``)."""
        ...

    def models(self) -> dict[str, Any]:
        """Answer ``GET /v1/models``."""
        ...

    def metrics_text(self) -> str:
        """Answer ``GET /metrics`` (Prometheus text)."""
        ...


def build_app(h: SimHandlers) -> Any:
    """A Starlette application serving ``h``.  A body that is not a JSON object, and
    a handler's :class:`SimBadRequest` or :class:`ConfigError`, become vLLM's error
    body with the matching status."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    def error(message: str, status: int) -> Response:
        return JSONResponse(error_body(message, status), status_code=status)

    async def guarded(request: Request, handler: Any) -> Response:
        try:
            h.note_raw(await request.body())
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return error("the request body is not valid JSON", 400)
        if not isinstance(body, dict):
            return error("the request body must be a JSON object", 400)
        try:
            response: Response = await handler(body)
            return response
        except (SimBadRequest, ConfigError) as exc:
            return error(str(exc), getattr(exc, "status", 400))

    def note_rank(request: Request) -> None:
        rank = request.headers.get("x-data-parallel-rank")
        if rank is not None:
            h.dp_headers[rank] = h.dp_headers.get(rank, 0) + 1

    async def completions(request: Request) -> Response:
        note_rank(request)
        return await guarded(request, lambda b: h.complete(b, chat=False))

    async def chat(request: Request) -> Response:
        note_rank(request)
        return await guarded(request, lambda b: h.complete(b, chat=True))

    async def digest(request: Request) -> Response:
        rid = request.query_params.get("id", "")
        d = h.digests.get(rid)
        if d is None:
            return error(f"no response with id {rid!r}", 404)
        return JSONResponse({"id": rid, "sha256": d})

    async def kv_transfer(request: Request) -> Response:
        return JSONResponse(h.kv_transfer(request.query_params.get("id", "")))

    async def tokenize(request: Request) -> Response:
        async def run(body: dict[str, Any]) -> Response:
            return JSONResponse(h.tokenize(body))

        return await guarded(request, run)

    async def models(request: Request) -> Response:
        return JSONResponse(h.models())

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(h.metrics_text(), media_type="text/plain; version=0.0.4")

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/sim/response-digest", digest, methods=["GET"]),
            Route("/sim/kv-transfer", kv_transfer, methods=["GET"]),
        ]
    )
