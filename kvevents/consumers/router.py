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
its own (:class:`_Lookup`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, compress, islice, repeat
from operator import sub
from typing import NamedTuple

from kvevents.consumers.content import lookahead_key, prompt_keys, request_keys
from kvevents.consumers.index import BlockIndex, IndexLayout, LookupPlan, SpecGroup, WorkerId
from kvevents.errors import ConfigError
from kvevents.request import MMFeature, PromptEmbeds, RequestKey

__all__ = ["Candidate", "Match", "Router", "TierWeights"]


class Match(NamedTuple):
    """Prompt tokens a worker can reuse, per tier (``gpu`` first, then ``cpu``, ``storage``)."""

    gpu: int = 0
    cpu: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        """All reusable prompt tokens."""
        return self.gpu + self.cpu + self.storage


@dataclass(frozen=True)
class TierWeights:
    """How much a reused token of each tier is worth (1.0 = no prefill needed)."""

    gpu: float = 1.0
    cpu: float = 0.8
    storage: float = 0.5


@dataclass(frozen=True)
class Candidate:
    """A scored worker: lower ``cost`` is better."""

    worker: WorkerId
    match: Match
    load: float
    cost: float
    """Prompt tokens minus tier-weighted reused tokens, plus ``load_weight × load``."""


_ZERO = Match()


class Router:
    """Picks the worker that makes a prompt cheapest to prefill.

    ``cost(worker) = len(tokens) − (w_gpu·gpu + w_cpu·cpu + w_storage·storage)
    + load_weight · load``; ties go to the smallest :data:`WorkerId`.
    """

    def __init__(
        self,
        index: BlockIndex,
        weights: TierWeights | None = None,
        load_weight: float = 1.0,
    ) -> None:
        self.index = index
        self.weights = weights if weights is not None else TierWeights()
        self.load_weight = load_weight
        self._workers_cache: tuple[IndexLayout, int, list[WorkerId], set[WorkerId]] | None = None

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
        tokens, key = _request_key(request, lora_name, cache_salt, mm_features, prompt_embeds)
        n = len(tokens)
        index = self.index
        lay = index.layout()
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
            out = _simple_matches(keys, n, lay, index)
        workers = lay.complex_workers if keys else tuple(lay.plans)
        if workers:
            prefix: dict[int, int] | None = None
            if keys and lay.complex_full_classes:
                # the GPU prefix runs of every full-attention slot of these workers, in
                # one walk (units held from token 0, capped at the last token)
                prefix = {}
                gkeys = keys[: (n - 1) // unit]
                classes, mask = lay.complex_full_classes, lay.complex_full_mask
                for e, bits in _walk(gkeys, index.marks(0), classes, mask, {}):
                    while bits:
                        b = bits.bit_length() - 1
                        prefix[b] = e
                        bits ^= 1 << b
            rkey = key if key is not None else RequestKey(tokens)
            lookup = _Lookup(index, rkey, keys, prefix)
            for wid in workers:
                plan = lay.plans[wid]
                if plan.blocked is None:
                    m = lookup.match(plan)
                    if m.gpu or m.cpu or m.storage:
                        out[wid] = m
        return out

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
        matches = self.find_matches(
            request,
            lora_name=lora_name,
            cache_salt=cache_salt,
            mm_features=mm_features,
            prompt_embeds=prompt_embeds,
        )
        workers = set(self.index.workers())
        if loads:
            workers.update(loads)
        workers -= self.index.stale_workers
        n = len(request.tokens if isinstance(request, RequestKey) else request)
        wt = self.weights
        out = []
        for wid in workers:
            m = matches.get(wid, _ZERO)
            load = float(loads.get(wid, 0.0)) if loads else 0.0
            reused = wt.gpu * m.gpu + wt.cpu * m.cpu + wt.storage * m.storage
            out.append(Candidate(wid, m, load, n - reused + self.load_weight * load))
        out.sort(key=lambda c: (c.cost, c.worker))
        return out

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
        :class:`Candidate` per worker or sorting them.  Raises
        :class:`~kvevents.errors.ConfigError` when there is no worker at all.
        """
        matches = self.find_matches(
            request,
            lora_name=lora_name,
            cache_salt=cache_salt,
            mm_features=mm_features,
            prompt_embeds=prompt_embeds,
        )
        wt = self.weights
        if (
            min(wt.gpu, wt.cpu, wt.storage) < 0
            or not all(map(math.isfinite, (wt.gpu, wt.cpu, wt.storage, self.load_weight)))
            or self.index.stale_workers
        ):
            # Unusual weights (a match may raise a cost) or stale workers to leave out:
            # rank every candidate as score() does.
            return self._ranked_first(request, loads, lora_name, cache_salt, mm_features,
                                      prompt_embeds)  # fmt: skip
        n = len(request.tokens if isinstance(request, RequestKey) else request)
        lw = self.load_weight
        workers, known = self._sorted_workers()
        # Costs are the expressions ``score`` evaluates, in the same order, so equal
        # costs (and the worker-id tie break) come out exactly as there.  With weights
        # >= 0 a match never raises a cost, so a worker's cost without its match is an
        # upper bound: the best unmatched cost is the minimum over every candidate of
        # ``n - 0.0 + lw * load`` (C loops), and matched workers are then compared at
        # their true cost.
        best: tuple[float, WorkerId] | None = None
        zero = lw * 0.0
        if loads:
            # ``float(lw) * x == lw * x`` for an int ``lw`` too (int * float converts it)
            base = map((n - 0.0).__add__, map(float(lw).__mul__, map(float, loads.values())))
            best = _cheapest(list(base), loads)
            if not known <= loads.keys():
                for wid in workers:  # the first index worker without a load (load 0.0)
                    if wid not in loads:
                        best = min(best, (n - 0.0 + zero, wid))
                        break
        else:
            for wid in workers:  # the smallest worker without a match
                if wid not in matches:
                    best = (n - 0.0 + zero, wid)
                    break
        if matches:
            if not matches.keys() <= known:  # not expected: the index's own workers
                return self._ranked_first(request, loads, lora_name, cache_salt, mm_features,
                                          prompt_embeds)  # fmt: skip
            # each matched worker at its true cost, ``n - reused + lw * load``
            wg, wc, ws = wt.gpu, wt.cpu, wt.storage
            if loads:
                get = loads.get
                costs = [
                    n - (wg * g + wc * c + ws * st) + lw * float(get(wid, 0.0))
                    for wid, (g, c, st) in matches.items()
                ]
            else:
                costs = [n - (wg * g + wc * c + ws * st) + zero for g, c, st in matches.values()]
            matched = _cheapest(costs, matches)
            if best is None or matched < best:
                best = matched
        if best is None:
            raise ConfigError("no workers to route to: the index is empty and no loads given")
        return best[1]

    def _ranked_first(
        self,
        request: Sequence[int] | RequestKey,
        loads: Mapping[WorkerId, float] | None,
        lora_name: str | None,
        cache_salt: str | None,
        mm_features: Sequence[MMFeature] | None,
        prompt_embeds: PromptEmbeds | None,
    ) -> WorkerId:
        ranked = self.score(
            request,
            loads,
            lora_name=lora_name,
            cache_salt=cache_salt,
            mm_features=mm_features,
            prompt_embeds=prompt_embeds,
        )
        if not ranked:
            raise ConfigError("no workers to route to: the index is empty and no loads given")
        return ranked[0].worker

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


def _cheapest(costs: list[float], workers: Iterable[WorkerId]) -> tuple[float, WorkerId]:
    """``min(zip(costs, workers))`` (``workers`` aligned with ``costs``), in fewer steps:
    the least cost first (float comparisons only), then the least worker among those
    that have it."""
    least = min(costs)
    if least != least:  # NaN: compare as tuples, as ``score``'s sort would
        return min(zip(costs, workers))
    return least, min(compress(workers, map(least.__eq__, costs)))


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


class _Lookup:
    """One request looked up on workers one at a time, by vLLM's rules (module doc)."""

    def __init__(
        self,
        index: BlockIndex,
        key: RequestKey,
        keys: list[int],
        prefix: dict[int, int] | None = None,
    ) -> None:
        self.index = index
        self.key = key
        self.tokens = key.tokens
        self.n = len(key.tokens)
        self.unit = index.canonical_block_size
        self._keys = keys
        self._by_size: dict[int, list[int]] = {}
        self._vals: dict[tuple[int, int, int], list[int]] = {}
        self.marks = (index.marks(0), index.marks(1), index.marks(2))
        self.lookahead = 0
        self.prefix = prefix
        """Slot -> units its GPU blocks hold from token 0 (full-attention slots of
        workers without lookahead, from one walk over all of them), if computed."""

    def keys(self, block_size: int) -> list[int]:
        if self._keys:
            return self._keys
        ks = self._by_size.get(block_size)
        if ks is None:
            ks = self._by_size[block_size] = request_keys(self.key, self.unit, block_size)
        return ks

    def vals(self, tier: int, block_size: int) -> list[int]:
        """Per unit of the request, the bitset of slots marking the key ending there on
        ``tier`` (with the current lookahead; units whose lookahead tokens are not in
        the prompt are not hashed and absent)."""
        la = self.lookahead
        ck = (tier, 0 if self._keys else block_size, la)
        v = self._vals.get(ck)
        if v is None:
            ks = self.keys(block_size)
            get = self.marks[tier].get
            if not la:
                v = list(map(get, ks, repeat(0)))
            else:
                unit, toks, feats = self.unit, self.tokens, self.key.mm_features
                v = []
                for i, k in enumerate(ks):
                    end = (i + 1) * unit
                    if end + la > self.n:
                        break  # not hashed: its lookahead tokens are not in the prompt
                    mm = [
                        (f.identifier, f.offset - end) for f in feats if end <= f.offset < end + la
                    ]
                    v.append(get(lookahead_key(k, toks[end : end + la], mm), 0))
            self._vals[ck] = v
        return v

    def run(self, tier: int, bits: int, size: int, first: int, stop: int, span: int = 0) -> int:
        """How many consecutive blocks of ``size`` tokens (or chunks of ``span`` tokens),
        from index ``first`` up to ``stop``, every slot of ``bits`` holds."""
        v = self.vals(tier, size)
        step = (span or size) // self.unit
        stop = min(stop, len(v) // step)
        i = first
        idx = (first + 1) * step - 1
        while i < stop and v[idx] & bits == bits:
            i += 1
            idx += step
        return i - first

    def last_run(
        self,
        tier: int,
        bits: int,
        size: int,
        first: int,
        stop: int,
        need: int,
        align: int,
        span: int = 0,
    ) -> int:
        """Scanning blocks of ``size`` tokens (or chunks of ``span``) ``[first, stop)``
        from the right, the end index of the first run of ``need`` held ones whose right
        end is a multiple of ``align`` tokens (vLLM's sliding-window scans); -1 if none.
        ``self.tail`` gets the run still open when the scan reached ``first``."""
        v = self.vals(tier, size)
        span = span or size
        step = span // self.unit
        stop = min(stop, len(v) // step)
        run = 0
        i = stop - 1
        idx = stop * step - 1
        while i >= first:
            if v[idx] & bits == bits:
                if run or span == align or (i + 1) * span % align == 0:
                    run += 1
                    if run >= need:
                        self.tail = run
                        return i + run
            else:
                run = 0
            i -= 1
            idx -= step
        self.tail = run
        return -1

    tail = 0

    def match(self, plan: LookupPlan) -> Match:
        self.lookahead = plan.lookahead
        gpu = self.gpu_hit(plan)
        if not plan.bpc:
            return Match(gpu, 0, 0)
        cpu = self.chunk_hit(plan, gpu, 1) if self.marks[1] else 0
        storage = self.chunk_hit(plan, gpu + cpu, 2) if self.marks[2] else 0
        return Match(gpu, cpu, storage)

    # GPU: KVCacheManager.get_computed_blocks and the coordinators' find_longest_cache_hit

    def gpu_hit(self, plan: LookupPlan) -> int:
        cap = self.n - 1  # the last prompt token is always recomputed
        groups = plan.spec_groups
        if plan.unitary:
            sg = groups[0]
            return self.find(sg, cap, sg.block_size, plan.eagle)
        align = plan.align
        hit = cap
        found: dict[int, int] = {}  # full-attention spec group -> its hit
        verified: set[int] = set()
        simple_hybrid = len(groups) == 2 and groups[0].cls == "full"
        while True:
            curr = hit
            for i, sg in enumerate(groups):
                if sg.cls == "full" and i in found:
                    curr = min(curr, found[i])  # full attention is downward-closed
                    continue
                drop = plan.eagle and i not in verified
                max_len = min(curr + sg.block_size, cap) if drop else curr
                new = self.find(sg, max_len, align, drop)
                if drop:
                    verified.add(i)
                elif new < curr:
                    verified.clear()
                curr = new
                if sg.cls == "full":
                    found[i] = new
            if curr >= hit:
                break
            hit = curr
            if simple_hybrid:
                break
        return hit

    def find(self, sg: SpecGroup, max_len: int, align: int, drop: bool) -> int:
        """One spec group's hit in tokens, at most ``max_len``, a multiple of ``align``."""
        size = sg.block_size
        bits = sg.bits
        nb = max_len // size if max_len > 0 else 0
        if sg.cls == "full":
            prefix = self.prefix
            if prefix is not None and not self.lookahead:
                step = size // self.unit
                c = min(nb, min(prefix.get(s, 0) for s in sg.slots) // step)
            else:
                c = self.run(0, bits, size, 0, nb)
            if drop and c:
                c -= 1
            while size != align and c * size % align:
                c -= 1
            return c * size
        if sg.cls == "local":
            # blocks before the attention chunk holding max_len are outside every window
            first = (max_len // sg.window * sg.window if max_len > 0 else 0) // size
            return (first + self.run(0, bits, size, first, nb)) * size
        # sliding window: the window's blocks at the hit end, searched from the right
        need = max(1, -(-(sg.window - 1) // size) + (1 if drop else 0))
        hit = self.last_run(0, bits, size, 0, nb, need, align)
        if hit < 0:
            hit = self.tail  # the run reaching block 0, if it started on an aligned end
            while size != align and hit * size % align:
                hit -= 1
        if drop and hit:
            hit -= 1
        return hit * size

    # CPU / STORAGE: the offload connector's _lookup_complete_chunks

    def chunk_hit(self, plan: LookupPlan, base: int, tier: int) -> int:
        """Tokens ``tier`` adds after ``base``: a running bound tightened group by group
        in the offload lookup order; nothing as soon as less than one chunk remains.
        When a group lowers the bound after a windowed group of the same pass, the
        windowed groups are checked again at the lower bound, until it is stable."""
        n = self.n
        bound = n - 1 if plan.windowed else n
        hashed = n - plan.lookahead
        eagle = plan.eagle
        groups = plan.chunk_groups
        hit = 0
        while groups:
            todo, groups = groups, ()
            windowed = False  # a windowed group was looked up in this pass
            for cls, size, wchunks, bit in todo:
                tpc = plan.bpc * size
                nkeys = hashed // tpc if hashed > 0 else 0
                bound = min(bound, nkeys * tpc)
                if bound - base < tpc:
                    return 0
                query = bound
                if eagle and cls != "full":
                    # an EAGLE window group looks one chunk further, then drops it
                    query = min(bound + tpc, nkeys * tpc)
                    wchunks += 1
                nb = min(-(-query // tpc), nkeys)
                start = base // tpc
                if cls == "full":
                    hits = self.run(tier, bit, size, start, nb, tpc)
                else:
                    end = self.last_run(tier, bit, size, start, nb, wchunks, tpc, tpc)
                    hits = end - start if end >= 0 else self.tail
                if hits <= 0:
                    return 0
                if eagle:
                    hits -= 1  # EAGLE drops the last hit chunk
                bound = min(bound, tpc * (start + hits))
                new = bound - base
                if new < tpc:
                    return 0
                if new < hit and windowed and not groups:
                    # a window found earlier may stick out past the new bound
                    groups = tuple(g for g in plan.chunk_groups if g[0] != "full")
                windowed = windowed or cls != "full"
                hit = new
            # every group is an EAGLE group and each dropped its chunk once: the
            # checks again neither look further nor drop
            eagle = False
        return hit


def _simple_matches(
    keys: list[int], n: int, lay: IndexLayout, index: BlockIndex
) -> dict[WorkerId, Match]:
    """find_matches for the workers with one full-attention group and no speculative mode.

    ``keys`` are the request's unit keys; the GPU walk sees only those of the first
    ``n − 1`` tokens (vLLM never reuses the last prompt token), the chunk tiers all.
    """
    unit = lay.canonical
    gkeys = keys[: (n - 1) // unit]
    if len(lay.gpu_classes) == 1 and len(lay.chunk_classes) <= 1:
        return _uniform_matches(gkeys, keys, lay, index)
    # Results per slot, in tokens.  Each walk reports its hits as runs (end, slots); the
    # next tier's start positions and the "whole chunk beyond the base" rule are applied
    # to those runs as whole bitsets, so the per-slot Python work is one bit extraction
    # per tier hit plus the C-level assembly of the answer.
    gpu_end = [0] * (lay.nslots + 1)  # indexed by slot + 1
    runs = _walk(gkeys, index.marks(0), lay.gpu_classes, lay.gpu_mask, {})
    starts: dict[int, int] = {}
    aligned = _gpu_runs(runs, lay, gpu_end, starts)
    hit = 0
    for _, bits in runs:
        hit |= bits
    if not lay.chunk_classes:
        return _assemble(lay, gpu_end, None, None, hit)
    tier_ends: list[list[int] | None] = [gpu_end, None, None]
    base_end = gpu_end
    for tier in (1, 2):
        marks = index.marks(tier)
        if not marks:
            continue
        late = sum(starts.values())  # disjoint slot sets: the sum is the union
        runs = _walk(keys, marks, lay.chunk_classes, lay.chunk_mask & ~late, starts)
        end = base_end.copy()
        credited = _chunk_runs(runs, lay, starts, aligned, end)
        hit |= credited
        tier_ends[tier] = base_end = end
        if tier == 1 and index.marks(2):
            # STORAGE starts after the CPU hit, or where the CPU walk started
            nxt: dict[int, int] = {}
            for first, bits in starts.items():
                rest = bits & ~credited
                if rest:
                    nxt[first] = rest
            for e, bits in runs:
                got = bits & credited
                if got:
                    for v, mask in lay.chunk_classes:
                        b = got & mask
                        if b:
                            nxt[e + v] = nxt.get(e + v, 0) | b
            starts = nxt
            aligned |= credited
    return _assemble(lay, gpu_end, tier_ends[1], tier_ends[2], hit)


_tuple_new = tuple.__new__


def _uniform_matches(
    gkeys: list[int], keys: list[int], lay: IndexLayout, index: BlockIndex
) -> dict[WorkerId, Match]:
    """_simple_matches for the usual fleet: one engine block size, at most one chunk size.
    The same rules as the general path, with each walk fused with the recording of its
    runs.  ``gkeys`` are the unit keys the GPU walk may use, ``keys`` all of them."""
    unit = lay.canonical
    (u, gmask), *_ = lay.gpu_classes
    v, cmask = lay.chunk_classes[0] if lay.chunk_classes else (0, 0)
    pos_bits = lay.pos_bits
    gpu_end = [0] * (lay.nslots + 1)  # tokens, indexed by slot + 1
    get = index.marks(0).get
    ks = gkeys[u - 1 :: u]
    first_hit = alive = gmask & get(ks[0], 0) if ks else 0
    starts: dict[int, int] = {}  # unit position -> slots whose CPU walk starts there
    aligned = 0  # slots whose GPU end is a whole number of chunks
    part = bool(gmask & ~cmask)  # some slots have no chunk size (yet)
    first = v  # the chunk boundary after the current run end
    pend = 0  # slots whose CPU walk starts at ``first``
    e = u
    # the None sentinel misses for everyone: survivors end at the last whole block
    for k in chain(islice(ks, 1, None), (None,)) if alive else ():
        now = alive & get(k, 0)  # type: ignore[arg-type]
        if now != alive:
            b = alive ^ now  # these slots' run of hits ends at e
            alive = now
            if v:
                cb = b & cmask if part else b
                if e >= first:
                    if pend:
                        starts[first] = pend
                        pend = 0
                    first = (e // v + 1) * v
                pend |= cb
                if e == first - v:
                    aligned |= cb
            tokens = e * unit
            while b:  # one slot per bit, highest first
                p = b.bit_length()
                gpu_end[p] = tokens
                b ^= pos_bits[p]
            if not now:
                break
        e += u
    if pend:
        starts[first] = pend
    if not v:
        return _assemble(lay, gpu_end, None, None, first_hit)
    ends: list[list[int] | None] = [gpu_end, None, None]
    base = gpu_end
    # slots with a GPU hit start their CPU walk late; the others at the first chunk
    late = first_hit & cmask
    want_next = bool(index.marks(2))
    hit = first_hit
    for tier in (1, 2):
        marks = index.marks(tier)
        if not marks:
            continue
        end = base.copy()
        credited, nxt = _uniform_chunk_walk(
            keys[v - 1 :: v], marks, v, unit, cmask & ~late, starts, aligned, end, pos_bits,
            want_next and tier == 1,
        )  # fmt: skip
        ends[tier] = base = end
        hit |= credited
        if tier == 1 and want_next:
            # STORAGE starts after the CPU hit, or where the CPU walk started
            for f, bits in starts.items():
                rest = bits & ~credited
                if rest:
                    nxt[f] = nxt.get(f, 0) | rest
            starts = nxt
            late = sum(nxt.values())  # disjoint slot sets: the sum is the union
            aligned |= credited
    return _assemble(lay, gpu_end, ends[1], ends[2], hit)


def _uniform_chunk_walk(
    ks: list[int],
    marks: Mapping[int, int],
    v: int,
    unit: int,
    alive: int,
    starts: dict[int, int],
    aligned: int,
    end: list[int],
    pos_bits: list[int],
    want_next: bool,
) -> tuple[int, dict[int, int]]:
    """One chunk tier of :func:`_uniform_matches` over the chunk keys ``ks``.

    Slots in ``alive`` start at the first chunk, those in ``starts[j]`` at unit ``j``.
    A slot is credited when its run adds a whole chunk beyond its base: it started at
    the first chunk, or its base is chunk-aligned (``aligned``), or its run goes past
    the chunk where it started.  Credited slots get ``end[slot + 1]`` (tokens).  Returns
    the credited slots and, with ``want_next``, where they start the next tier.
    """
    get = marks.get
    sget = starts.get
    last_start = max(starts, default=0)
    credited = 0
    nxt: dict[int, int] = {}
    j = 0
    for k in chain(ks, (None,)):
        j += v
        new = sget(j, 0)
        if new:
            alive |= new
        elif not alive:
            if j >= last_start:
                break
            continue
        if j == v:
            new = alive  # the first chunk: nobody has a hit yet
        now = alive & get(k, 0)  # type: ignore[arg-type]
        if now != alive:
            b = alive ^ now
            alive = now
            if new:
                b &= ~new  # joined here and missed at once: no hit
            e = j - v
            st = sget(e)
            if st:
                b &= ~(st & ~aligned)  # started at e with an unaligned base: < 1 chunk
            if b:
                credited |= b
                if want_next:
                    nxt[j] = b
                tokens = e * unit
                while b:
                    p = b.bit_length()
                    end[p] = tokens
                    b ^= pos_bits[p]
    return credited, nxt


def _gpu_runs(
    runs: list[tuple[int, int]],
    lay: IndexLayout,
    gpu_end: list[int],
    starts: dict[int, int],
) -> int:
    """Record GPU runs: slots' ends in ``gpu_end`` (tokens, indexed by slot + 1); fill
    ``starts`` (unit position → slots whose CPU walk starts there).  Returns the slots
    whose GPU end is a whole number of chunks."""
    unit = lay.canonical
    chunk_classes = lay.chunk_classes
    pos_bits = lay.pos_bits
    aligned = 0
    for e, b in runs:
        for v, mask in chunk_classes:
            cb = b & mask
            if cb:
                first = (e // v + 1) * v
                starts[first] = starts.get(first, 0) | cb
                if not e % v:
                    aligned |= cb
        tokens = e * unit
        while b:  # one slot per bit, highest first
            p = b.bit_length()
            gpu_end[p] = tokens
            b ^= pos_bits[p]
    return aligned


def _chunk_runs(
    runs: list[tuple[int, int]],
    lay: IndexLayout,
    starts: dict[int, int],
    aligned: int,
    end: list[int],
) -> int:
    """Record a chunk tier's runs.  A slot is credited when its run adds at least one
    whole chunk beyond its base: always if it started at the first chunk, or if its base
    was chunk-aligned, or if its run goes past the chunk where it started.  Credited
    slots get ``end[slot + 1]`` (tokens).  Returns the credited slots."""
    unit = lay.canonical
    pos_bits = lay.pos_bits
    credited = 0
    for e, b in runs:
        st = starts.get(e)
        if st:
            b &= ~(st & ~aligned)  # started at e with an unaligned base: < 1 chunk
        if b:
            credited |= b
            tokens = e * unit
            while b:
                p = b.bit_length()
                end[p] = tokens
                b ^= pos_bits[p]
    return credited


def _assemble(
    lay: IndexLayout,
    gpu_end: list[int],
    cpu_end: list[int] | None,
    storage_end: list[int] | None,
    hit: int = -1,
) -> dict[WorkerId, Match]:
    """The answer: per worker with a non-zero total, its Match.

    ``hit`` (when known) covers every slot with a non-zero end: few of them are visited
    bit by bit, many are assembled by C loops over every position.
    """
    out: dict[WorkerId, Match]
    if hit >= 0 and hit.bit_count() * 8 < lay.nslots:
        c_end = gpu_end if cpu_end is None else cpu_end
        s_end = c_end if storage_end is None else storage_end
        pos_bits = lay.pos_bits
        found = []
        while hit:
            p = hit.bit_length()
            found.append(p)
            hit ^= pos_bits[p]
        out = {}
        pos_wids = lay.pos_wids
        for p in reversed(found):  # in slot order, as the C loops give them
            total = s_end[p]
            wid = pos_wids[p]
            if total and wid is not None:
                g = gpu_end[p]
                c = c_end[p]
                out[wid] = Match(g, c - g, total - c)
    else:
        last = gpu_end
        if cpu_end is None:
            cpu: Iterable[int] = repeat(0)
        else:
            cpu = map(sub, cpu_end, gpu_end)
            last = cpu_end
        if storage_end is None:
            storage: Iterable[int] = repeat(0)
        else:
            storage = map(sub, storage_end, last)
            last = storage_end
        matches = map(_tuple_new, repeat(Match), zip(gpu_end, cpu, storage))
        # positions without a simple worker (None) have all-zero ends and are dropped
        out = dict(compress(zip(lay.pos_wids, matches), last))  # type: ignore[arg-type]
    return out


def _walk(
    keys: list[int],
    marks: Mapping[int, int],
    classes: list[tuple[int, int]],
    alive: int,
    starts: dict[int, int],
) -> list[tuple[int, int]]:
    """Walk the prompt's unit keys once for many slots at a time.

    ``classes`` are (units per step, slot mask): a slot of step ``u`` is checked at every
    unit index ``j`` with ``j % u == 0``.  Slots in ``alive`` are checked from their first
    step; those in ``starts[j]`` join at ``j``.  A slot dies at its first miss.  Returns
    runs ``(end, slots)``: the slots with at least one hit whose run of hits ends at unit
    index ``end``, each slot in exactly one run.
    """
    n = len(keys)
    get = marks.get
    runs: list[tuple[int, int]] = []
    if len(classes) == 1:
        u, mask = classes[0]
        alive &= mask
        ks = keys[u - 1 :: u]
        if not starts:
            if not alive or not ks:
                return runs
            alive &= get(ks[0], 0)  # slots that miss the first step never had a hit
            e = u
            for k in islice(ks, 1, None):
                now = alive & get(k, 0)
                if now != alive:
                    runs.append((e, alive ^ now))
                    if not now:
                        return runs
                    alive = now
                e += u
            if alive:
                runs.append((e, alive))
            return runs
        pending = {j: b & mask for j, b in starts.items() if b & mask}
        j = 0
        for k in ks:
            j += u
            new = pending.pop(j, 0) if pending else 0
            if new:
                alive |= new
            elif not alive:
                if not pending:
                    break
                continue
            if j == u:
                new = alive  # the first step: nobody has a hit yet
            now = alive & get(k, 0)
            if now != alive:
                dead = alive ^ now
                if new:
                    dead &= ~new  # joined here and missed at once: no hit
                if dead:
                    runs.append((j - u, dead))
                alive = now
        if alive:
            runs.append((len(ks) * u, alive))
        return runs
    hits = 0
    pending_starts = dict(starts)
    steps = [u for u, _ in classes]
    masks = [m for _, m in classes]
    total = 0
    for m in masks:
        total |= m
    alive &= total
    step = 0
    for u in steps:
        step = math.gcd(step, u)
    # every class boundary and every start is a multiple of ``step``
    for j in range(step, n + 1, step):
        if pending_starts:
            s_mask = pending_starts.pop(j, 0)
            alive |= s_mask & total
        elif not alive:
            break
        if not alive:
            continue
        b = 0
        for u, m in zip(steps, masks):
            if j % u == 0:
                b |= m
        chk = alive & b
        if not chk:
            continue
        held = get(keys[j - 1], 0)
        dead = chk & ~held
        if dead:
            d = dead & hits
            if d:
                for u, m in zip(steps, masks):
                    dm = d & m
                    if dm:
                        runs.append((j - u, dm))
            alive ^= dead
        hits |= chk & held
    rest = alive & hits
    if rest:
        for u, m in zip(steps, masks):
            rm = rest & m
            if rm:
                runs.append(((n // u) * u, rm))
    return runs
