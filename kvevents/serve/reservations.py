"""The service's pending overlay: what it just routed to each engine rank.

When ``kvevents serve`` sends a request to a rank, the request's content keys become
pending there (:class:`~kvevents.consumers.PendingOverlay`), so its siblings that
arrive before the rank's events (a burst sharing a long new context) are sent to the
same rank instead of recomputing the context elsewhere.  A reservation ends when the
rank's events show the blocks (confirmed), when the request finished and a grace later
they still do not (contradicted), at its TTL, or when the overlay's bound needs room.
A request that never reached its engine (refused connection) drops its reservation.

With an exchange (:mod:`~kvevents.serve.exchange`), the reservations are also published
to the other replicas and theirs folded in here.

One job: the overlay's lifecycle around the request path.  Imports the consumers (the
overlay, the router) and the fleet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvevents.consumers import PendingOverlay, Router
from kvevents.request import RequestKey
from kvevents.serve.config import ServeConfig
from kvevents.serve.fleet import Fleet, RankState

__all__ = ["DROPPED", "FINISHED", "Reservations"]

logger = logging.getLogger(__name__)

MAX_ENTRIES = 4096
"""Reservations the overlay holds at most (besides its byte bound)."""
FINISHED = 1
"""A request's answer ended (the end of a reservation, as the exchange carries it)."""
DROPPED = 2
"""A request never reached its engine."""


class Reservations:
    """The pending overlay of one service and the hooks the request path calls.

    ``overlay`` is handed to the routing policy's :class:`Router`; :meth:`reserve` runs
    when a request is sent to a rank, :meth:`finished` when its answer ended,
    :meth:`dropped` when it never reached the engine.  ``publish`` (set by the exchange)
    receives every local reservation.
    """

    def __init__(self, config: ServeConfig, fleet: Fleet) -> None:
        self.fleet = fleet
        self.weight = config.pending_weight
        self.overlay = PendingOverlay(
            ttl_s=config.pending_ttl_s,
            max_entries=MAX_ENTRIES,
            max_bytes=config.pending_max_bytes,
        )
        self.router: Router | None = None
        """Set by the service: the router whose keys the reservations use."""
        self.publish: Callable[[RankState, list[int], float, int], None] | None = None
        """``(state, keys, ttl_s, rid) -> None``: set by the exchange."""
        self.publish_end: Callable[[int, int], None] | None = None
        """``(rid, how) -> None`` (:data:`FINISHED` or :data:`DROPPED`): set by the
        exchange."""
        self._peers: dict[tuple[str, int], int] = {}  # (origin, its rid) -> local rid
        self._ranks = {(st.engine.name, st.rank): st for st in fleet.ranks}

    @property
    def stats(self) -> Any:
        """The overlay's counters (``kvevents_pending_*`` in ``/metrics``)."""
        return self.overlay.stats

    def gauges(self) -> dict[str, float]:
        return {"entries": float(len(self.overlay)), "bytes": float(self.overlay.nbytes)}

    def reserve(self, key: RequestKey, state: RankState) -> int | None:
        """``key`` is being sent to ``state``: its keys become pending there."""
        router = self.router
        if router is None:
            return None
        keys = router.request_keys(key)  # (outside the lock: no index state read)
        if not keys:
            return None
        with self.fleet.lock:
            self.overlay.sweep(self.fleet.index)  # what is due ends, confirmed or not
        rid = self.overlay.reserve(self.fleet.worker_id(state), keys)
        if rid is not None and self.publish is not None:
            self.publish(state, keys, self.overlay.ttl_s, rid)
        return rid

    def finished(self, rid: int | None) -> None:
        """The answer of reservation ``rid``'s request ended."""
        if rid is None:
            return
        with self.fleet.lock:
            self.overlay.finished(rid, self.fleet.index)
        if self.publish_end is not None:
            self.publish_end(rid, FINISHED)

    def dropped(self, rid: int | None) -> None:
        """Reservation ``rid``'s request never reached its engine."""
        if rid is not None:
            self.overlay.cancel(rid)
            if self.publish_end is not None:
                self.publish_end(rid, DROPPED)

    def fold(
        self, origin: str, engine: str, rank: int, keys: list[int], ttl_s: float, peer_rid: int
    ) -> bool:
        """A peer replica's reservation: pending here too, for what is left of its TTL.
        False (nothing taken) for an engine rank this service does not know."""
        state = self._ranks.get((engine, rank))
        if state is None:
            return False
        wid = self.fleet.worker_id(state)
        rid = self.overlay.reserve(wid, keys, ttl_s=ttl_s, origin=origin)
        if rid is None:
            return False
        peers = self._peers
        peers[(origin, peer_rid)] = rid
        if len(peers) > 2 * MAX_ENTRIES:  # forget the peers' reservations that ended here
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
