"""A literal model of what vLLM 0.33 reuses for a request, over plain token prefixes.

The model knows nothing of hashes, content keys or bitsets: a worker holds, per group and
tier, a set of token prefixes (the tokens a block or chunk ends with, lookahead tokens
included).  It follows vLLM's functions step by step:

* GPU: ``KVCacheManager.get_computed_blocks`` caps the hit at ``num_tokens - 1``;
  ``UnitaryKVCacheCoordinator`` (one group) or ``HybridKVCacheCoordinator`` (several:
  hits aligned to the lcm of the block sizes, full attention looked up first, every
  group re-checked until all agree) over ``FullAttentionManager``,
  ``SlidingWindowManager`` and ``ChunkedLocalAttentionManager.find_longest_cache_hit``;
* CPU and STORAGE: the offload connector's ``_lookup_complete_chunks`` (a running bound
  from the request length, one less with windowed groups; full-attention groups first;
  nothing once less than one of the current group's chunks remains; no lcm rounding;
  passes over the windowed groups again while a group lowers the bound after a windowed
  group of the same pass; in EAGLE mode every group is an EAGLE group, so only the first
  pass looks one chunk further and drops a chunk).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from kvevents.consumers.router import Match

Prefixes = dict[tuple[int, str], set[Any]]
"""(group, tier) -> token prefixes whose block (GPU) or chunk (CPU/STORAGE) is held."""


@dataclass(frozen=True)
class Group:
    size: int
    cls: str = "full"  # "full", "sw" or "local"
    window: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expected_match(
    groups: Sequence[Group],
    held: Prefixes,
    tokens: Sequence[int],
    bpc: int,
    *,
    eagle: bool = False,
    lookahead: int = 0,
    ident: Callable[[tuple[int, ...]], Hashable] | None = None,
) -> Match:
    """``ident`` maps a block's token prefix (lookahead tokens included) to what ``held``
    stores for it (default: the prefix itself), e.g. with the request's extra keys."""
    toks = tuple(tokens)
    n = len(toks)

    def has(gis: Sequence[int], tier: str, end: int) -> bool:
        # a block is hashed only once its lookahead tokens exist
        if end <= 0 or end + lookahead > n:
            return False
        prefix = toks[: end + lookahead]
        item = prefix if ident is None else ident(prefix)
        return all(item in held.get((g, tier), set()) for g in gis)

    def find(gis: Sequence[int], grp: Group, max_len: int, align: int, drop: bool) -> int:
        s = grp.size
        nb = max(0, max_len) // s
        if grp.cls == "full":  # FullAttentionManager
            blocks = []
            for i in range(nb):
                if not has(gis, "GPU", (i + 1) * s):
                    break
                blocks.append(i)
            if drop and blocks:
                blocks.pop()
            while s != align and len(blocks) * s % align:
                blocks.pop()
            return len(blocks) * s
        if grp.cls == "local":  # ChunkedLocalAttentionManager
            start = (max_len // grp.window) * grp.window if max_len > 0 else 0
            count = start // s
            for i in range(start // s, nb):
                if not has(gis, "GPU", (i + 1) * s):
                    break
                count += 1
            return count * s
        # SlidingWindowManager: search from the right for enough contiguous blocks
        need = _cdiv(grp.window - 1, s) + (1 if drop else 0)
        contiguous = 0
        result = None
        for i in reversed(range(nb)):
            if has(gis, "GPU", (i + 1) * s):
                if contiguous == 0 and s != align and (i + 1) * s % align:
                    continue
                contiguous += 1
                if contiguous >= need:
                    result = i + contiguous
                    break
            else:
                contiguous = 0
        if result is None:
            result = contiguous
            while s != align and result * s % align:
                result -= 1
        if drop and result:
            result -= 1
        return result * s

    max_hit = n - 1  # get_computed_blocks: the last token is always recomputed
    if len(groups) == 1:
        gpu = find([0], groups[0], max_hit, groups[0].size, eagle)
    else:
        # spec groups: identical specs are looked up together
        specs: list[tuple[Group, list[int]]] = []
        for gi, grp in enumerate(groups):
            for sg, members in specs:
                if sg == grp:
                    members.append(gi)
                    break
            else:
                specs.append((grp, [gi]))
        specs.sort(key=lambda x: x[0].cls != "full")
        align = math.lcm(*(g.size for g in groups))
        hit = max_hit
        done: dict[int, int] = {}
        verified: set[int] = set()
        while True:
            cur = hit
            for idx, (grp, members) in enumerate(specs):
                if grp.cls == "full" and idx in done:
                    cur = min(cur, done[idx])
                    continue
                drop = eagle and idx not in verified
                limit = min(cur + grp.size, max_hit) if drop else cur
                got = find(members, grp, limit, align, drop)
                if drop:
                    verified.add(idx)
                elif got < cur:
                    verified.clear()
                cur = got
                if grp.cls == "full":
                    done[idx] = got
            if cur >= hit:
                break
            hit = cur
            if len(specs) == 2 and specs[0][0].cls == "full":
                break
        gpu = hit

    def offloaded(base: int, tier: str) -> int:
        if not bpc:
            return 0
        windowed = any(g.cls != "full" for g in groups)
        bound = n - 1 if windowed else n
        order = [gi for gi, g in enumerate(groups) if g.cls == "full"]
        order += [gi for gi, g in enumerate(groups) if g.cls != "full"]
        windows = [gi for gi in order if groups[gi].cls != "full"]
        hit = 0
        # _lookup_complete_chunks' eagle_verified: each group drops its trailing chunk
        # once; it is cleared only when a non-EAGLE group lowers the bound, and in EAGLE
        # mode (nothing annotated) every group is an EAGLE group
        verified: set[int] = set()
        passes = order
        while passes:
            todo, passes = passes, []
            looked_window = False
            for gi in todo:
                grp = groups[gi]
                tpc = bpc * grp.size
                num_keys = max(0, n - lookahead) // tpc
                bound = min(bound, num_keys * tpc)
                if bound - base < tpc:
                    return 0
                unverified = eagle and gi not in verified
                query = bound
                need = _cdiv(grp.window, tpc) if grp.window else 0
                if unverified and grp.cls != "full":
                    query = min(bound + tpc, num_keys * tpc)
                    need += 1
                stop = min(_cdiv(query, tpc), num_keys)
                first = base // tpc
                chunks = list(range(first, stop))
                if grp.cls == "full":  # _maximal_prefix_lookup
                    hits = len(chunks)
                    for j, c in enumerate(chunks):
                        if not has([gi], tier, (c + 1) * tpc):
                            hits = j
                            break
                else:  # _sliding_window_lookup
                    run = 0
                    hits = None
                    for j in reversed(range(len(chunks))):
                        if has([gi], tier, (chunks[j] + 1) * tpc):
                            run += 1
                            if run == need:
                                hits = j + need
                                break
                        else:
                            run = 0
                    if hits is None:
                        hits = run
                if hits == 0:
                    return 0
                if unverified:
                    hits -= 1
                    verified.add(gi)
                bound = min(bound, tpc * (first + hits))
                new = bound - base
                if new < tpc:
                    return 0
                if new < hit and looked_window and not passes:
                    passes = list(windows)
                looked_window |= grp.cls != "full"
                hit = new
        return hit

    cpu = offloaded(gpu, "CPU")
    storage = offloaded(gpu + cpu, "STORAGE")
    return Match(gpu, cpu, storage)
