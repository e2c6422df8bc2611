"""The pending overlay: what a router just sent to an engine rank, before its events say so.

An engine publishes a prompt's blocks once it has computed them.  Requests that arrive
during that prefill (the siblings of a burst sharing a long new context) see nothing
in the index, so a KV-aware router spreads them and every engine recomputes the
context.  :class:`PendingOverlay` closes that gap: when a request is routed to a worker,
its content keys (the same chained keys the index uses, LoRA, cache salt and multimodal
inputs included) become *pending* on that worker.

The contract:

* **Apart from confirmed state.**  The overlay never writes the index.  A worker is
  credited with pending tokens only beyond what the index already gives it for the
  request (:meth:`PendingOverlay.pending_tokens`), and the router weighs them with their
  own weight, never as GPU truth.
* **Bounded.**  At most ``max_entries`` reservations and about ``max_bytes`` of memory
  (an upper estimate of what the overlay's tables hold, :attr:`PendingOverlay.nbytes`);
  a new reservation evicts the oldest ones until it fits (``evicted_for_bound``); one
  larger than the whole bound is refused (``refused``).
* **Expiring.**  A reservation lives ``ttl_s`` seconds at most (``expired``).  It ends
  earlier when its worker's events *confirm* it (the index holds one of its last
  blocks on any tier of that worker: ``confirmed``), or *contradict* it: the request
  finished (:meth:`PendingOverlay.finished`) and ``grace_s`` later the index still does
  not hold it (never stored, or stored and already removed: ``contradicted``).
* **Chained keys.**  A content key covers its whole prefix, so a worker's pending prefix
  for a request is the longest run of the request's leading keys held by that worker's
  reservations.

Reservations may come from another router replica (``origin``); they carry their own
TTL.  Not thread-safe: use one overlay from one thread (``kvevents serve`` uses it from
its event loop, under the fleet lock while it reads the index).

May import: :mod:`kvevents.consumers.index` and :mod:`kvevents.errors`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

from kvevents.consumers.index import BlockIndex, IndexLayout, WorkerId
from kvevents.errors import ConfigError

__all__ = ["DEFAULT_PENDING_WEIGHT", "PendingOverlay", "PendingStats", "Reservation"]

logger = logging.getLogger(__name__)

DEFAULT_PENDING_WEIGHT = 0.5
"""How much a pending token is worth against a reused one (1.0): chosen by measurement
(``docs/serve.md``, the pending overlay)."""
ENTRY_BYTES = 320
"""Estimated bytes of one reservation apart from its keys (its record, its place in the
tables and in the expiry heap)."""
KEY_BYTES = 160
"""Estimated bytes per content key of a reservation: the key's slot in the reservation's
tuple, the int object, and its entry in the worker's table (dict entries and their
share of the table's spare room)."""
CONFIRM_WINDOW = 16
"""How many of a reservation's last keys are looked up to confirm it: a stored engine
block ends at one of them when the engine's block is at most this many canonical units."""
SWEEP_CHECKS = 4
"""Reservations checked against the index per :meth:`PendingOverlay.sweep` beyond those
due (round robin), so confirmations are noticed without a background task."""


@dataclass
class PendingStats:
    """Counters of a :class:`PendingOverlay` (reservations, not keys)."""

    added: int = 0
    """Reservations taken (local and from peers)."""
    confirmed: int = 0
    """Ended because the worker's events showed the blocks stored."""
    expired: int = 0
    """Ended at their TTL without confirmation."""
    contradicted: int = 0
    """Ended because the request finished and the blocks were not (or no longer) held."""
    evicted_for_bound: int = 0
    """Ended early to keep the overlay within ``max_entries`` / ``max_bytes``."""
    refused: int = 0
    """Not taken: empty, or larger than the whole byte bound on its own."""
    replaced: int = 0
    """Ended because the same id was reserved again (a peer's repeated message)."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class Reservation:
    """One routed request's keys pending on one worker."""

    rid: int
    worker: WorkerId
    keys: tuple[int, ...]
    expires: float
    """Monotonic clock time it ends at unless confirmed first."""
    origin: str
    """Who reserved it: ``"local"`` or a peer replica's name."""
    nbytes: int
    finished: bool = False
    """The request finished: ``expires`` is then its deadline to be confirmed."""


class PendingOverlay:
    """Keys just routed to a worker and not yet confirmed by its events (see the module
    docstring for the contract).

    ``ttl_s``: how long a reservation lives at most; ``grace_s``: how long after its
    request finished the worker's events may take to confirm it; ``max_entries`` and
    ``max_bytes``: the bounds; ``clock``: a monotonic clock in seconds (tests pass their
    own).  Counters are in :attr:`stats`.
    """

    def __init__(
        self,
        ttl_s: float = 10.0,
        *,
        grace_s: float = 1.0,
        max_entries: int = 4096,
        max_bytes: int = 32 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (ttl_s > 0 and math.isfinite(ttl_s)) or not (grace_s >= 0):
            raise ConfigError("pending overlay: ttl_s must be > 0 and finite, grace_s >= 0")
        if max_entries < 1 or max_bytes < ENTRY_BYTES + KEY_BYTES:
            raise ConfigError(
                f"pending overlay: max_entries must be >= 1 and max_bytes >= "
                f"{ENTRY_BYTES + KEY_BYTES}"
            )
        self.ttl_s = float(ttl_s)
        self.grace_s = float(grace_s)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.clock = clock
        self.stats = PendingStats()
        self._by_id: dict[int, Reservation] = {}  # insertion order: oldest first
        self._held: dict[WorkerId, dict[int, int]] = {}  # worker -> key -> reservations
        self._first: dict[int, dict[WorkerId, int]] = {}  # first key -> worker -> count
        self._heap: list[tuple[float, int]] = []  # (deadline, rid); stale entries skipped
        self._ids = itertools.count(1)
        self._nbytes = 0
        self._cursor = 0  # round-robin position of the sweep's extra checks
        self._slots: tuple[IndexLayout | None, dict[WorkerId, int]] = (None, {})

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def nbytes(self) -> int:
        """The estimated memory the overlay holds (≤ ``max_bytes``)."""
        return self._nbytes

    def reservations(self) -> list[Reservation]:
        """Every live reservation, oldest first (a copy of the list)."""
        return list(self._by_id.values())

    def workers(self) -> dict[WorkerId, int]:
        """Live reservations per worker."""
        out: dict[WorkerId, int] = {}
        for r in self._by_id.values():
            out[r.worker] = out.get(r.worker, 0) + 1
        return out

    def pending_runs(self, keys: Sequence[int]) -> dict[WorkerId, int]:
        """Per worker with any, how many of ``keys`` (a request's chained content keys,
        in order) lead a run its reservations hold."""
        if not keys or not self._by_id:
            return {}
        first = self._first.get(keys[0])
        if not first:
            return {}
        out: dict[WorkerId, int] = {}
        held = self._held
        for w in first:
            table = held[w]
            i = 1
            for k in itertools.islice(keys, 1, None):
                if k not in table:
                    break
                i += 1
            out[w] = i
        return out

    def pending_tokens(
        self,
        keys: Sequence[int],
        n: int,
        unit: int,
        confirmed: Mapping[WorkerId, int] | None = None,
    ) -> dict[WorkerId, int]:
        """Per worker, the prompt tokens pending beyond what is confirmed: the worker's
        pending run in tokens (``unit`` tokens per key; at most ``n - 1``, the last prompt
        token is always recomputed, in whole units) less ``confirmed[worker]`` (the
        tokens the index already gives it, every tier).  Workers with nothing beyond are
        left out."""
        runs = self.pending_runs(keys)
        if not runs:
            return {}
        cap = max(0, (n - 1) // unit) * unit
        got = confirmed or {}
        out: dict[WorkerId, int] = {}
        for w, run in runs.items():
            extra = min(run * unit, cap) - got.get(w, 0)
            if extra > 0:
                out[w] = extra
        return out

    # ------------------------------------------------------------------ writing

    def reserve(
        self,
        worker: WorkerId,
        keys: Iterable[int],
        *,
        ttl_s: float | None = None,
        origin: str = "local",
        rid: int | None = None,
    ) -> int | None:
        """Mark ``keys`` (a routed request's chained content keys, in order) pending on
        ``worker`` for ``ttl_s`` seconds (default the overlay's; a peer's reservation
        carries what is left of its own).  Returns the reservation's id, or None when it
        was refused (no keys, a TTL that is not positive, or larger than the byte bound).
        ``rid``: an id to use (a peer's reservation is folded in under an id of the
        caller's making); reserving an id again replaces the reservation."""
        ks = tuple(keys)
        ttl = self.ttl_s if ttl_s is None else min(float(ttl_s), self.ttl_s)
        size = ENTRY_BYTES + KEY_BYTES * len(ks)
        if not ks or not ttl > 0 or size > self.max_bytes:
            self.stats.refused += 1
            return None
        self.sweep()
        if rid is None:
            rid = next(self._ids)
        elif rid in self._by_id:
            self._drop(self._by_id[rid])
            self.stats.replaced += 1
        while self._by_id and (
            len(self._by_id) >= self.max_entries or self._nbytes + size > self.max_bytes
        ):
            self._drop(next(iter(self._by_id.values())))
            self.stats.evicted_for_bound += 1
        r = Reservation(rid, worker, ks, self.clock() + ttl, origin, size)
        self._by_id[rid] = r
        self._nbytes += size
        table = self._held.setdefault(worker, {})
        for k in ks:
            table[k] = table.get(k, 0) + 1
        first = self._first.setdefault(ks[0], {})
        first[worker] = first.get(worker, 0) + 1
        heapq.heappush(self._heap, (r.expires, rid))
        self.stats.added += 1
        return rid

    def finished(self, rid: int, index: BlockIndex | None = None) -> None:
        """The request of reservation ``rid`` finished.  With ``index``, a reservation
        its worker's events already confirm ends now (``confirmed``); otherwise it has
        ``grace_s`` more seconds (never beyond its TTL) for them to arrive, then it is
        ``contradicted``."""
        r = self._by_id.get(rid)
        if r is None or r.finished:
            return
        if index is not None and self._held_by_index(r, index):
            self._drop(r)
            self.stats.confirmed += 1
            return
        r.finished = True
        deadline = min(r.expires, self.clock() + self.grace_s)
        if deadline < r.expires:
            r.expires = deadline
            heapq.heappush(self._heap, (deadline, rid))

    def cancel(self, rid: int) -> None:
        """Reservation ``rid``'s request never reached its worker: it ends now
        (``contradicted``)."""
        r = self._by_id.get(rid)
        if r is not None:
            self._drop(r)
            self.stats.contradicted += 1

    def gauges(self) -> dict[str, float]:
        """Live reservations and their estimated bytes."""
        return {"entries": float(len(self._by_id)), "bytes": float(self._nbytes)}

    def clear(self) -> None:
        """Drop every reservation (counted nowhere)."""
        for r in list(self._by_id.values()):
            self._drop(r)

    def sweep(self, index: BlockIndex | None = None, checks: int = SWEEP_CHECKS) -> None:
        """End what is due: reservations past their deadline (``expired``, or
        ``contradicted`` when their request finished; with ``index``, ``confirmed``
        when its worker holds them by then), and, with ``index``, up to ``checks``
        more reservations (round robin) that its worker's events confirm."""
        now = self.clock()
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, rid = heapq.heappop(heap)
            r = self._by_id.get(rid)
            if r is None or r.expires != deadline:
                continue  # ended already, or its deadline moved
            self._drop(r)
            if index is not None and self._held_by_index(r, index):
                self.stats.confirmed += 1
            elif r.finished:
                self.stats.contradicted += 1
            else:
                self.stats.expired += 1
        if len(heap) > 4 * len(self._by_id) + 64:  # stale entries of moved deadlines
            self._heap = [(r.expires, r.rid) for r in self._by_id.values()]
            heapq.heapify(self._heap)
        if index is None or not self._by_id or checks <= 0:
            return
        start = self._cursor if self._cursor < len(self._by_id) else 0
        live = list(itertools.islice(self._by_id.values(), start, start + checks))
        self._cursor = start + len(live)
        for r in live:
            if self._held_by_index(r, index):
                self._drop(r)
                self.stats.confirmed += 1

    def reconcile(self, index: BlockIndex) -> None:
        """Check every reservation against ``index`` and end what is due (a full
        :meth:`sweep`)."""
        self.sweep(index, checks=len(self._by_id))

    # ------------------------------------------------------------------ internals

    def _drop(self, r: Reservation) -> None:
        del self._by_id[r.rid]
        self._nbytes -= r.nbytes
        table = self._held[r.worker]
        for k in r.keys:
            c = table[k] - 1
            if c:
                table[k] = c
            else:
                del table[k]
        if not table:
            del self._held[r.worker]
        first = self._first[r.keys[0]]
        c = first[r.worker] - 1
        if c:
            first[r.worker] = c
        else:
            del first[r.worker]
            if not first:
                del self._first[r.keys[0]]

    def _held_by_index(self, r: Reservation, index: BlockIndex) -> bool:
        """Whether ``r``'s worker holds, on any tier, a block ending at one of ``r``'s
        last :data:`CONFIRM_WINDOW` keys."""
        mask = self._worker_mask(index, r.worker)
        if not mask:
            return False
        tails = r.keys[-CONFIRM_WINDOW:]
        for tier in range(3):
            marks = index.marks(tier)
            if marks and any(marks.get(k, 0) & mask for k in tails):
                return True
        return False

    def _worker_mask(self, index: BlockIndex, worker: WorkerId) -> int:
        lay = index.layout()
        cached, masks = self._slots
        if cached is not lay:
            masks = {}
            for wid, plan in lay.plans.items():
                for sg in plan.spec_groups:
                    masks[wid] = masks.get(wid, 0) | sg.bits
            self._slots = (lay, masks)
        return masks.get(worker, 0)
