"""An OpenAI-compatible HTTP front for simulated engines (``kvevents sim serve``).

:class:`SimHTTPEngine` wraps one :class:`~kvevents.sim.engine.SimEngine` and its
``ZmqEventPublisher`` (vLLM's frames, seq and replay) behind the routes a vLLM OpenAI
server answers:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming (SSE) or not; the
  usage carries ``prompt_tokens_details.cached_tokens`` (what the engine reused, GPU and
  CPU tiers, as vLLM reports with ``--enable-prompt-tokens-details``), also in a last
  streamed chunk when ``stream_options.include_usage`` is set;
* ``POST /tokenize`` (``{"prompt": ...}`` or ``{"messages": ...}`` → ``{"tokens": ...}``);
* ``GET /v1/models``; ``GET /metrics`` with vLLM's gauge names
  (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc``) and counters; ``GET /health``.

Time is simulated: the engine steps while it has work, each step lasting
``step_s + prefill_s_per_token × tokens prefilled in it``; a running request emits
``decode_tokens_per_step`` output tokens per step.  Tokens come from
:class:`~kvevents.sim.tokenizer.SimTokenizer` (deterministic, prefix-stable) and the
answer to a prompt is a deterministic function of it.

Needs the ``serve`` extra (Starlette, uvicorn).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvevents.errors import ConfigError
from kvevents.sim.block_pool import KVCacheGroupSpec
from kvevents.sim.engine import RequestResult, SimEngine, SimEngineConfig
from kvevents.sim.tokenizer import SimTokenizer
from kvevents.sim.workload import SimRequest

if TYPE_CHECKING:
    from starlette.responses import Response

__all__ = ["SimHTTPConfig", "SimHTTPEngine", "default_http_engine", "run_sim_fleet"]

logger = logging.getLogger(__name__)

MODEL = "sim-model"


def default_http_engine() -> SimEngineConfig:
    """The engine shape ``kvevents sim serve`` uses by default: 16-token blocks, 1024
    GPU blocks (16k tokens), 512 CPU chunks of 4 blocks."""
    return SimEngineConfig(
        groups=(KVCacheGroupSpec(16),),
        num_gpu_blocks=1024,
        num_cpu_chunks=512,
        blocks_per_chunk=4,
        decode_tokens_per_step=16,
        max_running=16,
    )


@dataclass(frozen=True)
class SimHTTPConfig:
    """Timing and shape of one simulated HTTP engine.

    ``step_s``: fixed cost of an engine step (seconds); ``prefill_s_per_token``: added
    per prompt token computed (not reused) in the step; ``default_max_tokens``: output
    length when a request gives no ``max_tokens``; ``loras``: adapter names served
    besides the base model; ``buffer_steps``: replay buffer of the publisher (batches).
    """

    engine: SimEngineConfig = field(default_factory=default_http_engine)
    step_s: float = 0.002
    prefill_s_per_token: float = 2e-5
    default_max_tokens: int = 32
    loras: tuple[str, ...] = ()
    buffer_steps: int = 10_000
    vocab_size: int = 32_000
    model: str = MODEL


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Pending:
    request_id: str
    prompt: list[int]
    pieces: list[tuple[str, int]]
    queue: asyncio.Queue[tuple[str, Any]]
    lora: str | None = None
    salt: str | None = None
    emitted: int = 0


class SimHTTPEngine:
    """One simulated engine with an OpenAI-compatible HTTP front and a publisher.

    ``events`` / ``replay`` are the publisher's endpoints, always bound (``tcp://*:0``
    for a free port on every interface, ``tcp://127.0.0.1:0`` on loopback only).  ``dp_rank`` makes
    it data-parallel rank r of an engine: its batches say so and its endpoints are moved up
    by r (vLLM's offset rule), as vLLM's rank r would publish.  Start it with :meth:`start` inside a running event loop; the
    actual endpoints are then :attr:`events_endpoint`, :attr:`replay_endpoint` and
    :attr:`url`.
    """

    def __init__(
        self,
        name: str,
        config: SimHTTPConfig | None = None,
        *,
        host: str = "127.0.0.1",
        http_port: int = 0,
        events: str = "tcp://*:0",
        replay: str | None = "tcp://*:0",
        topic: str = "",
        dp_rank: int = 0,
    ) -> None:
        from kvevents.publishers import ZmqEventPublisher
        from kvevents.sim.cluster import loopback_endpoint

        self.name = name
        self.config = config or SimHTTPConfig()
        self.tokenizer = SimTokenizer(self.config.vocab_size)
        self.publisher = ZmqEventPublisher(
            data_parallel_rank=dp_rank,
            endpoint=events,
            replay_endpoint=replay,
            buffer_steps=self.config.buffer_steps,
            topic=topic,
            bind=True,  # an engine's publisher listens, whatever its host
        )
        self.events_endpoint = loopback_endpoint(self.publisher.endpoint)
        rep = self.publisher.replay_endpoint
        self.replay_endpoint = loopback_endpoint(rep) if rep else None
        self.engine = SimEngine(self.config.engine, self.publisher, name=name)
        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, http_port))
        except OSError as exc:
            self._sock.close()
            self.publisher.shutdown()
            raise ConfigError(f"{name}: cannot listen on {host}:{http_port}: {exc}") from exc
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._ids = itertools.count()
        self._incoming: list[_Pending] = []
        self._by_id: dict[str, _Pending] = {}
        self._wake: asyncio.Event | None = None
        self._server: Any = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._results_pos = 0
        self.dp_headers: dict[str, int] = {}
        """Requests received per ``X-data-parallel-rank`` header value."""
        self.digests: OrderedDict[str, str] = OrderedDict()
        """sha256 of every response body sent, by response id (the last 10 000)."""
        self.counters = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "cached_tokens": 0,
            "requests": 0,
        }
        self.max_model_len = min(
            self.config.engine.num_gpu_blocks // len(self.config.engine.groups) * g.block_size
            for g in self.config.engine.groups
        )

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Start the HTTP server and the engine's step loop; returns once listening."""
        import uvicorn

        self._wake = asyncio.Event()
        cfg = uvicorn.Config(
            self.app(), log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30
        )
        self._server = uvicorn.Server(cfg)
        self._sock.listen(1024)
        self._tasks.append(asyncio.create_task(self._server.serve(sockets=[self._sock])))
        self._tasks.append(asyncio.create_task(self._drive()))
        while not self._server.started:
            if self._tasks[0].done():
                self._tasks[0].result()  # raises the server's error
                raise ConfigError(f"{self.name}: HTTP server stopped at start")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Stop serving, shut the publisher down."""
        if self._server is not None:
            self._server.should_exit = True
        for t in self._tasks[1:]:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks.clear()
        self.publisher.shutdown()
        self._sock.close()

    def spec(self) -> str:
        """This engine as a ``kvevents serve --engine`` value."""
        parts = [self.url, self.events_endpoint] + (
            [self.replay_endpoint] if self.replay_endpoint else []
        )
        return f"{self.name}={','.join(parts)}"

    # --- the engine loop ---------------------------------------------------------------
    async def _drive(self) -> None:
        assert self._wake is not None
        engine = self.engine
        cfg = self.config
        while True:
            if not self._incoming and engine.idle:
                self._wake.clear()
                await self._wake.wait()
                continue
            for new in self._incoming:
                out = tuple(t for _, t in new.pieces)
                engine.add_request(
                    SimRequest(
                        new.request_id, 0, 0, 0, tuple(new.prompt), out, new.lora,
                        cache_salt=new.salt,
                    )
                )  # fmt: skip
            self._incoming.clear()
            computed = engine.stats.computed_tokens
            t0 = time.perf_counter()
            engine.step()
            cost = cfg.step_s + cfg.prefill_s_per_token * (engine.stats.computed_tokens - computed)
            await asyncio.sleep(max(0.0, cost - (time.perf_counter() - t0)))
            # what each running request has generated so far (the engine's own count;
            # read-only use of its running list, this module's sibling)
            for run in engine._running:
                p = self._by_id.get(run.req.request_id)
                if p is not None and run.generated > p.emitted:
                    end = min(len(p.pieces), run.generated)
                    p.queue.put_nowait(("tokens", p.pieces[p.emitted : end]))
                    p.emitted = end
            results = engine.results
            for r in results[self._results_pos :]:
                done = self._by_id.pop(r.request_id, None)
                if done is None:
                    continue
                if done.emitted < len(done.pieces):
                    done.queue.put_nowait(("tokens", done.pieces[done.emitted :]))
                    done.emitted = len(done.pieces)
                done.queue.put_nowait(("done", r))
            self._results_pos = len(results)
            if self._results_pos > 4096:
                del results[: self._results_pos]
                self._results_pos = 0

    def _submit(
        self, prompt: list[int], max_tokens: int, lora: str | None, salt: str | None = None
    ) -> _Pending:
        if not prompt:
            raise _BadRequest("the prompt is empty")
        need = sum(-(-(len(prompt) + max_tokens) // g.block_size) for g in self.engine.groups)
        if need > self.engine.pool.num_blocks or len(prompt) + max_tokens > self.max_model_len:
            raise _BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
                f"{max_tokens} in the completion)."
            )
        rid = f"{self.name}-{next(self._ids)}"
        pieces = self.tokenizer.generate(prompt, max_tokens)
        p = _Pending(rid, prompt, pieces, asyncio.Queue(), lora, salt)
        self._by_id[rid] = p
        self._incoming.append(p)
        assert self._wake is not None
        self._wake.set()
        return p

    # --- HTTP --------------------------------------------------------------------------
    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, PlainTextResponse, Response
        from starlette.routing import Route

        async def guarded(request: Request, handler: Any) -> Response:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                return _error(JSONResponse, "the request body is not valid JSON", 400)
            if not isinstance(body, dict):
                return _error(JSONResponse, "the request body must be a JSON object", 400)
            try:
                response: Response = await handler(body)
                return response
            except (_BadRequest, ConfigError) as exc:
                return _error(JSONResponse, str(exc), getattr(exc, "status", 400))

        def note_rank(request: Request) -> None:
            rank = request.headers.get("x-data-parallel-rank")
            if rank is not None:
                self.dp_headers[rank] = self.dp_headers.get(rank, 0) + 1

        async def completions(request: Request) -> Response:
            note_rank(request)
            return await guarded(request, lambda b: self._complete(b, chat=False))

        async def chat(request: Request) -> Response:
            note_rank(request)
            return await guarded(request, lambda b: self._complete(b, chat=True))

        async def digest(request: Request) -> Response:
            rid = request.query_params.get("id", "")
            d = self.digests.get(rid)
            if d is None:
                return _error(JSONResponse, f"no response with id {rid!r}", 404)
            return JSONResponse({"id": rid, "sha256": d})

        async def tokenize(request: Request) -> Response:
            async def run(body: dict[str, Any]) -> Response:
                tokens = self._tokens(body, chat="messages" in body, tokenize_route=True)
                return JSONResponse(
                    {
                        "count": len(tokens),
                        "max_model_len": self.max_model_len,
                        "tokens": tokens,
                        "token_strs": None,
                    }
                )

            return await guarded(request, run)

        async def models(request: Request) -> Response:
            return JSONResponse(self.models())

        async def metrics(request: Request) -> Response:
            return PlainTextResponse(self.metrics_text(), media_type="text/plain; version=0.0.4")

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
            ]
        )

    def models(self) -> dict[str, Any]:
        created = 0
        model = self.config.model
        data = [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "kvevents",
                "root": model,
                "parent": None,
                "max_model_len": self.max_model_len,
            }
        ]
        for lora in self.config.loras:
            data.append(
                {
                    "id": lora,
                    "object": "model",
                    "created": created,
                    "owned_by": "kvevents",
                    "root": f"/loras/{lora}",
                    "parent": model,
                    "max_model_len": None,
                }
            )
        return {"object": "list", "data": data}

    def metrics_text(self) -> str:
        """vLLM-named gauges and counters in Prometheus text format."""
        e = self.engine
        pool = e.pool
        usage = (pool.num_blocks - pool.num_free) / pool.num_blocks
        labels = f'{{model_name="{self.config.model}",engine="0"}}'
        c = self.counters
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{labels} {float(e.num_running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{labels} {float(e.num_waiting + len(self._incoming))}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{labels} {usage}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{labels} {float(c['prompt_tokens'])}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{labels} {float(c['generation_tokens'])}",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{labels} {float(c['prompt_tokens'])}",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{labels} {float(c['cached_tokens'])}",
            "# TYPE vllm:request_success_total counter",
            f"vllm:request_success_total{labels} {float(c['requests'])}",
        ]
        return "\n".join(lines) + "\n"

    # --- request handling ----------------------------------------------------------------
    def _lora(self, body: dict[str, Any]) -> str | None:
        model = body.get("model")
        if model is None or model == self.config.model:
            return None
        if model in self.config.loras:
            return str(model)
        raise _BadRequest(f"The model `{model}` does not exist.", 404)

    def _tokens(
        self, body: dict[str, Any], *, chat: bool, tokenize_route: bool = False
    ) -> list[int]:
        tok = self.tokenizer
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _BadRequest("'messages' must be a non-empty list")
            return tok.encode_chat(
                messages,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
            )
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return tok.encode(prompt)
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return [int(t) for t in prompt]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return tok.encode(prompt[0])
        raise _BadRequest("'prompt' must be a string or a list of token ids")

    async def _complete(self, body: dict[str, Any], *, chat: bool) -> Any:
        from starlette.responses import Response, StreamingResponse

        lora = self._lora(body)
        prompt = self._tokens(body, chat=chat)
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        max_tokens = body.get(key)
        if max_tokens is None:
            max_tokens = self.config.default_max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _BadRequest(f"'{key}' must be a positive integer")
        n = body.get("n", 1)
        if n != 1:
            raise _BadRequest("only n=1 is supported")
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise _BadRequest("'cache_salt' must be a string")
        p = self._submit(prompt, max_tokens, lora, salt or None)
        model = body.get("model") or self.config.model
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + p.request_id
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            usage_wanted = isinstance(opts, dict) and bool(opts.get("include_usage"))
            gen = self._stream(p, rid, model, created, chat=chat, include_usage=usage_wanted)
            return StreamingResponse(gen, media_type="text/event-stream")
        text: list[str] = []
        while True:
            kind, value = await p.queue.get()
            if kind == "tokens":
                text.extend(s for s, _ in value)
            else:
                result: RequestResult = value
                break
        usage = self._usage(p, result)
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(text)},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": "".join(text),
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        raw = json.dumps(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        ).encode()
        self._digest(rid, hashlib.sha256(raw).hexdigest())
        return Response(raw, media_type="application/json")

    def _usage(self, p: _Pending, result: RequestResult) -> dict[str, Any]:
        cached = result.gpu_hit_tokens + result.cpu_hit_tokens
        c = self.counters
        c["prompt_tokens"] += len(p.prompt)
        c["generation_tokens"] += len(p.pieces)
        c["cached_tokens"] += cached
        c["requests"] += 1
        return {
            "prompt_tokens": len(p.prompt),
            "total_tokens": len(p.prompt) + len(p.pieces),
            "completion_tokens": len(p.pieces),
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def _stream(
        self,
        p: _Pending,
        rid: str,
        model: str,
        created: int,
        *,
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        h = hashlib.sha256()
        async for part in self._chunks(
            p, rid, model, created, obj, chat=chat, include_usage=include_usage
        ):
            h.update(part)
            yield part
        self._digest(rid, h.hexdigest())

    def _digest(self, rid: str, digest: str) -> None:
        self.digests[rid] = digest
        while len(self.digests) > 10_000:
            self.digests.popitem(last=False)

    async def _chunks(
        self,
        p: _Pending,
        rid: str,
        model: str,
        created: int,
        obj: str,
        *,
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        def chunk(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
            d: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": choices,
            }
            if usage is not None:
                d["usage"] = usage
            return b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n"

        if chat:
            yield chunk(
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
            )
        while True:
            kind, value = await p.queue.get()
            if kind == "tokens":
                text = "".join(s for s, _ in value)
                part: dict[str, Any] = (
                    {"index": 0, "delta": {"content": text}, "finish_reason": None}
                    if chat
                    else {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
                )
                yield chunk([part])
                continue
            usage = self._usage(p, value)
            last: dict[str, Any] = (
                {"index": 0, "delta": {}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
            )
            yield chunk([last])
            if include_usage:
                yield chunk([], usage)
            yield b"data: [DONE]\n\n"
            return


def _error(response_cls: Any, message: str, status: int) -> Response:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    response: Response = response_cls(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status},
        status_code=status,
    )
    return response


async def run_sim_fleet(
    n: int,
    *,
    config: SimHTTPConfig | None = None,
    host: str = "127.0.0.1",
    http_base: int | None = None,
    events_base: int | None = None,
    stop: asyncio.Event,
    on_ready: Any = None,
) -> list[str]:
    """Run ``n`` engines ``sim-0..sim-{n-1}`` until ``stop`` is set.

    Engine ``i`` listens on HTTP port ``http_base + i``, publishes on ``events_base +
    2i`` and serves replay on ``events_base + 2i + 1`` (free ports when a base is None).
    ``on_ready(specs)`` is called once every engine listens, with their ``--engine``
    values.  Returns those values.
    """
    if n < 1:
        raise ConfigError("--engines must be >= 1")
    engines: list[SimHTTPEngine] = []
    try:
        for i in range(n):
            # the publishers listen on the HTTP host too (loopback by default)
            eh = f"[{host}]" if ":" in host else host
            ev = f"tcp://{eh}:{events_base + 2 * i}" if events_base is not None else None
            rep = f"tcp://{eh}:{events_base + 2 * i + 1}" if events_base is not None else None
            engines.append(
                SimHTTPEngine(
                    f"sim-{i}",
                    config,
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
