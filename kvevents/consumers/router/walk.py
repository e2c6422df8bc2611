"""The prefix walk: one pass over a prompt's content keys for many workers at a time.

The index keeps, per tier, a bitset of *slots* (one per worker and KV-cache group) for
every content key (:meth:`BlockIndex.marks`).  :func:`walk` follows the prompt's keys at
one step size (an engine block or an offload chunk, in content-key units) and ANDs the
surviving slots with each key's bitset, so its cost grows with the matched length and
the number of distinct run ends, not with workers × length.  It is the only prefix walk
of the router:

* :func:`simple_matches` answers the workers with one full-attention group and no
  speculative mode by calling it once per tier and step size (a uniform fleet: one
  engine block size and one chunk size, so one call per tier), each call handing the
  next tier where its slots start;
* :func:`full_prefix` finds, with it, the GPU prefix of the full-attention groups of
  every other worker, which :class:`~kvevents.consumers.router.lookup.WorkerLookup`
  then judges one worker at a time by vLLM's hybrid rules.

May import: :mod:`kvevents.consumers.index` (the layout the walk reads,
:class:`~kvevents.consumers.index.IndexLayout`) and :mod:`kvevents.consumers.router.match`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from itertools import chain, compress, repeat
from operator import sub

from kvevents.consumers.index import BlockIndex, IndexLayout, WorkerId
from kvevents.consumers.router.match import Match
from kvevents.native import NATIVE

__all__ = [
    "SlotEnds",
    "assemble",
    "full_prefix",
    "python_assemble",
    "python_walk",
    "simple_ends",
    "simple_matches",
    "walk",
]

_NO_JOIN = (0, 0)
_EMPTY: Mapping[int, int] = {}
_SENTINEL = (None,)  # a key held by nobody: the walk's survivors end after the last key


def walk(
    ks: Sequence[int],
    get: Callable[[int, int], int],
    step: int,
    unit: int,
    first: int,
    starts: Mapping[int, int],
    aligned: int,
    end: list[int],
    pos_bits: Sequence[int],
    nxt: Sequence[tuple[int, int]] = (),
) -> tuple[int, dict[int, int], int]:
    """Walk one step size's keys for many slots at once, recording where each run ends.

    ``ks[i]`` is the content key ending at unit ``(i + 1) * step`` (``unit`` tokens per
    content-key unit); ``get(key, 0)`` is the bitset of slots holding it.  Slots in
    ``first`` are checked from the first key; slots in ``starts[j]`` (``j`` a multiple of
    ``step``) join at the key ending at unit ``j``.  A slot dies at its first miss; one
    that misses the key it joins at has no hit.

    A slot whose run of hits ends at unit ``e`` is *credited* unless it joined at ``e``
    and is not in ``aligned`` (its run is the chunk holding its base, which adds less
    than one whole chunk beyond it).  A credited slot ``s`` gets ``end[s + 1] = e × unit``
    tokens (``pos_bits[s + 1]`` is ``1 << s``); other entries are left as they are.

    ``nxt`` are the next tier's chunk classes, ``(units per chunk, slot mask)``: a
    credited slot of class ``(v, mask)`` starts the next tier at the first chunk boundary
    after ``e``, ``(e // v + 1) × v``, and its base is aligned there when ``e % v == 0``.
    With one class (the usual fleet) the boundary is tracked as the walk goes, without
    a dict update per run.

    Returns ``(credited slots, next tier's starts, next tier's aligned slots)``.
    """
    nstarts: dict[int, int] = {}
    if starts:
        joins = sorted(starts.items())
        if first:
            if joins[0][0] == step:
                joins[0] = (step, joins[0][1] | first)
            else:
                joins.insert(0, (step, first))
    elif first:
        joins = [(step, first)]
    else:
        return 0, nstarts, 0
    it = iter(joins)
    nj, new = next(it)
    nj -= step  # walk position (units before the key) at which ``new`` joins
    check = bool(starts)  # the credit rule only concerns slots that join late
    sget = starts.get
    nv = nmask = 0
    many: Sequence[tuple[int, int]] = ()
    if len(nxt) == 1:
        ((nv, nmask),) = nxt
    else:
        many = nxt
    nfirst = nv  # the next tier's chunk boundary after the latest run end
    pend = 0  # credited slots that start the next tier at ``nfirst``
    naligned = 0
    alive = credited = 0
    e = 0  # units before the current key
    for k in chain(ks, _SENTINEL):
        now = alive & get(k, 0)  # type: ignore[arg-type]
        if now != alive or e == nj:
            b = alive ^ now  # these slots' run of hits ends at e
            if e == nj:
                got = new & get(k, 0)  # type: ignore[arg-type]
                now |= got
                credited |= got
                nj, new = next(it, _NO_JOIN)
                nj -= step
            alive = now
            if b:
                if check:
                    st = sget(e)
                    if st:
                        lost = b & st & ~aligned  # joined at e with an unaligned base
                        if lost:
                            credited ^= lost
                            b ^= lost
                if nv:
                    if e >= nfirst:
                        if pend:
                            nstarts[nfirst] = pend
                            pend = 0
                        nfirst = (e // nv + 1) * nv
                    cb = b & nmask
                    pend |= cb
                    if e == nfirst - nv:
                        naligned |= cb
                elif many:
                    for v, mask in many:
                        cb = b & mask
                        if cb:
                            f = (e // v + 1) * v
                            nstarts[f] = nstarts.get(f, 0) | cb
                            if not e % v:
                                naligned |= cb
                tokens = e * unit
                while b:  # one slot per bit, highest first (the int shrinks)
                    p = b.bit_length()
                    end[p] = tokens
                    b ^= pos_bits[p]
            if not alive and nj < 0:
                break
        e += step
    if pend:
        nstarts[nfirst] = pend
    return credited, nstarts, naligned


python_walk = walk
"""The walk above, which the compiled core's walk is tested against (tests/native)."""


SlotEnds = tuple[list[int], list[int] | None, list[int] | None, int]
"""Per-slot ends (tokens, indexed by slot + 1) of the GPU, CPU and STORAGE tiers (None: the
tier adds nothing), and the slots with a non-zero end (a bit per slot): what
:func:`assemble` turns into matches."""


def simple_matches(
    keys: list[int], n: int, lay: IndexLayout, index: BlockIndex
) -> dict[WorkerId, Match]:
    """Matches of the workers with one full-attention group and no speculative mode
    (:func:`simple_ends`, assembled)."""
    return assemble(lay, *simple_ends(keys, n, lay, index))


def simple_ends(keys: list[int], n: int, lay: IndexLayout, index: BlockIndex) -> SlotEnds:
    """Per-slot ends of the workers with one full-attention group and no speculative mode.

    ``keys`` are the request's unit keys (``n`` tokens); the GPU tier sees only those of
    the first ``n − 1`` tokens (vLLM never reuses the last prompt token), the chunk tiers
    all.  GPU: every slot from the first block.  CPU: a slot with a GPU hit from the
    chunk holding its GPU end, credited only for whole chunks beyond it; the others from
    the first chunk.  STORAGE: likewise from where the CPU hit ends, or where the CPU
    walk started.
    """
    unit = lay.canonical
    gkeys = keys[: (n - 1) // unit]
    pos_bits = lay.pos_bits
    chunk: Sequence[tuple[int, int]] = lay.chunk_classes
    gpu_end = [0] * (lay.nslots + 1)  # tokens, indexed by slot + 1
    get = index.marks(0).get
    starts: dict[int, int] = {}  # unit position -> slots whose CPU walk starts there
    aligned = 0  # slots whose GPU end is a whole number of chunks
    hit = 0  # slots with a non-zero end
    more = index.marks(2)
    if not (index.marks(1) or more):
        chunk = ()  # no chunk tier holds anything: the GPU walk need not find its starts
    for u, gmask in lay.gpu_classes:
        nxt: Sequence[tuple[int, int]] = chunk
        if len(chunk) > 1:
            nxt = [c for c in chunk if c[1] & gmask]
        got, st, al = walk(gkeys[u - 1 :: u], get, u, unit, gmask, _EMPTY, 0, gpu_end,
                           pos_bits, nxt)  # fmt: skip
        hit |= got
        aligned |= al
        if not starts:
            starts = st
        else:
            for f, bits in st.items():
                starts[f] = starts.get(f, 0) | bits
    if not chunk:
        return gpu_end, None, None, hit
    if len(chunk) == 1:
        by_class = [starts]
    else:
        by_class = [{f: b & m for f, b in starts.items() if b & m} for _, m in chunk]
    ends: list[list[int] | None] = [gpu_end, None, None]
    base = gpu_end
    for tier in (1, 2):
        marks = index.marks(tier)
        if not marks:
            continue
        want_next = tier == 1 and bool(more)
        end = base.copy()
        credited = 0
        for i, (v, cmask) in enumerate(chunk):
            st = by_class[i]
            # slots with a hit in an earlier tier start late (where ``st`` says); the
            # others at the first chunk
            nxt = ((v, cmask),) if want_next else ()
            got, nst, _ = walk(keys[v - 1 :: v], marks.get, v, unit, cmask & ~hit, st,
                               aligned, end, pos_bits, nxt)  # fmt: skip
            credited |= got
            if want_next:
                # STORAGE starts after the CPU hit, or where the CPU walk started
                for f, bits in st.items():
                    rest = bits & ~got
                    if rest:
                        nst[f] = nst.get(f, 0) | rest
                by_class[i] = nst
        hit |= credited
        if want_next:
            aligned |= credited  # a CPU hit ends on a chunk boundary
        ends[tier] = base = end
    return gpu_end, ends[1], ends[2], hit


@lru_cache(maxsize=8)
def _pos_bits(top: int) -> tuple[int, ...]:
    return (0, *(1 << s for s in range(top)))


def full_prefix(keys: list[int], n: int, lay: IndexLayout, index: BlockIndex) -> list[int]:
    """GPU prefix of every full-attention slot of the workers :func:`simple_matches` does
    not serve (those without lookahead), in tokens held from token 0 and capped at the
    last whole block before token ``n − 1``; indexed by slot + 1, zero when none."""
    unit = lay.canonical
    gkeys = keys[: (n - 1) // unit]
    top = lay.complex_full_mask.bit_length()
    prefix = [0] * (top + 1)
    pos_bits = _pos_bits(top)
    get = index.marks(0).get
    for u, mask in lay.complex_full_classes:
        walk(gkeys[u - 1 :: u], get, u, unit, mask, _EMPTY, 0, prefix, pos_bits)
    return prefix


_tuple_new = tuple.__new__


def assemble(
    lay: IndexLayout,
    gpu_end: list[int],
    cpu_end: list[int] | None,
    storage_end: list[int] | None,
    hit: int = -1,
) -> dict[WorkerId, Match]:
    """The answer from per-slot ends (tokens, indexed by slot + 1; ``None``: the tier
    adds nothing): per worker with a non-zero total, its Match, in slot order.

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


python_assemble = assemble
"""The assembly above, which the compiled core's is tested against (tests/native)."""
if NATIVE is not None:  # the same walk and assembly, compiled
    walk = NATIVE.walk
    assemble = NATIVE.assembler(Match)
