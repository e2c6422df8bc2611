"""A private asyncio loop on a daemon thread, so synchronous code can drive nats-py.

Imports nothing from kvevents.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """Runs one event loop on a daemon thread; :meth:`run` waits for a coroutine's result."""

    def __init__(self, name: str = "kvevents-nats") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        timeout_s: float | None = None,
    ) -> T:
        """Run ``coro`` on the loop and return its result (re-raising its exception).

        Waits at most ``timeout_s`` seconds (None: for ever), then raises
        ``concurrent.futures.TimeoutError``.
        """
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Any:
        """Schedule ``coro`` without waiting; returns a ``concurrent.futures.Future``."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Cancel what still runs on the loop, stop it and join the thread (idempotent):
        no task is left pending, so nothing is reported as destroyed at exit."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            try:
                self.run(self._cancel_all(), timeout_s=5.0)
            except Exception:  # the loop is wedged: stop it anyway
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self.loop.close()

    @staticmethod
    async def _cancel_all() -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
