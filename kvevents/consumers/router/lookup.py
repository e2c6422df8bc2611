"""One request looked up on workers one at a time, by vLLM's own lookup rules.

This is the lookup for the workers the bitset walk does not serve (several KV-cache
groups, sliding-window or chunked-local attention, speculative lookahead, EAGLE):

* GPU: ``KVCacheManager.get_computed_blocks`` and the coordinators'
  ``find_longest_cache_hit`` (hits aligned to the lcm of the block sizes; full-attention,
  sliding-window and chunked-local groups each judged as their manager judges them,
  until all agree); EAGLE's drop of the last block; lookahead hashing;
* CPU / STORAGE: the offload connector's ``_lookup_complete_chunks`` (a running bound
  tightened group by group, full attention first; windowed groups checked again when a
  later group lowers the bound).

Full-attention groups without lookahead take their GPU prefix from the one walk
(:func:`~kvevents.consumers.router.walk.full_prefix`) when it is given.

:func:`lookup_matches` looks one request up on many plans.  The compiled core's
``kvevents_native.Lookups`` (:func:`compiled_lookups`: plans bound once, no lookahead)
does the same per request over the tiers' ``SlotMarks``; :func:`lookup_matches` and
:class:`WorkerLookup` are what it is tested against answer for answer (tests/native).

May import: :mod:`kvevents.consumers.content`, :mod:`kvevents.consumers.index`,
:mod:`kvevents.native` (the compiled core, when it runs), :mod:`kvevents.request`, and the
router's :mod:`~kvevents.consumers.router.match`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any

from kvevents.consumers.content import lookahead_key, request_keys
from kvevents.consumers.index import BlockIndex, LookupPlan, SpecGroup, WorkerId
from kvevents.consumers.router.match import Match
from kvevents.native import NATIVE
from kvevents.request import RequestKey

__all__ = ["WorkerLookup", "compiled_lookups", "lookup_matches", "native_marks"]


def lookup_matches(
    index: BlockIndex,
    key: RequestKey,
    keys: list[int],
    prefix: list[int] | None,
    plans: Iterable[LookupPlan],
    out: dict[WorkerId, Match],
) -> None:
    """``out[plan.wid]``: per plan not blocked, in order, its worker's :class:`Match`
    for the request by :class:`WorkerLookup` (arguments as there), when anything is
    reusable."""
    lookup = WorkerLookup(index, key, keys, prefix)
    for plan in plans:
        if plan.blocked is None:
            m = lookup.match(plan)
            if m.gpu or m.cpu or m.storage:
                out[plan.wid] = m


def compiled_lookups(plans: Sequence[LookupPlan]) -> Any | None:
    """The compiled core's ``Lookups`` of ``plans`` (blocked ones left out), or None when
    the core does not run, or a plan not blocked hashes lookahead tokens.

    Its ``matches(marks0, marks1, marks2, keys, n, unit, prefix, out)`` writes what
    :func:`lookup_matches` writes for a request of ``n`` tokens whose unit keys
    (``unit`` tokens each, not empty) are ``keys``, the three arguments before them
    being the index's tier marks (``kvevents_native.SlotMarks``)."""
    if NATIVE is None or any(p.lookahead for p in plans if p.blocked is None):
        return None
    return NATIVE.Lookups(plans, Match)


def native_marks(marks: Sequence[object]) -> bool:
    """Whether every tier's marks are the compiled core's tables (what its ``Lookups``
    reads)."""
    return NATIVE is not None and all(type(m) is NATIVE.SlotMarks for m in marks)


class WorkerLookup:
    """One request looked up on workers one at a time, by vLLM's rules (module doc).

    ``keys`` are the request's unit keys, or empty when they depend on the block size
    (prompt embeddings); ``prefix`` is :func:`~kvevents.consumers.router.walk.full_prefix`'s
    answer for the same request, or None to scan each worker's blocks itself.
    :meth:`match` gives one worker's :class:`Match` from its plan.
    """

    def __init__(
        self,
        index: BlockIndex,
        key: RequestKey,
        keys: list[int],
        prefix: list[int] | None = None,
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
        """By slot + 1, the tokens its GPU blocks hold from token 0 (full-attention slots
        of workers without lookahead, from one walk over all of them), if computed."""

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
                c = min(nb, min(prefix[s + 1] for s in sg.slots) // size)
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
