"""The prefix walk: one pass over a prompt's content keys for many workers at a time.

The index keeps, per tier, a bitset of *slots* (one per worker and KV-cache group) for
every content key (:meth:`BlockIndex.marks`).  :func:`walk` follows the prompt's keys at
one step size (an engine block or an offload chunk, in content-key units) and ANDs the
surviving slots with each key's bitset, so its cost grows with the matched length and
the number of distinct run ends, not with workers × length.  It is the only prefix walk
of the router:

* :func:`simple_ends` (and :func:`simple_matches`, its answer assembled) serves the
  workers with one full-attention group and no speculative mode: one walk per tier and
  step size (a uniform fleet: one engine block size and one chunk size, so one walk per
  tier), each walk handing the next tier where its slots start (:class:`WalkResult`);
* :func:`full_prefix` finds, with it, the GPU prefix of the full-attention groups of
  every other worker, which :class:`~kvevents.consumers.router.lookup.WorkerLookup`
  then judges one worker at a time by vLLM's hybrid rules.

The compiled core (``kvevents_native.walk``, ``kvevents_native.assembler``) does the
same walk and assembly; ``python_walk`` and ``python_assemble`` are this module's, which
the compiled ones are tested against answer for answer (tests/native).

May import: :mod:`kvevents.consumers.index` (the layout the walk reads,
:class:`~kvevents.consumers.index.IndexLayout`) and :mod:`kvevents.consumers.router.match`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from itertools import chain, compress, repeat
from operator import sub
from typing import NamedTuple

from kvevents.consumers.index import BlockIndex, IndexLayout, WorkerId
from kvevents.consumers.router.match import Match
from kvevents.native import NATIVE

__all__ = [
    "SlotClass",
    "SlotEnds",
    "WalkResult",
    "assemble",
    "full_prefix",
    "named_walk",
    "python_assemble",
    "python_walk",
    "simple_ends",
    "simple_matches",
    "walk",
]


class WalkResult(NamedTuple):
    """What one :func:`walk` hands to the walk of the next tier."""

    credited: int
    """Slots credited with a run of hits (a bit per slot): their ends were written."""
    next_starts: dict[int, int]
    """Unit position ``f`` -> the slots whose walk on the next tier joins at the key
    ending at unit ``f`` (the first chunk boundary after their run's end)."""
    next_aligned: int
    """Slots whose run ended exactly on a chunk boundary of their next-tier class."""


SlotClass = tuple[int, int]
"""``(units, slots)``: slots walked at one step size of ``units`` content-key units (an
engine block or an offload chunk), and their bits (:class:`IndexLayout`'s
``gpu_classes``, ``chunk_classes`` and ``complex_full_classes``; plain tuples there, as
the index snapshot carries its cached layout)."""

_NO_JOIN = (0, 0)  # after the last join: at walk position -step, never reached
_SENTINEL = (None,)  # a key held by nobody: every run still alive ends after the last key
_EMPTY: Mapping[int, int] = {}


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
    nxt: Sequence[SlotClass] = (),
) -> WalkResult:
    """Walk one step size's keys for many slots at once, recording where each run ends.

    The contract:

    * **Keys.** ``ks[i]`` is the content key ending at unit ``(i + 1) × step`` (``unit``
      tokens per content-key unit); ``get(key, 0)`` is the bitset of slots holding it.
    * **Joins.** Slots in ``first`` are checked from the first key; slots in
      ``starts[j]`` (``j`` a multiple of ``step``) join at the key ending at unit ``j``.
      A slot stays while it holds every key from its join on: its *run* of hits ends at
      its first miss (or after the last key).  One that misses the key it joins at has
      no run.
    * **Credit.** A run ending at unit ``e`` is credited unless its slot joined at ``e``
      (the run is the one chunk holding its base) and is not in ``aligned`` (its base is
      not on a chunk boundary, so that chunk adds less than a whole chunk beyond it).
    * **Ends.** A credited slot ``s`` gets ``end[s + 1] = e × unit`` tokens
      (``pos_bits[s + 1]`` is ``1 << s``); other entries are left as they are.
    * **Next tier.** ``nxt`` are the next tier's chunk classes (:data:`SlotClass`:
      units per chunk, slots): a credited slot of class ``(v, mask)`` starts the next
      tier at the first chunk boundary after ``e``, ``(e // v + 1) × v``, and is
      *aligned* there when ``e % v == 0``.

    Returns the :class:`WalkResult`: credited slots, next tier's starts and aligned
    slots.  The walk stops once no slot is alive and none is left to join.
    """
    joins = _joins(first, starts, step)
    if not joins:
        return WalkResult(0, {}, 0)
    runs: dict[int, int] = {}  # unit e -> the credited slots whose runs end at e
    credited = 0  # slots that joined with a hit, less those the credit rule took
    join_at, joining = joins.pop()
    join_at -= step  # (as a walk position: the units before the key ending at j)
    alive = 0  # slots whose run goes on to the current key
    e = 0  # units before the current key
    for k in chain(ks, _SENTINEL):
        held = get(k, 0)  # type: ignore[arg-type]
        kept = alive & held
        if kept != alive or e == join_at:  # (else nothing ends or joins here)
            ended = alive ^ kept  # these slots' runs end at e
            if e == join_at:
                joined = joining & held  # a slot missing its join key has no run
                kept |= joined
                credited |= joined
                join_at, joining = joins.pop() if joins else _NO_JOIN
                join_at -= step
            alive = kept
            late = starts.get(e) if starts and ended else None
            if late:  # the credit rule: joined at e with an unaligned base: no credit
                lost = ended & late & ~aligned
                credited &= ~lost
                ended &= ~lost
            if ended:
                runs[e] = ended
            if not alive and join_at < 0:
                break
        e += step
    _write_ends(runs, end, unit, pos_bits)
    return WalkResult(credited, *_next_tier(runs, nxt))


def _joins(first: int, starts: Mapping[int, int], step: int) -> list[tuple[int, int]]:
    """The walk's joins as ``(j, slots)``, last first (to pop): the slots of ``starts[j]``
    join at the key ending at unit ``j``, those of ``first`` at the first key (``step``)."""
    at = dict(starts)
    if first:
        at[step] = at.get(step, 0) | first
    return sorted(at.items(), reverse=True)


def _write_ends(runs: dict[int, int], end: list[int], unit: int, pos_bits: Sequence[int]) -> None:
    """Each credited slot's end: ``end[s + 1] = e × unit`` for the runs ending at ``e``."""
    for e, slots in runs.items():
        tokens = e * unit
        while slots:  # one slot per bit, highest first (the int shrinks)
            p = slots.bit_length()
            end[p] = tokens
            slots ^= pos_bits[p]


def _next_tier(runs: dict[int, int], nxt: Sequence[SlotClass]) -> tuple[dict[int, int], int]:
    """Where the credited slots start on the next tier: per chunk class ``(v, mask)``,
    a run ending at ``e`` starts at ``(e // v + 1) × v``, aligned when ``e % v == 0``."""
    starts: dict[int, int] = {}
    aligned = 0
    for v, mask in nxt:
        for e, slots in runs.items():
            cls = slots & mask
            if cls:
                f = (e // v + 1) * v
                starts[f] = starts.get(f, 0) | cls
                if not e % v:
                    aligned |= cls
    return starts, aligned


python_walk = walk
"""The walk above, which the compiled core's walk is tested against (tests/native)."""


class SlotEnds(NamedTuple):
    """What the walks found for the simple workers' slots, for :func:`assemble`.

    Each tier's list is indexed by slot + 1 and holds, in tokens, where that slot's hit
    on the tier ends (counted from token 0: it includes the tiers before); None: the
    tier adds nothing to any slot (its ends are the previous tier's)."""

    gpu: list[int]
    cpu: list[int] | None
    storage: list[int] | None
    hit: int
    """The slots with a non-zero end (a bit per slot)."""


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
    chunk: Sequence[SlotClass] = lay.chunk_classes
    if not (index.marks(1) or index.marks(2)):
        chunk = ()  # no chunk tier holds anything: the GPU walk need not find its starts
    gpu = _gpu_walks(keys, n, lay, index, chunk)
    if not chunk:
        return SlotEnds(gpu.end, None, None, gpu.hit)
    cpu = _chunk_walks(keys, lay, index, 1, chunk, gpu)
    storage = _chunk_walks(keys, lay, index, 2, chunk, cpu)
    return SlotEnds(gpu.end, cpu.added, storage.added, storage.hit)


class _TierEnds(NamedTuple):
    """One tier's walks for the simple slots, and what the next tier starts from."""

    end: list[int]
    """Per slot + 1: tokens held on this tier and the ones before, from token 0."""
    added: list[int] | None
    """``end`` when this tier was walked, None when it holds nothing."""
    hit: int
    """Slots with a non-zero end so far."""
    starts: list[dict[int, int]]
    """Per chunk class (as ``lay.chunk_classes``): the next tier's starts."""
    aligned: int
    """Slots whose end so far is a whole number of chunks."""


def _gpu_walks(
    keys: list[int], n: int, lay: IndexLayout, index: BlockIndex, chunk: Sequence[SlotClass]
) -> _TierEnds:
    """The GPU tier: one walk per engine block size, every slot from the first block."""
    unit = lay.canonical
    gkeys = keys[: (n - 1) // unit]
    end = [0] * (lay.nslots + 1)
    get = index.marks(0).get
    starts: dict[int, int] = {}
    hit = aligned = 0
    for u, slots in lay.gpu_classes:
        nxt = [c for c in chunk if c[1] & slots] if len(chunk) > 1 else chunk
        got = walk(gkeys[u - 1 :: u], get, u, unit, slots, _EMPTY, 0, end, lay.pos_bits, nxt)
        hit |= got.credited
        aligned |= got.next_aligned
        if not starts:
            starts = got.next_starts
        else:
            for f, bits in got.next_starts.items():
                starts[f] = starts.get(f, 0) | bits
    if len(chunk) > 1:  # each class's walk starts only its own slots
        per_class = [{f: b & m for f, b in starts.items() if b & m} for _, m in chunk]
    else:
        per_class = [starts]
    return _TierEnds(end, end, hit, per_class, aligned)


def _chunk_walks(
    keys: list[int],
    lay: IndexLayout,
    index: BlockIndex,
    tier: int,
    chunk: Sequence[SlotClass],
    before: _TierEnds,
) -> _TierEnds:
    """A chunk tier (CPU, then STORAGE): one walk per chunk size.  Slots with a hit on
    an earlier tier join where ``before`` starts them; the others from the first chunk.
    For the CPU tier (when STORAGE holds anything), the STORAGE starts: after the CPU
    hit, or where the CPU walk started."""
    marks = index.marks(tier)
    if not marks:
        return before._replace(added=None)
    want_next = tier == 1 and bool(index.marks(2))
    end = before.end.copy()
    credited = 0
    next_starts: list[dict[int, int]] = []
    for (v, slots), starts in zip(chunk, before.starts):
        nxt = ((v, slots),) if want_next else ()
        got = walk(keys[v - 1 :: v], marks.get, v, lay.canonical, slots & ~before.hit,
                   starts, before.aligned, end, lay.pos_bits, nxt)  # fmt: skip
        credited |= got.credited
        if want_next:
            nst = got.next_starts
            for f, bits in starts.items():  # not credited here: the next tier starts there
                rest = bits & ~got.credited
                if rest:
                    nst[f] = nst.get(f, 0) | rest
            next_starts.append(nst)
    hit = before.hit | credited
    if not want_next:
        return _TierEnds(end, end, hit, [], before.aligned)
    # a CPU hit ends on a chunk boundary: its slots are aligned for the STORAGE walk
    return _TierEnds(end, end, hit, next_starts, before.aligned | credited)


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
    for u, slots in lay.complex_full_classes:
        walk(gkeys[u - 1 :: u], get, u, unit, slots, _EMPTY, 0, prefix, pos_bits)
    return prefix


_tuple_new = tuple.__new__


def assemble(
    lay: IndexLayout,
    gpu_end: list[int],
    cpu_end: list[int] | None,
    storage_end: list[int] | None,
    hit: int = -1,
) -> dict[WorkerId, Match]:
    """The answer from per-slot ends (:class:`SlotEnds`: tokens, indexed by slot + 1;
    ``None``: the tier adds nothing): per worker with a non-zero total, its Match, in
    slot order.

    ``hit`` (when known) covers every slot with a non-zero end: few of them are visited
    bit by bit, many are assembled by C loops over every position.
    """
    if hit >= 0 and hit.bit_count() * 8 < lay.nslots:
        return _assemble_few(lay, gpu_end, cpu_end, storage_end, hit)
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
    return dict(compress(zip(lay.pos_wids, matches), last))  # type: ignore[arg-type]


def _assemble_few(
    lay: IndexLayout,
    gpu_end: list[int],
    cpu_end: list[int] | None,
    storage_end: list[int] | None,
    hit: int,
) -> dict[WorkerId, Match]:
    """:func:`assemble` visiting only the slots of ``hit``, in slot order."""
    c_end = gpu_end if cpu_end is None else cpu_end
    s_end = c_end if storage_end is None else storage_end
    pos_bits = lay.pos_bits
    found = []
    while hit:
        p = hit.bit_length()
        found.append(p)
        hit ^= pos_bits[p]
    out: dict[WorkerId, Match] = {}
    pos_wids = lay.pos_wids
    for p in reversed(found):  # in slot order, as the C loops give them
        total = s_end[p]
        wid = pos_wids[p]
        if total and wid is not None:
            g = gpu_end[p]
            c = c_end[p]
            out[wid] = Match(g, c - g, total - c)
    return out


def named_walk(
    core_walk: Callable[..., tuple[int, dict[int, int], int]],
) -> Callable[..., WalkResult]:
    """The compiled core's walk (``kvevents_native.walk``: :func:`python_walk`'s
    arguments, its three results as a plain tuple) answering a :class:`WalkResult`."""

    def compiled_walk(*args: object) -> WalkResult:
        return WalkResult._make(core_walk(*args))

    return compiled_walk


python_assemble = assemble
"""The assembly above, which the compiled core's is tested against (tests/native)."""
if NATIVE is not None:  # the same walk and assembly, compiled
    walk = named_walk(NATIVE.walk)
    assemble = NATIVE.assembler(Match)
