"""One simulated engine behind an OpenAI-compatible HTTP front (see
:mod:`kvevents.sim.http`): :class:`SimHTTPEngine` owns the
:class:`~kvevents.sim.engine.SimEngine`, its publisher, the HTTP server and the loop that
steps the engine in simulated time.

One job: running one engine and answering its requests.  The wire shapes are
:mod:`~kvevents.sim.http.openai`'s, the routes :mod:`~kvevents.sim.http.routes`'.
Needs the ``serve`` extra (Starlette, uvicorn) once started.
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
from collections.abc import AsyncIterator
from typing import Any

from kvevents.errors import ConfigError
from kvevents.events import KVEventBatch
from kvevents.publishers import ZmqEventPublisher
from kvevents.sim.cluster import loopback_endpoint
from kvevents.sim.engine import RequestResult, SimEngine
from kvevents.sim.http.config import SimHTTPConfig
from kvevents.sim.http.connector import (
    TransferLog,
    prefill_params,
    remote_prompt_tokens,
    transfer_params,
)
from kvevents.sim.http.openai import (
    Pending,
    SimBadRequest,
    completion_body,
    models_body,
    prompt_tokens,
    request_lora,
    request_options,
    sse_chunks,
    usage_body,
)
from kvevents.sim.http.routes import build_app
from kvevents.sim.workload import SimRequest
from kvevents.tokenizer import SimTokenizer

__all__ = ["SimHTTPEngine"]

logger = logging.getLogger(__name__)


class _StepSink:
    """The engine's sink: passes batches to the publisher, or, while ``holding``, keeps
    them until :meth:`release` (the end of the step's simulated compute time)."""

    def __init__(self, publisher: ZmqEventPublisher) -> None:
        self.publisher = publisher
        self.holding = False
        self._held: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        if self.holding:
            self._held.append(batch)
        else:
            self.publisher.publish(batch)

    def release(self) -> None:
        held, self._held = self._held, []
        for b in held:
            self.publisher.publish(b)

    def shutdown(self) -> None:
        self.release()
        self.publisher.shutdown()


class SimHTTPEngine:
    """One simulated engine with an OpenAI-compatible HTTP front and a publisher.

    ``events`` / ``replay`` are the publisher's endpoints, always bound (``tcp://*:0``
    for a free port on every interface, ``tcp://127.0.0.1:0`` on loopback only).  ``dp_rank`` makes
    it data-parallel rank r of an engine: its batches say so and its endpoints are moved up
    by r (vLLM's offset rule), as vLLM's rank r would publish.  Start it with :meth:`start` inside a running event loop; the
    actual endpoints are then :attr:`events_endpoint`, :attr:`replay_endpoint` and
    :attr:`url`.  ``role`` (``both``, ``prefill`` or ``decode``) is written into
    :meth:`spec`; every engine speaks both sides of vLLM's KV-connector protocol, as a
    vLLM engine with ``kv_role`` ``kv_both`` does (:mod:`~kvevents.sim.http.connector`).
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
        role: str = "both",
    ) -> None:
        self.name = name
        self.role = role
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
        self._sink = _StepSink(self.publisher)
        self.engine = SimEngine(self.config.engine, self._sink, name=name)
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
        self._incoming: list[Pending] = []
        self._by_id: dict[str, Pending] = {}
        self._wake: asyncio.Event | None = None
        self._server: Any = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._results_pos = 0
        self.dp_headers: dict[str, int] = {}
        """Requests received per ``X-data-parallel-rank`` header value."""
        self.digests: OrderedDict[str, str] = OrderedDict()
        """sha256 of every response body sent, by response id (the last 10 000)."""
        self.raw_transfers: list[bytes] = []
        """Raw bodies of the last requests that carried ``kv_transfer_params``."""
        self.transfers = TransferLog()
        """``kv_transfer_params`` sent (prefill steps) and received (decode steps)."""
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
        role = f";role={self.role}" if self.role != "both" else ""
        return f"{self.name}={','.join(parts)}{role}"

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
                        cache_salt=new.salt, remote_tokens=new.remote,
                    )
                )  # fmt: skip
            self._incoming.clear()
            computed = engine.stats.computed_tokens
            t0 = time.perf_counter()
            self._sink.holding = cfg.events_after_step
            engine.step()
            self._sink.holding = False
            cost = cfg.step_s + cfg.prefill_s_per_token * (engine.stats.computed_tokens - computed)
            await asyncio.sleep(max(0.0, cost - (time.perf_counter() - t0)))
            self._sink.release()  # the step's blocks are computed: vLLM publishes now
            # what each running request has generated so far (the engine's own count)
            for request_id, generated in engine.progress():
                p = self._by_id.get(request_id)
                if p is not None and generated > p.emitted:
                    end = min(len(p.pieces), generated)
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

    def submit(
        self,
        prompt: list[int],
        max_tokens: int,
        lora: str | None,
        salt: str | None = None,
        remote: int = 0,
    ) -> Pending:
        """Queue ``prompt`` for ``max_tokens`` output tokens (``lora`` / ``salt``: its
        adapter and cache salt; ``remote``: prompt tokens whose KV a prefill engine
        sends); :class:`SimBadRequest` for an empty prompt or one over the context
        length.  Its progress arrives on the returned :class:`Pending`."""
        if not prompt:
            raise SimBadRequest("the prompt is empty")
        need = sum(-(-(len(prompt) + max_tokens) // g.block_size) for g in self.engine.groups)
        if need > self.engine.pool.num_blocks or len(prompt) + max_tokens > self.max_model_len:
            raise SimBadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
                f"{max_tokens} in the completion)."
            )
        rid = f"{self.name}-{next(self._ids)}"
        pieces = self.tokenizer.generate(prompt, max_tokens)
        p = Pending(rid, prompt, pieces, asyncio.Queue(), lora, salt, remote=remote)
        self._by_id[rid] = p
        self._incoming.append(p)
        assert self._wake is not None
        self._wake.set()
        return p

    # --- HTTP --------------------------------------------------------------------------
    def app(self) -> Any:
        """The Starlette application of this engine (see :mod:`kvevents.sim.http.routes`)."""
        return build_app(self)

    def models(self) -> dict[str, Any]:
        """What ``GET /v1/models`` answers: the base model and the LoRA adapters."""
        return models_body(self.config.model, self.config.loras, self.max_model_len)

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
    def note_raw(self, raw: bytes) -> None:
        """Keep ``raw`` when it carries ``kv_transfer_params`` (the last 1000)."""
        if b"kv_transfer_params" in raw:
            self.raw_transfers.append(raw)
            del self.raw_transfers[:-1000]

    def kv_transfer(self, request_id: str) -> dict[str, Any]:
        """What ``GET /sim/kv-transfer?id=`` answers: the parameters sent and received
        for prefill request ``request_id`` (JSON text) and the raw request bodies kept
        that name it; without an id, every parameter sent and received, by id."""
        if not request_id:
            return {"sent": dict(self.transfers.sent), "received": dict(self.transfers.received)}
        out = self.transfers.lookup(request_id)
        needle = json.dumps(request_id).encode()
        out["raw_bodies"] = [b.decode() for b in self.raw_transfers if needle in b]
        return out

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """What ``POST /tokenize`` answers for ``body`` (``prompt`` or ``messages``)."""
        tokens = prompt_tokens(self.tokenizer, body, chat="messages" in body)
        return {
            "count": len(tokens),
            "max_model_len": self.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }

    async def complete(self, body: dict[str, Any], *, chat: bool) -> Any:
        """Answer a completion (``chat=False``) or chat completion request body: a
        Starlette response, streamed (SSE) when the body asks for it, once the engine
        has generated every output token.  :class:`SimBadRequest` for a bad body.

        With ``kv_transfer_params``: ``do_remote_decode`` makes it a prefill step whose
        (non-streamed) answer carries the parameters naming its blocks;
        ``do_remote_prefill`` makes it a decode step that receives the prompt's KV up
        to the named blocks instead of computing it."""
        from starlette.responses import Response, StreamingResponse

        lora = request_lora(body, self.config.model, self.config.loras)
        prompt = prompt_tokens(self.tokenizer, body, chat=chat)
        max_tokens, salt = request_options(
            body, chat=chat, default_max_tokens=self.config.default_max_tokens
        )
        params = transfer_params(body)
        remote = 0
        if params is not None and params.get("do_remote_prefill"):
            block_size = self.config.engine.groups[0].block_size
            remote = remote_prompt_tokens(params, block_size, len(prompt))
            self.transfers.note(self.transfers.received, params)
        p = self.submit(prompt, max_tokens, lora, salt, remote)
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
        answer_params = None
        if params is not None and params.get("do_remote_decode"):
            answer_params = prefill_params(
                self.name, p.request_id, result.block_ids, self.host, self.port
            )
            self.transfers.note(self.transfers.sent, answer_params)
        raw = completion_body(
            rid, model, created, "".join(text), self._usage(p, result), chat=chat,
            kv_transfer_params=answer_params,
        )  # fmt: skip
        self._digest(rid, hashlib.sha256(raw).hexdigest())
        return Response(raw, media_type="application/json")

    def _usage(self, p: Pending, result: RequestResult) -> dict[str, Any]:
        usage = usage_body(p, result)
        c = self.counters
        c["prompt_tokens"] += len(p.prompt)
        c["generation_tokens"] += len(p.pieces)
        c["cached_tokens"] += usage["prompt_tokens_details"]["cached_tokens"]
        c["requests"] += 1
        return usage

    async def _stream(
        self,
        p: Pending,
        rid: str,
        model: str,
        created: int,
        *,
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        h = hashlib.sha256()
        async for part in sse_chunks(
            p, rid, model, created, chat=chat, include_usage=include_usage, usage=self._usage
        ):
            h.update(part)
            yield part
        self._digest(rid, h.hexdigest())

    def _digest(self, rid: str, digest: str) -> None:
        self.digests[rid] = digest
        while len(self.digests) > 10_000:
            self.digests.popitem(last=False)
