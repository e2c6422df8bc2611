"""KV-aware routing over a :class:`~kvevents.consumers.index.BlockIndex`.

:meth:`Router.find_matches` says, per worker, how many leading prompt tokens that engine
would actually reuse from each tier, by vLLM's own rules (``docs/routing.md``):

* ``gpu``: ``KVCacheManager.get_computed_blocks``: at most ``num_tokens - 1`` tokens in
  whole blocks; with several KV-cache groups, ``HybridKVCacheCoordinator``'s lookup
  (hits aligned to the lcm of the block sizes; full-attention, sliding-window and
  chunked-local groups each judged as their manager's ``find_longest_cache_hit``
  judges them, until all agree); EAGLE's drop of the last block and lookahead hashing
  per worker;
* ``cpu``: the tokens the CPU tier adds *after* ``gpu``, as the offload connector's
  ``_lookup_complete_chunks`` counts them: a running bound from the request length (one
  less with windowed groups), tightened group by group (full attention first) to the end
  of the group's stored chunks from the chunk holding ``gpu``; nothing as soon as less
  than one of the current group's chunks remains beyond ``gpu``; when a group lowers
  the bound after a windowed group, the windowed groups are checked again at the lower
  bound, until it is stable;
* ``storage``: likewise after ``gpu + cpu``.

A request is its tokens or a :class:`~kvevents.RequestKey` (LoRA name, cache salt,
multimodal inputs, prompt embeddings).  Workers with one full-attention group and no
speculative mode (the usual fleet) are answered by walks that compute the prompt's
content keys once and intersect per-tier worker bitsets along them, so their cost grows
with the matched length, not with workers × length; every other worker is looked up on
its own (:class:`~kvevents.consumers.router.lookup.WorkerLookup`).

This module is the façade: it turns a request into content keys, sends the usual
workers to the bitset walk (:mod:`~kvevents.consumers.router.walk`) and the others to
the per-worker lookup (:mod:`~kvevents.consumers.router.lookup`), and prices the answer
(:mod:`~kvevents.consumers.router.scoring`).  With a
:class:`~kvevents.consumers.router.pending.PendingOverlay`, :meth:`Router.score` and
:meth:`Router.select` also credit what was just routed to a worker and is not confirmed
by its events yet, at ``pending_weight`` (:meth:`Router.reserve` records a routing).

May import: :mod:`kvevents.consumers.content`, :mod:`kvevents.consumers.index`,
:mod:`kvevents.errors`, :mod:`kvevents.request` and the router's own modules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvevents.consumers.content import prompt_keys, request_keys
from kvevents.consumers.index import BlockIndex, IndexLayout, WorkerId
from kvevents.consumers.router.lookup import compiled_lookups, lookup_matches, native_marks
from kvevents.consumers.router.match import Candidate, Match
from kvevents.consumers.router.pending import DEFAULT_PENDING_WEIGHT, PendingOverlay
from kvevents.consumers.router.scoring import (
    TierWeights,
    cheapest,
    choose,
    monotone,
    rank,
    slot_costs,
)
from kvevents.consumers.router.walk import (
    SlotEnds,
    assemble,
    full_prefix,
    simple_ends,
    simple_matches,
)
from kvevents.errors import ConfigError
from kvevents.request import MMFeature, PromptEmbeds, RequestKey

__all__ = ["Router"]

_NO_WORKERS = "no workers to route to: the index is empty and no loads given"


class Router:
    """Picks the worker that makes a prompt cheapest to prefill.

    ``cost(worker) = len(tokens) − (w_gpu·gpu + w_cpu·cpu + w_storage·storage
    + pending_weight·pending) + load_weight · load``; ties go to the smallest
    :data:`WorkerId`.  ``pending`` is 0 unless the router has a ``pending`` overlay
    (tokens routed to the worker by :meth:`reserve`, beyond its confirmed match).
    """

    def __init__(
        self,
        index: BlockIndex,
        weights: TierWeights | None = None,
        load_weight: float = 1.0,
        *,
        pending: PendingOverlay | None = None,
        pending_weight: float = DEFAULT_PENDING_WEIGHT,
    ) -> None:
        if not (pending_weight >= 0 and math.isfinite(pending_weight)):
            raise ConfigError(f"pending_weight must be finite and >= 0, not {pending_weight}")
        self.index = index
        self.weights = weights if weights is not None else TierWeights()
        self.load_weight = load_weight
        self.pending = pending
        self.pending_weight = pending_weight
        self._workers_cache: tuple[IndexLayout, int, list[WorkerId], set[WorkerId]] | None = None
        self._lookups_cache: tuple[IndexLayout, Any] | None = None

    # ---------------------------------------------------------------- matching

    def find_matches(
        self,
        request: Sequence[int] | RequestKey,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MMFeature] | None = None,
        prompt_embeds: PromptEmbeds | None = None,
    ) -> dict[WorkerId, Match]:
        """Per worker with anything reusable, its :class:`Match` (absent means all zero).

        ``request`` is the prompt's token ids, or a :class:`~kvevents.RequestKey`; the
        keyword arguments build one from tokens (LoRA adapter name, cache salt,
        multimodal inputs, prompt embeddings: what vLLM keys blocks by besides tokens).
        """
        key = _request_key(request, lora_name, cache_salt, mm_features, prompt_embeds)
        return self._find(*key, self.index.layout())

    def _find(
        self, tokens: Sequence[int], key: RequestKey | None, lay: IndexLayout
    ) -> dict[WorkerId, Match]:
        """:meth:`find_matches` of ``tokens`` (``key``: the request when it has more than
        tokens) on the index's layout ``lay``."""
        n = len(tokens)
        index = self.index
        unit = lay.canonical
        if n < 2:
            return {}
        if key is None:
            keys = prompt_keys(tokens, unit)
        elif key.prompt_embeds is None:
            keys = request_keys(key, unit)
        else:
            keys = []  # block-size dependent: every worker is looked up on its own
        out: dict[WorkerId, Match] = {}
        if lay.gpu_classes and keys:
            out = simple_matches(keys, n, lay, index)
        workers = lay.complex_workers if keys else tuple(lay.plans)
        if workers:
            # the GPU prefix of every full-attention slot of these workers, in one walk
            prefix = full_prefix(keys, n, lay, index) if keys and lay.complex_full_classes else None
            marks = index.marks(0), index.marks(1), index.marks(2)
            compiled = self._compiled_lookups(lay) if keys and native_marks(marks) else None
            if compiled is not None:
                compiled.matches(*marks, keys, n, unit, prefix, out)
            else:
                rkey = key if key is not None else RequestKey(tokens)
                plans = (lay.plans[wid] for wid in workers)
                lookup_matches(index, rkey, keys, prefix, plans, out)
        return out

    def _compiled_lookups(self, lay: IndexLayout) -> Any | None:
        """The compiled core's lookups of ``lay``'s complex workers (cached per layout),
        or None to look them up in Python (:func:`compiled_lookups`)."""
        cached = self._lookups_cache
        if cached is None or cached[0] is not lay:
            plans = [lay.plans[wid] for wid in lay.complex_workers]
            cached = self._lookups_cache = (lay, compiled_lookups(plans))
        return cached[1]

    # ---------------------------------------------------------------- choosing

    def score(
        self,
        request: Sequence[int] | RequestKey,
        loads: Mapping[WorkerId, float] | None = None,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MMFeature] | None = None,
        prompt_embeds: PromptEmbeds | None = None,
    ) -> list[Candidate]:
        """Every candidate worker with its match and cost, best first.

        Candidates are the index's workers plus any worker named in ``loads``, less
        the workers marked stale (:meth:`BlockIndex.set_stale`).  The request is given as
        to :meth:`find_matches`.
        """
        tokens, key = _request_key(request, lora_name, cache_salt, mm_features, prompt_embeds)
        lay = self.index.layout()
        matches = self._find(tokens, key, lay)
        return self._rank(request, matches, loads, self._pending(tokens, key, lay, matches))

    def select(
        self,
        request: Sequence[int] | RequestKey,
        loads: Mapping[WorkerId, float] | None = None,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MMFeature] | None = None,
        prompt_embeds: PromptEmbeds | None = None,
    ) -> WorkerId:
        """The cheapest worker for the request; ties go to the smallest worker id.

        The same choice as ``score(...)[0].worker``, found without building a
        :class:`Candidate` per worker or sorting them (when some worker has the
        request's blocks pending in the overlay, it is ``score``'s answer).  Raises
        :class:`~kvevents.errors.ConfigError` when there is no worker at all.
        """
        tokens, key = _request_key(request, lora_name, cache_salt, mm_features, prompt_embeds)
        if self._pending_live() and self._pending_any(tokens, key):
            ranked = self.score(tokens if key is None else key, loads)
            if not ranked:
                raise ConfigError(_NO_WORKERS)
            return ranked[0].worker
        lay = self.index.layout()
        ordered, known = self._sorted_workers()
        best: WorkerId | None
        n, wts, lw = len(tokens), self.weights, self.load_weight
        ends = self._simple_ends(tokens, key, lay)
        if ends is not None and ends.hit.bit_count() * 8 >= lay.nslots:
            # one slot in eight or more has a match: priced from the walk's per-slot
            # ends, without a Match per worker
            tiers = (ends.gpu, ends.cpu, ends.storage)
            wids, costs = slot_costs(lay.pos_wids, tiers, n, loads, wts, lw)
            best = choose(wids, costs, ordered, known, n, loads, lw)
        elif ends is not None:  # (building the few matches costs less than pricing every slot)
            best = cheapest(assemble(lay, *ends), ordered, known, n, loads, wts, lw)
        else:
            matches = self._find(tokens, key, lay)
            if (
                self.index.stale_workers
                or not monotone(wts, lw)
                # the workers of a match are the index's when the layout is the one
                # ``known`` was made from (the same object); else (another thread changed
                # the index meanwhile) they are checked
                or (
                    matches
                    and self._workers_cache is not None
                    and self._workers_cache[0] is not lay
                    and not matches.keys() <= known
                )
            ):
                # stale workers to leave out, or unusual weights (a match may raise a
                # cost): rank every candidate
                ranked = self._rank(request, matches, loads)
                best = ranked[0].worker if ranked else None
            else:
                best = cheapest(matches, ordered, known, n, loads, wts, lw)
        if best is None:
            raise ConfigError(_NO_WORKERS)
        return best

    def _simple_ends(
        self, tokens: Sequence[int], key: RequestKey | None, lay: IndexLayout
    ) -> SlotEnds | None:
        """The walk's per-slot ends for :meth:`select`, when they are the whole answer
        and :func:`choose` may use them: every worker is served by the bitset walk (no
        hybrid, windowed or speculative one), no worker is stale, the weights are
        :func:`monotone` and the router's worker list was made from ``lay``.  Else None:
        :meth:`select` goes through :meth:`_find`."""
        n = len(tokens)
        cache = self._workers_cache
        if (
            n < 2
            or not lay.gpu_classes
            or lay.complex_workers
            or (key is not None and key.prompt_embeds is not None)
            or cache is None
            or cache[0] is not lay
            or self.index.stale_workers
            or not monotone(self.weights, self.load_weight)
        ):
            return None
        unit = lay.canonical
        keys = prompt_keys(tokens, unit) if key is None else request_keys(key, unit)
        if not keys:
            return None
        return simple_ends(keys, n, lay, self.index)

    def _rank(
        self,
        request: Sequence[int] | RequestKey,
        matches: Mapping[WorkerId, Match],
        loads: Mapping[WorkerId, float] | None,
        pending: Mapping[WorkerId, int] | None = None,
    ) -> list[Candidate]:
        workers = set(self.index.workers())
        if loads:
            workers.update(loads)
        workers -= self.index.stale_workers
        n = len(request.tokens if isinstance(request, RequestKey) else request)
        return rank(
            matches, workers, n, loads, self.weights, self.load_weight, pending, self.pending_weight
        )

    # ---------------------------------------------------------------- pending

    def reserve(
        self,
        request: Sequence[int] | RequestKey,
        worker: WorkerId,
        *,
        ttl_s: float | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MMFeature] | None = None,
    ) -> int | None:
        """Record that ``request`` was just routed to ``worker``: its content keys become
        pending there in the router's overlay (see
        :class:`~kvevents.consumers.router.pending.PendingOverlay`).  Returns the
        reservation id (for :meth:`PendingOverlay.finished`), or None without an
        overlay, for a request with prompt embeddings (their keys depend on the engine's
        block size) or shorter than one block, or one the overlay refused."""
        if self.pending is None:
            return None
        keys = self.request_keys(
            request, lora_name=lora_name, cache_salt=cache_salt, mm_features=mm_features
        )
        if not keys:
            return None
        return self.pending.reserve(worker, keys, ttl_s=ttl_s)

    def request_keys(
        self,
        request: Sequence[int] | RequestKey,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MMFeature] | None = None,
    ) -> list[int]:
        """The request's chained content keys at the index's canonical block size (what
        the index and the overlay key blocks by); empty with prompt embeddings.  Reads
        no index state (no lock needed)."""
        tokens, key = _request_key(request, lora_name, cache_salt, mm_features, None)
        return _content_keys(tokens, key, self.index.canonical_block_size)

    def _pending_live(self) -> bool:
        """Whether pending reservations may change a cost."""
        ov = self.pending
        return ov is not None and self.pending_weight > 0 and len(ov) > 0

    def _pending_any(self, tokens: Sequence[int], key: RequestKey | None) -> bool:
        """Whether some worker holds the request's first block pending (the overlay
        swept first)."""
        ov = self.pending
        assert ov is not None
        ov.sweep(self.index)
        unit = self.index.layout().canonical
        head = tokens[:unit] if key is None else key.tokens[:unit]
        if len(head) < unit:
            return False
        if key is None:
            first = prompt_keys(head, unit)
        elif key.prompt_embeds is not None:
            return False
        else:
            first = _content_keys(head, _head_key(key, unit), unit)
        return bool(first) and bool(ov.pending_runs(first))

    def _pending(
        self,
        tokens: Sequence[int],
        key: RequestKey | None,
        lay: IndexLayout,
        matches: Mapping[WorkerId, Match],
    ) -> dict[WorkerId, int]:
        """Per worker, the request's tokens pending beyond its match (the overlay swept
        first); empty without an overlay or at weight 0."""
        ov = self.pending
        if ov is None or self.pending_weight <= 0 or not len(ov):
            return {}
        ov.sweep(self.index)
        if not len(ov):
            return {}
        keys = _content_keys(tokens, key, lay.canonical)
        confirmed = {wid: m.total for wid, m in matches.items()}
        return ov.pending_tokens(keys, len(tokens), lay.canonical, confirmed)

    def _sorted_workers(self) -> tuple[list[WorkerId], set[WorkerId]]:
        """The index's workers, sorted, and a container to test membership (cached).

        The cache is keyed on the index's layout object (replaced whenever a worker is
        removed or gains a group) and its worker count (a worker is only ever added).
        """
        index = self.index
        lay = index.layout()
        count = index.num_workers()
        cached = self._workers_cache
        if cached is not None and cached[0] is lay and cached[1] == count:
            return cached[2], cached[3]
        ordered = index.workers()
        known = set(ordered)
        self._workers_cache = (lay, count, ordered, known)
        return ordered, known


def _head_key(key: RequestKey, unit: int) -> RequestKey:
    """``key`` cut to its first ``unit`` tokens (the multimodal inputs that start there)."""
    feats = tuple(f for f in key.mm_features if f.offset < unit)
    return RequestKey(key.tokens[:unit], key.lora_name, key.cache_salt, feats, None)


def _content_keys(tokens: Sequence[int], key: RequestKey | None, unit: int) -> list[int]:
    """The chained content keys of a request (empty with prompt embeddings)."""
    if key is None:
        return prompt_keys(tokens, unit)
    if key.prompt_embeds is not None:
        return []
    return request_keys(key, unit)


def _request_key(
    request: Sequence[int] | RequestKey,
    lora_name: str | None,
    cache_salt: str | None,
    mm_features: Sequence[MMFeature] | None,
    prompt_embeds: PromptEmbeds | None,
) -> tuple[Sequence[int], RequestKey | None]:
    """The request's tokens, and the request as a RequestKey (None for plain tokens, the
    fast and common case)."""
    extras = (
        lora_name is not None
        or cache_salt is not None
        or bool(mm_features)
        or prompt_embeds is not None
    )
    if isinstance(request, RequestKey):
        if extras:
            raise ConfigError("pass either a RequestKey or tokens with keyword arguments")
        return request.tokens, (request if request.has_extras else None)
    if not extras:
        return request, None
    return request, RequestKey(request, lora_name, cache_salt, mm_features or (), prompt_embeds)
