"""Differential test: BlockIndex + Router against a plain model of who holds what.

Random interleavings of GPU stores, GPU removals, CPU/STORAGE placeholder stores and
removals (before or after their GPU store), AllBlocksCleared and worker resets, across
workers with different block sizes and a hybrid worker with two full-attention groups.
After every step ``find_matches`` must agree with a model that knows nothing of hashes,
bitsets or content keys: it keeps, per worker, tier and group, a multiset of the
*token prefixes* each block (GPU) or chunk (CPU/STORAGE) ends, and applies vLLM's lookup
literally (tests/consumers/_vllm_model.py).
"""

from __future__ import annotations

from collections import Counter
from functools import cache

from _vllm_model import Group, expected_match
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvevents.consumers.index import BlockIndex
from kvevents.consumers.router import Match, Router
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.hashing import hash_request_blocks, to_wire_hash

BPC = 2
SEQ_LEN = 128
# Four sequences that share prefixes of 0, 48 and 96 tokens with sequence 0.
_BASE = list(range(1, SEQ_LEN + 1))
SEQS: list[tuple[int, ...]] = [
    tuple(_BASE),
    tuple(_BASE[:48] + [900 + i for i in range(SEQ_LEN - 48)]),
    tuple(_BASE[:96] + [700 + i for i in range(SEQ_LEN - 96)]),
    tuple(500 + i for i in range(SEQ_LEN)),
]
# worker -> [(group, block size)]; the hybrid worker's 32-token group keys the raw
# 16-token hash at its last boundary (C§4.1).
WORKERS: dict[tuple[str, int], list[tuple[int, int]]] = {
    ("e16", 0): [(0, 16)],
    ("e32", 0): [(0, 32)],
    ("hyb", 0): [(0, 16), (1, 32)],
}
WIDS = sorted(WORKERS)
TIERS = ("GPU", "CPU", "STORAGE")


@cache
def raw_hashes(seq: int) -> list[int]:
    return [to_wire_hash(d) for d in hash_request_blocks(SEQS[seq], 16, algo="sha256_cbor")]


def group_hashes(seq: int, size: int) -> list[int]:
    k = size // 16
    return raw_hashes(seq)[k - 1 :: k]


class Model:
    """Who holds which prefix on which tier; pending CPU stores; known metadata."""

    def __init__(self) -> None:
        self.held: dict[tuple[tuple[str, int], str, int], Counter[tuple[int, ...]]] = {}
        self.pending: Counter[tuple[tuple[str, int], str, int, tuple[int, ...]]] = Counter()
        self.known: set[tuple[tuple[str, int], int, tuple[int, ...]]] = set()
        # (worker, tier, group, prefix) -> the engine hash that names it
        self.hash_of: dict[tuple[tuple[str, int], str, int, tuple[int, ...]], int] = {}

    def held_items(self) -> list[tuple[tuple[str, int], str, int, tuple[int, ...]]]:
        return sorted(
            (w, tier, g, prefix)
            for (w, tier, g), c in self.held.items()
            for prefix, n in c.items()
            if n > 0
        )

    def counter(self, w: tuple[str, int], tier: str, g: int) -> Counter[tuple[int, ...]]:
        return self.held.setdefault((w, tier, g), Counter())

    def holds(self, w: tuple[str, int], tier: str, g: int, prefix: tuple[int, ...]) -> bool:
        return self.counter(w, tier, g)[prefix] > 0

    def expected(self, tokens: tuple[int, ...]) -> dict[tuple[str, int], Match]:
        """vLLM's rules worker by worker (tests/consumers/_vllm_model.py)."""
        out = {}
        for w, groups in WORKERS.items():
            held = {(g, tier): {p for p, c in self.counter(w, tier, g).items() if c > 0}
                    for g, _ in groups for tier in TIERS}  # fmt: skip
            m = expected_match([Group(s) for _, s in groups], held, tokens, BPC)
            if any(m):
                out[w] = m
        return out


class IndexVsModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex(blocks_per_chunk=BPC)
        self.router = Router(self.index)
        self.model = Model()

    def _apply(self, w: tuple[str, int], *events: object) -> None:
        self.index.apply(w[0], w[1], KVEventBatch(0.0, list(events)))  # type: ignore[arg-type]

    @rule(w=st.sampled_from(WIDS), seq=st.integers(0, 3), first=st.integers(0, 3),
          count=st.integers(1, 8))  # fmt: skip
    def gpu_store(self, w: tuple[str, int], seq: int, first: int, count: int) -> None:
        tokens = SEQS[seq]
        for g, s in WORKERS[w]:
            hs = group_hashes(seq, s)
            start = min(first, len(hs) - 1)
            # a store continues a prefix whose metadata the index has: else start at 0
            if start and (w, g, tokens[: start * s]) not in self.model.known:
                start = 0
            stop = min(len(hs), start + count)
            self._apply(w, BlockStored(hs[start:stop], hs[start - 1] if start else None,
                                       list(tokens[start * s : stop * s]), s, None, "GPU", None,
                                       group_idx=g, kv_cache_spec_kind="full_attention"))  # fmt: skip
            for i in range(start, stop):
                prefix = tokens[: (i + 1) * s]
                self.model.hash_of[(w, "GPU", g, prefix)] = hs[i]
                self.model.counter(w, "GPU", g)[prefix] += 1
                self.model.known.add((w, g, prefix))
                for tier in ("CPU", "STORAGE"):
                    waiting = self.model.pending.pop((w, tier, g, prefix), 0)
                    if waiting:
                        self.model.counter(w, tier, g)[prefix] += waiting

    @rule(w=st.sampled_from(WIDS), seq=st.integers(0, 3), block=st.integers(0, 7),
          gi=st.integers(0, 1))  # fmt: skip
    def gpu_remove(self, w: tuple[str, int], seq: int, block: int, gi: int) -> None:
        g, s = WORKERS[w][gi % len(WORKERS[w])]
        hs = group_hashes(seq, s)
        i = block % len(hs)
        self._apply(w, BlockRemoved([hs[i]], "GPU", group_idx=g))
        c = self.model.counter(w, "GPU", g)
        prefix = SEQS[seq][: (i + 1) * s]
        if c[prefix] > 0:
            c[prefix] -= 1

    @rule(w=st.sampled_from(WIDS), seq=st.integers(0, 3), chunk=st.integers(0, 3),
          gi=st.integers(0, 1), tier=st.sampled_from(["CPU", "STORAGE"]))  # fmt: skip
    def offload(self, w: tuple[str, int], seq: int, chunk: int, gi: int, tier: str) -> None:
        g, s = WORKERS[w][gi % len(WORKERS[w])]
        hs = group_hashes(seq, s)
        chunks = len(hs) // BPC
        c = chunk % chunks
        tail = hs[(c + 1) * BPC - 1]
        self._apply(w, BlockStored([tail], None, [], 0, None, tier, None, group_idx=g))
        prefix = SEQS[seq][: (c + 1) * BPC * s]
        self.model.hash_of[(w, tier, g, prefix)] = tail
        if (w, g, prefix) in self.model.known:
            self.model.counter(w, tier, g)[prefix] += 1
        else:
            self.model.pending[(w, tier, g, prefix)] += 1

    @rule(w=st.sampled_from(WIDS), seq=st.integers(0, 3), chunk=st.integers(0, 3),
          gi=st.integers(0, 1), tier=st.sampled_from(["CPU", "STORAGE"]))  # fmt: skip
    def offload_remove(self, w: tuple[str, int], seq: int, chunk: int, gi: int, tier: str) -> None:
        g, s = WORKERS[w][gi % len(WORKERS[w])]
        hs = group_hashes(seq, s)
        c = chunk % (len(hs) // BPC)
        self._apply(w, BlockRemoved([hs[(c + 1) * BPC - 1]], tier, group_idx=g))
        prefix = SEQS[seq][: (c + 1) * BPC * s]
        held = self.model.counter(w, tier, g)
        if held[prefix] > 0:
            held[prefix] -= 1
        elif self.model.pending[(w, tier, g, prefix)] > 0:
            self.model.pending[(w, tier, g, prefix)] -= 1

    @precondition(lambda self: bool(self.model.held_items()))
    @rule(data=st.data())
    def remove_held(self, data: st.DataObject) -> None:
        """Remove something the model says is held (duplicates make this interesting)."""
        w, tier, g, prefix = data.draw(st.sampled_from(self.model.held_items()))
        self._apply(w, BlockRemoved([self.model.hash_of[(w, tier, g, prefix)]], tier, group_idx=g))
        self.model.counter(w, tier, g)[prefix] -= 1

    @rule(w=st.sampled_from(WIDS))
    def clear(self, w: tuple[str, int]) -> None:
        self._apply(w, AllBlocksCleared())
        for tier in TIERS:
            for g, _ in WORKERS[w]:
                self.model.counter(w, tier, g).clear()
        for key in [k for k in self.model.pending if k[0] == w]:
            del self.model.pending[key]

    @rule(w=st.sampled_from(WIDS))
    def reset(self, w: tuple[str, int]) -> None:
        self.index.reset_worker(w)
        for tier in TIERS:
            for g, _ in WORKERS[w]:
                self.model.counter(w, tier, g).clear()
        for key in [k for k in self.model.pending if k[0] == w]:
            del self.model.pending[key]
        self.model.known = {k for k in self.model.known if k[0] != w}

    @invariant()
    def matches_agree(self) -> None:
        for seq in range(4):
            for n in (SEQ_LEN, 100, 64, 40):
                tokens = SEQS[seq][:n]
                assert self.router.find_matches(tokens) == self.model.expected(tokens), (seq, n)

    @invariant()
    def pending_agrees(self) -> None:
        assert self.index.pending_count == len(
            {(k[0], k[2], k[3]) for k, v in self.model.pending.items() if v > 0}
        )


IndexVsModel.TestCase.settings = settings(max_examples=150, stateful_step_count=35, deadline=None)
TestIndexVsModel = IndexVsModel.TestCase
