"""find_matches over fleets of many workers, against a plain per-worker model.

The differential test drives three workers through long random histories; this one
builds fleets of up to 40 workers (bitsets wider than one machine word, freed slots)
with random GPU holes, CPU and STORAGE chunks, and checks every answer against a literal
model of vLLM's lookup applied worker by worker.  Uniform fleets (one block size,
one chunk size) take the router's fused path; mixed and hybrid fleets the general one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from _vllm_model import Group, expected_match
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.consumers.index import BlockIndex
from kvevents.consumers.router import Match, Router
from kvevents.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvevents.hashing import hash_request_blocks, to_wire_hash

SEQ_LEN = 256
_BASE = list(range(1, SEQ_LEN + 1))
# sequences sharing prefixes of 64 and 160 tokens with sequence 0, and one sharing none
SEQS: list[tuple[int, ...]] = [
    tuple(_BASE),
    tuple(_BASE[:64] + [900 + i for i in range(SEQ_LEN - 64)]),
    tuple(_BASE[:160] + [700 + i for i in range(SEQ_LEN - 160)]),
    tuple(5000 + i for i in range(SEQ_LEN)),
]
TIERS = ("GPU", "CPU", "STORAGE")

Held = dict[tuple[int, str], set[tuple[int, ...]]]


@dataclass(frozen=True)
class WorkerSpec:
    groups: list[int]
    """Block size per KV-cache group."""
    bpc: int
    """Blocks per chunk (0: never configured, never offloads)."""
    seq: int
    blocks: int
    """Tokens stored on GPU, in 32-token steps."""
    gpu_holes: set[int]
    gpu_drop_from: int
    chunks: dict[str, set[int]]
    """CPU/STORAGE chunk indices offloaded."""


@cache
def block_hashes(seq: int, size: int) -> list[int | bytes]:
    return [to_wire_hash(d) for d in hash_request_blocks(SEQS[seq], size, algo="sha256_cbor")]


@st.composite
def fleets(draw: st.DrawFn) -> list[WorkerSpec]:
    shape = draw(st.sampled_from(["uniform", "uniform", "mixed", "hybrid"]))
    n = draw(st.integers(1, 40))
    workers = []
    for w in range(n):
        if shape == "uniform":
            groups = [16]
        elif shape == "hybrid" and w == n - 1:
            groups = [16, 32]
        else:
            groups = [draw(st.sampled_from([16, 32]))]
        bpc = 2 if shape == "uniform" else draw(st.sampled_from([1, 2]))
        if draw(st.integers(0, 9)) == 0:
            bpc = 0
        workers.append(
            WorkerSpec(
                groups=groups,
                bpc=bpc,
                seq=draw(st.integers(0, 3)),
                blocks=draw(st.integers(0, SEQ_LEN // 32)),
                gpu_holes=draw(st.sets(st.integers(0, 15), max_size=3)),
                gpu_drop_from=draw(st.integers(0, 16)),
                chunks={t: draw(st.sets(st.integers(0, 15), max_size=8)) for t in TIERS[1:]},
            )
        )
    return workers


def build(fleet: list[WorkerSpec], removed: set[int]) -> tuple[BlockIndex, dict[int, Held]]:
    index = BlockIndex(blocks_per_chunk={("w", w): spec.bpc for w, spec in enumerate(fleet)})
    model: dict[int, Held] = {}
    for w, spec in enumerate(fleet):
        tokens = SEQS[spec.seq]
        held: Held = {}
        events: list[KVEvent] = []
        for g, size in enumerate(spec.groups):
            hs = block_hashes(spec.seq, size)
            nb = spec.blocks * 32 // size
            for t in TIERS:
                held[(g, t)] = set()
            if not nb:
                continue
            events.append(BlockStored(hs[:nb], None, list(tokens[: nb * size]), size, None,
                                      "GPU", None, group_idx=g,
                                      kv_cache_spec_kind="full_attention"))  # fmt: skip
            gone = {i for i in spec.gpu_holes if i < nb} | set(range(spec.gpu_drop_from, nb))
            for i in range(nb):
                if i in gone:
                    events.append(BlockRemoved([hs[i]], "GPU", group_idx=g))
                else:
                    held[(g, "GPU")].add(tokens[: (i + 1) * size])
            if not spec.bpc:
                continue
            for t in TIERS[1:]:
                for c in sorted(spec.chunks[t]):
                    if (c + 1) * spec.bpc <= nb:
                        tail = hs[(c + 1) * spec.bpc - 1]
                        events.append(BlockStored([tail], None, [], 0, None, t, None, group_idx=g))
                        held[(g, t)].add(tokens[: (c + 1) * spec.bpc * size])
        index.apply("w", w, KVEventBatch(0.0, events))
        model[w] = held
    for w in removed:
        index.remove_worker(("w", w))
        model.pop(w, None)
    return index, model


def expected(
    fleet: list[WorkerSpec], model: dict[int, Held], tokens: tuple[int, ...]
) -> dict[tuple[str, int], Match]:
    """vLLM's rules worker by worker (tests/consumers/_vllm_model.py)."""
    out = {}
    for w, held in model.items():
        groups = [Group(s) for s in fleet[w].groups]
        m = expected_match(groups, held, tokens, fleet[w].bpc)
        if any(m):
            out[("w", w)] = m
    return out


@settings(max_examples=120, deadline=None)
@given(fleet=fleets(), data=st.data())
def test_find_matches_agrees_with_a_per_worker_model(
    fleet: list[WorkerSpec], data: st.DataObject
) -> None:
    removed = data.draw(st.sets(st.integers(0, len(fleet) - 1), max_size=2))
    index, model = build(fleet, removed)
    router = Router(index)
    for seq in range(4):
        for n in (SEQ_LEN, 200, 100, 40, 15):
            tokens = SEQS[seq][:n]
            assert router.find_matches(tokens) == expected(fleet, model, tokens), (seq, n)


def test_a_thousand_workers_each_get_their_own_answer() -> None:
    """Wide bitsets: worker w holds 16·(w % 16) GPU tokens and the CPU chunk after them."""
    index = BlockIndex(blocks_per_chunk=1)
    hs = block_hashes(0, 16)
    tokens = SEQS[0]
    for w in range(1000):
        k = w % 16
        events: list[KVEvent] = [
            BlockStored(hs[: k + 1], None, list(tokens[: (k + 1) * 16]), 16, None, "GPU", None,
                        group_idx=0, kv_cache_spec_kind="full_attention"),
            BlockStored([hs[k]], None, [], 0, None, "CPU", None, group_idx=0),
            BlockRemoved([hs[k]], "GPU", group_idx=0),
        ]  # fmt: skip
        index.apply("w", w, KVEventBatch(0.0, events))
    got = Router(index).find_matches(tokens)
    assert got == {("w", w): Match(16 * (w % 16), 16) for w in range(1000)}
