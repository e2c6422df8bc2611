"""Simulated engines on loopback, each DP rank with its own ZMQ publisher.

:class:`SimCluster` starts ``num_engines × dp_ranks`` :class:`SimEngine` s.  Engine *i*
gets a ``ZmqEventPublisher`` (vLLM's frames, seq and replay protocol) bound on an
ephemeral TCP port; its DP ranks follow vLLM's rule (each rank its own publisher, seq
space and replay buffer).  :attr:`SimCluster.workers` lists them with the endpoints a
subscriber connects to; a worker's id is ``(endpoint, dp_rank)``, the router's
``WorkerId``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from kvevents.errors import ConfigError
from kvevents.events import KVEventBatch
from kvevents.publishers import ZmqEventPublisher
from kvevents.sim.engine import SimEngine, SimEngineConfig

__all__ = ["ClusterConfig", "SimCluster", "SimWorker", "engine_endpoint", "loopback_endpoint"]

logger = logging.getLogger(__name__)


def loopback_endpoint(endpoint: str) -> str:
    """The address a local subscriber connects to for a publisher bound on ``endpoint``
    (``tcp://0.0.0.0:P`` or ``tcp://*:P`` becomes ``tcp://127.0.0.1:P``)."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard) :]
    return endpoint


def engine_endpoint(bind: str, offset: int) -> str:
    """``bind`` with its TCP port moved up by ``offset``; port 0 (ephemeral) stays 0.

    Raises :class:`ConfigError` for a non-TCP endpoint with a non-zero offset.
    """
    if offset == 0:
        return bind
    head, sep, port = bind.rpartition(":")
    if not bind.startswith("tcp://") or not sep or not port.isdigit():
        raise ConfigError(f"cannot give several engines distinct ports from {bind!r}")
    return bind if int(port) == 0 else f"{head}:{int(port) + offset}"


@dataclass(frozen=True)
class ClusterConfig:
    """``num_engines`` engines of ``dp_ranks`` ranks each, all shaped by ``engine``.

    ``bind`` is the PUB endpoint asked of each engine.  With ``tcp://127.0.0.1:0``
    (default: loopback only) every publisher gets an ephemeral port, so several clusters
    can run at once.  With a
    fixed ``tcp://HOST:P``, engine *i* rank *r* publishes on port ``P + i·dp_ranks + r``
    and, with ``replay``, serves replay on ``P + 100 + i·dp_ranks + r`` (vLLM's DP offset
    rule applied to a base of ``P + i·dp_ranks``).  ``replay`` adds a replay
    ROUTER with ``buffer_steps`` batches of history.
    """

    num_engines: int = 4
    dp_ranks: int = 1
    engine: SimEngineConfig = field(default_factory=SimEngineConfig)
    bind: str = "tcp://127.0.0.1:0"
    replay: bool = True
    buffer_steps: int = 10_000
    topic: str = ""


@dataclass
class SimWorker:
    """One engine DP rank: its engine, publisher and the endpoints to subscribe to."""

    engine: SimEngine
    publisher: Any
    endpoint: str
    replay_endpoint: str | None
    dp_rank: int

    @property
    def worker_id(self) -> tuple[str, int]:
        """``(endpoint, dp_rank)``: how the subscriber, index and router name it."""
        return (self.endpoint, self.dp_rank)


class _PublishingSink:
    def __init__(self, publisher: Any) -> None:
        self.publisher = publisher

    def publish(self, batch: KVEventBatch) -> None:
        self.publisher.publish(batch)

    def shutdown(self) -> None:
        self.publisher.shutdown()


class SimCluster:
    """Engines with real publishers; use as a context manager (closes the publishers)."""

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        if self.config.num_engines < 1 or self.config.dp_ranks < 1:
            raise ConfigError("num_engines and dp_ranks must be >= 1")
        self.workers: list[SimWorker] = []
        cfg = self.config
        try:
            for i in range(cfg.num_engines):
                pub_base = engine_endpoint(cfg.bind, i * cfg.dp_ranks)
                replay_base = engine_endpoint(cfg.bind, 100 + i * cfg.dp_ranks)
                for rank in range(cfg.dp_ranks):
                    pub = ZmqEventPublisher(
                        data_parallel_rank=rank,
                        endpoint=pub_base,
                        replay_endpoint=replay_base if cfg.replay else None,
                        buffer_steps=cfg.buffer_steps,
                        topic=cfg.topic,
                        bind=True,  # an engine binds, on loopback too (no proxy here)
                    )
                    engine = SimEngine(
                        cfg.engine, _PublishingSink(pub), name=f"engine{i}/dp{rank}", dp_rank=rank
                    )
                    rep = pub.replay_endpoint
                    self.workers.append(
                        SimWorker(
                            engine,
                            pub,
                            loopback_endpoint(pub.endpoint),
                            loopback_endpoint(rep) if rep else None,
                            rank,
                        )
                    )
        except BaseException:
            self.close()
            raise

    # --- views ----------------------------------------------------------------------------
    @property
    def endpoints(self) -> list[str]:
        return [w.endpoint for w in self.workers]

    @property
    def replay_endpoints(self) -> list[str | None]:
        return [w.replay_endpoint for w in self.workers]

    @property
    def engines(self) -> list[SimEngine]:
        return [w.engine for w in self.workers]

    def worker(self, worker_id: tuple[str, int]) -> SimWorker:
        """The worker named ``(endpoint, dp_rank)``."""
        for w in self.workers:
            if w.worker_id == tuple(worker_id):
                return w
        raise KeyError(worker_id)

    def __iter__(self) -> Iterator[SimWorker]:
        return iter(self.workers)

    # --- driving --------------------------------------------------------------------------
    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        """Step every busy engine in turn until all are idle; returns the rounds taken."""
        rounds = 0
        while True:
            busy = [w.engine for w in self.workers if not w.engine.idle]
            if not busy:
                return rounds
            if rounds >= max_steps:
                raise ConfigError(f"engines not idle after {max_steps} rounds")
            for e in busy:
                e.step()
            rounds += 1

    def announce(
        self,
        seen: Callable[[tuple[str, int]], bool],
        timeout_s: float = 10.0,
        interval_s: float = 0.02,
    ) -> list[tuple[str, int]]:
        """Publish empty batches from every worker until ``seen(worker_id)`` holds for
        each (ZMQ's slow-joiner handshake: a SUB misses what was sent before it joined).

        Returns the workers never seen within ``timeout_s``.  An empty batch carries no
        event, so consumers' state is unchanged; it does consume a seq.
        """
        deadline = time.monotonic() + timeout_s
        pending = [w for w in self.workers]
        while pending and time.monotonic() < deadline:
            for w in pending:
                w.publisher.publish(KVEventBatch(time.time(), [], w.dp_rank))
                w.engine.stats.batches_published += 1
            end = time.monotonic() + interval_s
            while time.monotonic() < end:
                pending = [w for w in pending if not seen(w.worker_id)]
                if not pending:
                    break
                time.sleep(0.002)
        return [w.worker_id for w in pending]

    def close(self) -> None:
        """Shut every publisher down (idempotent)."""
        for w in self.workers:
            try:
                w.publisher.shutdown()
            except Exception:  # pragma: no cover - shutdown never raises by contract
                logger.exception("publisher shutdown failed")

    def __enter__(self) -> SimCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
