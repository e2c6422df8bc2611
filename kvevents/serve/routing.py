"""Choosing an engine: the routing policies and the load each engine carries.

Costs are in prompt tokens.  For the KV-aware policies, an engine rank's cost is
:class:`~kvevents.consumers.Router`'s: the prompt tokens it would have to prefill (the
prompt minus tier-weighted reuse) plus its load.  Load is what already waits on that
rank, also in tokens:

``load = load_tokens × (requests in flight through the service + the engine's other
requests) + prompt tokens still to prefill of the requests in flight that have not
answered yet + load_tokens × KV-cache usage``

where the engine's other requests are the running + waiting it reported at the last
``/metrics`` scrape minus the service's own requests in flight at that moment (the
service's own are counted live, so a scrape does not keep them alive after they end).

So a new conversation that shares only a short system prompt with a busy engine goes to
an idle one (the few hundred reused tokens are worth less than a queued request), while
a follow-up turn, whose whole history is cached on its engine, stays there.

``kv-aware-gpu`` is a KV-aware router fed GPU events only (the fleet drops CPU and
storage events for it, as routers that ignore events without tokens do): it cannot see,
value or predict the CPU tier.  ``round-robin`` and ``random`` ignore the cache and the
load, and are there as baselines.
Every policy reports the index's prediction (the match per tier) for the rank it picks,
so the online truth check works whatever the policy.

With a pending overlay (:mod:`~kvevents.serve.reservations`), the KV-aware policies
also credit ``pending``: tokens the service just routed to a rank that its events do not
show yet, at the overlay's weight.  Such a request waits for that rank's prefill of the
shared blocks instead of computing them: the rank's in-flight prefill counted in its
load is lowered by the pending tokens credited (never below zero).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvevents.consumers import Match, PendingOverlay, Router, TierWeights
from kvevents.errors import ConfigError
from kvevents.request import RequestKey
from kvevents.serve.config import POLICIES
from kvevents.serve.fleet import Fleet, RankState

__all__ = ["LoadTracker", "Ranked", "RoutingPolicy"]

_ZERO = Match()


@dataclass(frozen=True)
class Ranked:
    """One engine rank scored for a request (tokens; lower ``cost`` is better)."""

    state: RankState
    match: Match
    load: float
    cost: float
    pending: int = 0
    """Tokens pending on the rank beyond ``match`` (routed there, not yet confirmed)."""

    def as_json(self) -> dict[str, Any]:
        return {
            "engine": self.state.engine.name,
            "rank": self.state.rank,
            "gpu": self.match.gpu,
            "cpu": self.match.cpu,
            "storage": self.match.storage,
            "pending": self.pending,
            "load": round(self.load, 3),
            "cost": round(self.cost, 3),
        }


@dataclass
class _Gauges:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    external: float = 0.0


@dataclass
class LoadTracker:
    """In-flight requests per rank (as the service sees them) and the engines' gauges.

    Used from the event loop thread only.
    """

    load_tokens: float = 64.0
    inflight: dict[str, int] = field(default_factory=dict)
    prefill: dict[str, int] = field(default_factory=dict)
    gauges: dict[str, _Gauges] = field(default_factory=dict)

    def load(self, label: str) -> float:
        g = self.gauges.get(label)
        queued = float(self.inflight.get(label, 0)) + (g.external if g else 0.0)
        usage = g.kv_usage if g else 0.0
        return self.load_tokens * (queued + usage) + self.prefill.get(label, 0)

    def started(self, label: str, uncached: int) -> None:
        self.inflight[label] = self.inflight.get(label, 0) + 1
        self.prefill[label] = self.prefill.get(label, 0) + uncached

    def answered(self, label: str, uncached: int) -> None:
        """The first bytes of the answer arrived: its prefill is done."""
        self.prefill[label] = max(0, self.prefill.get(label, 0) - uncached)

    def finished(self, label: str) -> None:
        self.inflight[label] = max(0, self.inflight.get(label, 0) - 1)

    def set_gauges(self, label: str, running: float, waiting: float, kv_usage: float) -> None:
        """Record a scrape.  The requests the engine reports beyond those in flight through
        the service at that moment are others' (``external``); the service's own are
        counted live, so a scrape taken while they ran does not outlive them."""
        external = max(0.0, running + waiting - self.inflight.get(label, 0))
        self.gauges[label] = _Gauges(running, waiting, kv_usage, external)


class RoutingPolicy:
    """Ranks the up engine ranks of a :class:`Fleet` for a request key."""

    def __init__(
        self,
        fleet: Fleet,
        policy: str,
        loads: LoadTracker,
        seed: int = 0,
        *,
        pending: PendingOverlay | None = None,
        pending_weight: float = 0.0,
    ) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
        self.fleet = fleet
        self.policy = policy
        self.loads = loads
        self.router = Router(
            fleet.index,
            weights=TierWeights(),
            load_weight=1.0,
            pending=pending,
            pending_weight=pending_weight,
        )
        self._rng = random.Random(seed)
        self._next = 0
        self._lock = threading.Lock()

    def _score(self, key: RequestKey, loads: Mapping[tuple[str, int], float]) -> list[Any]:
        return self.router.score(key, loads)

    def rank(self, key: RequestKey, candidates: Sequence[RankState]) -> list[Ranked]:
        """``candidates`` ranked for ``key``, best first."""
        if not candidates:
            return []
        fleet = self.fleet
        wid_of = {st.worker: st for st in candidates}
        load_of = {wid: self.loads.load(st.label) for wid, st in wid_of.items()}
        kv = self.policy.startswith("kv-aware")
        cost_loads = load_of if kv else dict.fromkeys(load_of, 0.0)
        with fleet.lock:
            scored = self._score(key, cost_loads)
        ranked = [
            Ranked(wid_of[c.worker], c.match, load_of[c.worker], c.cost, c.pending)
            for c in scored
            if c.worker in wid_of
        ]
        if kv and any(r.pending for r in ranked):
            lw, prefill = self.router.load_weight, self.loads.prefill
            ranked = [
                replace(r, cost=r.cost - lw * min(r.pending, prefill.get(r.state.label, 0)))
                if r.pending
                else r
                for r in ranked
            ]
            ranked.sort(key=lambda r: (r.cost, r.state.worker))
        if len(ranked) < len(wid_of):
            # untrusted ranks (silent streams, left out by the index): no KV credit, load only
            seen = {id(r.state) for r in ranked}
            n = len(key.tokens)
            ranked += [
                Ranked(st, _ZERO, load_of[wid], n + cost_loads[wid])
                for wid, st in wid_of.items()
                if id(st) not in seen
            ]
            ranked.sort(key=lambda r: (r.cost, r.state.worker))
        if self.policy.startswith("kv-aware"):
            return ranked
        ranked.sort(key=lambda r: (r.state.engine.name, r.state.rank))
        with self._lock:
            if self.policy == "round-robin":
                i = self._next % len(ranked)
                self._next += 1
            else:
                i = self._rng.randrange(len(ranked))
        return ranked[i:] + ranked[:i]
