"""Simulated engines and ``kvevents serve`` in one process, over real HTTP and ZMQ.

:class:`LocalStack` runs ``n`` :class:`~kvevents.sim.http.SimHTTPEngine` s and a
:class:`~kvevents.serve.app.ServeApp` on uvicorn, all on one asyncio loop in a
background thread, on free loopback ports.  Clients talk to :attr:`LocalStack.url` over
HTTP exactly as they would to a deployed service; the demo and the benchmarks use it.
Needs the ``serve`` extra.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Coroutine
from dataclasses import replace
from types import TracebackType
from typing import Any, TypeVar

from kvevents.errors import ConfigError
from kvevents.serve.config import ServeConfig, parse_engine_spec
from kvevents.sim.http import SimHTTPConfig, SimHTTPEngine

__all__ = ["LocalStack"]

T = TypeVar("T")


class LocalStack:
    """``engines`` simulated engines behind one service; a context manager.

    ``serve`` is the service configuration without engines (they are filled in);
    ``sim`` the engines' shape and timing.  :attr:`url` is the service, :attr:`engines`
    the engines (their :attr:`~SimHTTPEngine.url` can be called directly).  With
    ``events_port`` P, engine i publishes on port P + i and serves replay on P + 100 + i
    (otherwise free ports).  ``capture`` (a ``CaptureWriter``) records every batch the
    service receives.  ``prefill`` / ``decode`` add engines ``prefill-i`` /
    ``decode-i`` of those roles after the ``engines`` ones (a disaggregated fleet).
    """

    def __init__(
        self,
        engines: int,
        *,
        serve: ServeConfig | None = None,
        sim: SimHTTPConfig | None = None,
        start_timeout_s: float = 30.0,
        events_port: int | None = None,
        events_host: str = "127.0.0.1",
        capture: Any = None,
        prefill: int = 0,
        decode: int = 0,
    ) -> None:
        if engines < 0 or prefill < 0 or decode < 0 or engines + prefill + decode < 1:
            raise ConfigError("a stack needs at least one engine")
        self.n = engines
        self.named = (
            [(f"sim-{i}", "both") for i in range(engines)]
            + [(f"prefill-{i}", "prefill") for i in range(prefill)]
            + [(f"decode-{i}", "decode") for i in range(decode)]
        )
        self.serve_config = serve or ServeConfig()
        self.sim_config = sim or SimHTTPConfig()
        self.engines: list[SimHTTPEngine] = []
        self.service: Any = None
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvevents-stack", daemon=True
        )
        self._server: Any = None
        self._serve_task: asyncio.Task[Any] | None = None
        self._start_timeout_s = start_timeout_s
        self._events_port = events_port
        self._events_host = f"[{events_host}]" if ":" in events_host else events_host
        self._capture = capture

    def call(
        self,
        coro: Coroutine[Any, Any, T],
        timeout_s: float | None = 30.0,
    ) -> T:
        """Run ``coro`` on the stack's loop and wait up to ``timeout_s`` seconds (None:
        for ever) for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def start(self) -> LocalStack:
        self._thread.start()
        try:
            self.call(self._start(), timeout_s=self._start_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    async def _start(self) -> None:
        import uvicorn

        from kvevents.serve.app import ServeApp

        for i, (name, role) in enumerate(self.named):
            p, h = self._events_port, self._events_host
            e = SimHTTPEngine(
                name,
                self.sim_config,
                role=role,
                events=f"tcp://{h}:{p + i}" if p else f"tcp://{h}:0",
                replay=f"tcp://{h}:{p + 100 + i}" if p else f"tcp://{h}:0",
            )
            self.engines.append(e)
            await e.start()
        cfg = replace(
            self.serve_config,
            engines=tuple(parse_engine_spec(e.spec()) for e in self.engines),
            host="127.0.0.1",
            port=0,
        )
        self.service = ServeApp(cfg, self._capture)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.service.app,
                log_level="warning",
                access_log=False,
                server_header=False,
                date_header=False,
                timeout_keep_alive=30,
            )
        )
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()
                raise ConfigError("the service stopped while starting")
            await asyncio.sleep(0.005)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._serve_task is not None:
            try:
                await asyncio.wait_for(self._serve_task, 10)
            except (asyncio.TimeoutError, Exception):
                pass
        for e in self.engines:
            await e.stop()

    def stop_engine(self, i: int) -> None:
        """Take engine ``i`` down (its HTTP server and publisher stop)."""
        self.call(self.engines[i].stop())

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self.call(self._stop(), timeout_s=30)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
