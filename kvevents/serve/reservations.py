"""The service's pending overlay: what it just routed to each engine rank.

When ``kvevents serve`` sends a request to a rank, the request's content keys become
pending there (:class:`~kvevents.consumers.PendingOverlay`), so its siblings that
arrive before the rank's events (a burst sharing a long new context) are sent to the
same rank instead of recomputing the context elsewhere.  A reservation ends when the
rank's events show the blocks (confirmed), when the request finished and a grace later
they still do not (contradicted), at its TTL, or when the overlay's bound needs room.
A request that never reached its engine (refused connection) drops its reservation.

With an exchange (:mod:`~kvevents.serve.exchange`), the reservations are also published
to the other replicas (the exchange folds theirs into the same overlay).

One job: the overlay's lifecycle around the request path.  Imports the consumers (the
overlay, the router), the fleet and the exchange.
"""

from __future__ import annotations

import logging
from typing import Any

from kvevents.consumers import PendingOverlay, Router
from kvevents.request import RequestKey
from kvevents.serve.config import ServeConfig
from kvevents.serve.exchange import DROPPED, FINISHED, ReservationExchange
from kvevents.serve.fleet import Fleet, RankState

__all__ = ["Reservations", "pending_overlay"]

logger = logging.getLogger(__name__)

MAX_ENTRIES = 4096
"""Reservations the overlay holds at most (besides its byte bound)."""


def pending_overlay(config: ServeConfig) -> PendingOverlay | None:
    """The pending overlay ``config`` asks for: one with the KV-aware policies and a
    ``pending_weight`` above 0, else None."""
    if config.pending_weight <= 0 or not config.policy.startswith("kv-aware"):
        return None
    return PendingOverlay(
        ttl_s=config.pending_ttl_s, max_entries=MAX_ENTRIES, max_bytes=config.pending_max_bytes
    )


class Reservations:
    """The hooks the request path calls around ``overlay`` (the one handed to the routing
    policy's ``router``, whose keys the reservations use): :meth:`reserve` runs when a
    request is sent to a rank, :meth:`finished` when its answer ended, :meth:`dropped`
    when it never reached the engine.  With an ``exchange``, each local reservation and
    its end are published to the other replicas.
    """

    def __init__(
        self,
        fleet: Fleet,
        overlay: PendingOverlay,
        router: Router,
        exchange: ReservationExchange | None = None,
    ) -> None:
        self.fleet = fleet
        self.overlay = overlay
        self.router = router
        self.exchange = exchange

    @property
    def stats(self) -> Any:
        """The overlay's counters (``kvevents_pending_*`` in ``/metrics``)."""
        return self.overlay.stats

    def gauges(self) -> dict[str, float]:
        """Live reservations and their bytes, after ending what is due: a quiet service
        routes nothing that would sweep, and reservations its engines confirmed after
        their requests finished (or that expired) would otherwise read as live."""
        with self.fleet.lock:
            self.overlay.sweep(self.fleet.index)
        return {"entries": float(len(self.overlay)), "bytes": float(self.overlay.nbytes)}

    def reserve(self, key: RequestKey, state: RankState) -> int | None:
        """``key`` is being sent to ``state``: its keys become pending there."""
        keys = self.router.request_keys(key)  # (outside the lock: no index state read)
        if not keys:
            return None
        with self.fleet.lock:
            self.overlay.sweep(self.fleet.index)  # what is due ends, confirmed or not
        rid = self.overlay.reserve(state.worker, keys)
        if rid is not None and self.exchange is not None:
            self.exchange.publish(state, keys, self.overlay.ttl_s, rid)
        return rid

    def finished(self, rid: int | None) -> None:
        """The answer of reservation ``rid``'s request ended."""
        if rid is None:
            return
        with self.fleet.lock:
            self.overlay.finished(rid, self.fleet.index)
        if self.exchange is not None:
            self.exchange.publish_end(rid, FINISHED)

    def dropped(self, rid: int | None) -> None:
        """Reservation ``rid``'s request never reached its engine."""
        if rid is not None:
            self.overlay.cancel(rid)
            if self.exchange is not None:
                self.exchange.publish_end(rid, DROPPED)
