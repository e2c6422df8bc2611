"""Replicas share their reservations over NATS, so a burst split across them lands together.

Each ``kvevents serve`` replica publishes every reservation it takes (the engine rank,
the request's content keys, the TTL left) on a NATS subject (``kvevents.pending``, core
NATS: fire and forget) and folds the other replicas' into its own pending overlay, for
what is left of their TTL.  Nothing else travels this way: confirmed state still comes
from the engines' events only.  A replica that is slow, disconnected or restarted loses
peers' reservations (its overlay), nothing more: sends wait in a bounded queue (full:
dropped and counted), the subscription has bounded pending limits (a slow consumer's
messages are dropped by the client), and a message that does not decode or names an
engine rank this replica does not know is counted and skipped.  A peer's reservation is
taken into this replica's :class:`~kvevents.consumers.PendingOverlay` on the same rank
(:meth:`ReservationExchange.fold`), and ended here when its end arrives
(:meth:`ReservationExchange.fold_end`).

Messages are msgspec MessagePack arrays ``[1, origin, engine, rank, ttl_ms, unit, keys,
rid, end]``: ``unit`` is the tokens per content key (the index's canonical block size; a
replica with another unit skips them), ``keys`` at most :data:`MAX_KEYS` 64-bit keys,
``rid`` the reservation's id at its origin.  ``end`` 0 is a reservation; 1 says its
request finished (each replica then confirms it from its own index, or contradicts it
after the grace), 2 that it never reached its engine (dropped at once); those carry no
keys.

One job: the exchange, both ways.  Imports the consumers (the overlay, the router), the
fleet, and nats-py when started (the ``jetstream`` extra); the local side
(:mod:`~kvevents.serve.reservations`) calls :meth:`ReservationExchange.publish` and
:meth:`ReservationExchange.publish_end`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from kvevents.consumers import PendingOverlay, Router
from kvevents.serve.config import ServeConfig
from kvevents.serve.fleet import Fleet, RankState

__all__ = ["DROPPED", "FINISHED", "SUBJECT", "ExchangeStats", "ReservationExchange"]

logger = logging.getLogger(__name__)

SUBJECT = "kvevents.pending"
"""The NATS subject reservations travel on."""
MAX_KEYS = 32_768
"""Keys per message at most (512k tokens at 16 per key; about 300 kB)."""
QUEUE = 1024
"""Reservations waiting to be sent at most."""
_VERSION = 1
FINISHED = 1
"""A request's answer ended (the end of a reservation, as the exchange carries it)."""
DROPPED = 2
"""A request never reached its engine."""


class _Wire(msgspec.Struct, array_like=True, frozen=True):
    v: int
    origin: str
    engine: str
    rank: int
    ttl_ms: int
    unit: int
    keys: list[int]
    rid: int = 0
    end: int = 0


@dataclass
class ExchangeStats:
    """Counters of a :class:`ReservationExchange`."""

    published: int = 0
    publish_dropped: int = 0
    """Not sent: the queue was full, not connected, or too many keys."""
    received: int = 0
    folded: int = 0
    skipped_bad: int = 0
    """Did not decode, or out of range."""
    skipped_unit: int = 0
    """Another tokens-per-key unit than this replica's index."""
    skipped_engine: int = 0
    """An engine rank this replica does not route to."""
    skipped_own: int = 0
    ends_folded: int = 0
    """Ends of peers' reservations applied here (finished or dropped)."""
    connects: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ReservationExchange:
    """Publishes this replica's reservations and folds the others' into ``overlay`` (see
    the module): ``router`` gives the tokens per key (its index's canonical block size),
    ``fleet`` the engine ranks a peer's reservation may name."""

    def __init__(
        self, url: str, replica: str, fleet: Fleet, overlay: PendingOverlay, router: Router
    ) -> None:
        self.url = url
        self.replica = replica
        self.fleet = fleet
        self.overlay = overlay
        self.router = router
        self.stats = ExchangeStats()
        self._nc: Any = None
        self._queue: asyncio.Queue[bytes] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(_Wire)
        self.connected = asyncio.Event()
        self._peers: dict[tuple[str, int], int] = {}  # (origin, its rid) -> local rid
        self._ranks = {(st.engine.name, st.rank): st for st in fleet.ranks}

    @classmethod
    def for_config(
        cls, config: ServeConfig, fleet: Fleet, overlay: PendingOverlay | None, router: Router
    ) -> ReservationExchange | None:
        """The exchange of a service: on ``pending_nats`` (else ``nats_url``) when it has
        a pending ``overlay``; None otherwise."""
        url = config.pending_nats or config.nats_url
        if overlay is None or url is None:
            return None
        name = config.replica or (
            f"{socket.gethostname()}:{config.port}:{os.getpid()}:{os.urandom(3).hex()}"
        )
        return cls(url, name, fleet, overlay, router)

    def gauges(self) -> dict[str, float]:
        return {"connected": 1.0 if self.connected.is_set() else 0.0}

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Start connecting (in the background: the service starts without NATS too)."""
        self._queue = asyncio.Queue(QUEUE)
        self._tasks.append(asyncio.create_task(self._run()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
            self._nc = None
        self.connected.clear()

    async def _run(self) -> None:
        import nats

        async def up() -> None:
            self.connected.set()

        async def down() -> None:
            self.connected.clear()

        async def error(exc: Exception) -> None:
            # each failed reconnect lands here; the loss and the return of the server are
            # said once by the event reader's connection (kvevents.jetstream.connection)
            logger.debug("reservation exchange: %s", exc)

        while self._nc is None:
            try:
                self._nc = await nats.connect(
                    self.url,
                    name=f"kvevents-serve {self.replica}",
                    no_echo=True,
                    connect_timeout=2,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    reconnected_cb=up,
                    disconnected_cb=down,
                    error_cb=error,
                )
            except Exception as exc:
                logger.warning("reservation exchange: cannot connect to %s: %s", self.url, exc)
                await asyncio.sleep(1.0)
        await self._nc.subscribe(
            SUBJECT, cb=self._on_msg, pending_msgs_limit=4096, pending_bytes_limit=64 << 20
        )
        await self._nc.flush()
        self.stats.connects += 1
        self.connected.set()
        assert self._queue is not None
        while True:
            data = await self._queue.get()
            try:
                await self._nc.publish(SUBJECT, data)
                self.stats.published += 1
            except Exception as exc:  # disconnected, buffer full: the peers miss one
                self.stats.publish_dropped += 1
                logger.debug("reservation exchange: publish failed: %s", exc)

    # --- both directions -----------------------------------------------------------------
    def publish(self, state: RankState, keys: list[int], ttl_s: float, rid: int) -> None:
        """Queue reservation ``rid`` of ``keys`` on ``state`` for the other replicas."""
        if len(keys) > MAX_KEYS:
            self.stats.publish_dropped += 1
            return
        unit = self.router.index.canonical_block_size
        self._send(
            _Wire(
                _VERSION, self.replica, state.engine.name, state.rank, int(ttl_s * 1000),
                unit, keys, rid,
            )
        )  # fmt: skip

    def publish_end(self, rid: int, how: int) -> None:
        """Queue the end of reservation ``rid`` (``how``: finished or dropped)."""
        self._send(_Wire(_VERSION, self.replica, "", 0, 0, 0, [], rid, how))

    def _send(self, msg: _Wire) -> None:
        q = self._queue
        if q is None or not self.connected.is_set():
            self.stats.publish_dropped += 1
            return
        try:
            q.put_nowait(self._encoder.encode(msg))
        except asyncio.QueueFull:
            self.stats.publish_dropped += 1

    async def _on_msg(self, msg: Any) -> None:
        self.stats.received += 1
        try:
            w = self._decoder.decode(msg.data)
        except (msgspec.DecodeError, ValueError, TypeError):
            self.stats.skipped_bad += 1
            return
        if w.v != _VERSION or w.end not in (0, FINISHED, DROPPED):
            self.stats.skipped_bad += 1
            return
        if w.origin == self.replica:
            self.stats.skipped_own += 1
            return
        if w.end:
            if self.fold_end(w.origin, w.rid, w.end):
                self.stats.ends_folded += 1
            return
        if (
            w.ttl_ms <= 0
            or not w.keys
            or len(w.keys) > MAX_KEYS
            or any(k < 0 or k >= 1 << 64 for k in w.keys)
        ):
            self.stats.skipped_bad += 1
            return
        if w.unit != self.router.index.canonical_block_size:
            self.stats.skipped_unit += 1
            return
        if self.fold(w.origin, w.engine, w.rank, w.keys, w.ttl_ms / 1000.0, w.rid):
            self.stats.folded += 1
        else:
            self.stats.skipped_engine += 1

    def fold(
        self, origin: str, engine: str, rank: int, keys: list[int], ttl_s: float, peer_rid: int
    ) -> bool:
        """A peer replica's reservation: pending here too, for what is left of its TTL.
        False (nothing taken) for an engine rank this service does not know."""
        state = self._ranks.get((engine, rank))
        if state is None:
            return False
        rid = self.overlay.reserve(state.worker, keys, ttl_s=ttl_s, origin=origin)
        if rid is None:
            return False
        peers = self._peers
        peers[(origin, peer_rid)] = rid
        if len(peers) > 2 * self.overlay.max_entries:  # forget the ended ones
            live = {r.rid for r in self.overlay.reservations()}
            self._peers = {k: v for k, v in peers.items() if v in live}
        return True

    def fold_end(self, origin: str, peer_rid: int, how: int) -> bool:
        """A peer's request ended (:data:`FINISHED`: confirmed here by the events, or
        contradicted after the grace; :data:`DROPPED`: it never reached its engine).
        False when this replica does not hold that reservation."""
        rid = self._peers.pop((origin, peer_rid), None)
        if rid is None:
            return False
        if how == DROPPED:
            self.overlay.cancel(rid)
        else:
            with self.fleet.lock:
                self.overlay.finished(rid, self.fleet.index)
        return True
