"""Router against a literal model of vLLM's lookup, over random fleets of every layout.

Workers of every group layout the router models (one group of 16 or 32 tokens; two
full-attention groups of 16 and 32; full attention with a sliding-window group; full
attention with a chunked-local group; a sliding-window model alone; full attention with
two windowed groups), each optionally in EAGLE drop mode or with lookahead hashing, store
requests of several kinds (plain, LoRA, salted, with an image, with an image on a block
boundary), lose random GPU blocks and offload random chunks (or a random subset of every
group's chunks).  Every answer of ``find_matches``, for every prompt and request
kind, must equal the model of tests/consumers/_vllm_model.py, which knows only token
prefixes and the request kind each block was stored under.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from _vllm_model import Group, expected_match
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents import MMFeature, RequestKey
from kvevents.consumers.index import BlockIndex
from kvevents.consumers.router import Match, Router
from kvevents.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvevents.hashing import hash_block_tokens, to_wire_hash
from kvevents.request import block_extra_keys

N = 160
_BASE = list(range(1, N + 1))
SEQS = [
    tuple(_BASE),
    tuple(_BASE[:64] + [900 + i for i in range(N - 64)]),
    tuple(_BASE[:112] + [700 + i for i in range(N - 112)]),
]
LAYOUTS: dict[str, list[Group]] = {
    "f16": [Group(16)],
    "f32": [Group(32)],
    "f16+f32": [Group(16), Group(32)],
    "f16+sw16": [Group(16), Group(16, "sw", 32)],
    "f16+sw32": [Group(16), Group(32, "sw", 64)],
    "f16+local": [Group(16), Group(16, "local", 32)],
    "sw16": [Group(16, "sw", 48)],
    # two windowed groups: the offload lookup checks the first again when the second
    # lowers the bound
    "f16+sw16+sw16": [Group(16), Group(16, "sw", 32), Group(16, "sw", 64)],
    "f16+sw32+sw16": [Group(16), Group(32, "sw", 64), Group(16, "sw", 48)],
    "f16+local+sw16": [Group(16), Group(16, "local", 32), Group(16, "sw", 48)],
}
KINDS = {"full": "full_attention", "sw": "sliding_window", "local": "chunked_local_attention"}
VARIANTS = ["plain", "lora", "salt", "mm", "mm16"]
IMAGE = {"mm": MMFeature("img", 20, 20), "mm16": MMFeature("img", 16, 8)}


def request(seq: int, variant: str, n: int = N) -> RequestKey:
    tokens = SEQS[seq][:n]
    if variant == "lora":
        return RequestKey(tokens, lora_name="adapter")
    if variant == "salt":
        return RequestKey(tokens, cache_salt="salt")
    if variant in IMAGE:
        return RequestKey(tokens, mm_features=[IMAGE[variant]])
    return RequestKey(tokens)


def ident(variant: str, prefix: tuple[int, ...]) -> Any:
    """What a block's identity is besides its tokens (lookahead tokens included)."""
    if variant in IMAGE:
        # vLLM's keys of a block include an image it overlaps (over the lookahead
        # window too), and every later block chains on it
        return (variant if len(prefix) > IMAGE[variant].offset else None, prefix)
    return (None if variant == "plain" else variant, prefix)


def raw_hashes(key: RequestKey, lookahead: int) -> list[int]:
    toks = list(key.tokens)
    out = []
    parent = None
    for i in range((len(toks) - lookahead) // 16):
        s, e = 16 * i, 16 * (i + 1)
        extra = block_extra_keys(key, s, e + lookahead)  # over the widened window
        if lookahead:
            extra = (*(extra or ()), *toks[e : e + lookahead])
        parent = hash_block_tokens(parent, toks[s:e], extra)
        out.append(to_wire_hash(parent))
    return out


@dataclass(frozen=True)
class Store:
    seq: int
    variant: str
    tokens: int


@dataclass(frozen=True)
class Spec:
    layout: str
    eagle: bool
    lookahead: int
    bpc: int
    stores: list[Store]
    removals: list[tuple[int, int, int]]
    """(store, group, block) GPU removals."""
    chunks: list[tuple[int, int, int, str]]
    """(store, group, chunk, tier) offloads."""
    offload_all: str | None
    """Offload every whole chunk of every store and group to this tier (only the chunks
    in the group's ``masks`` bits), then ..."""
    keep_gpu: int
    """... remove every GPU block ending past this many tokens."""
    masks: tuple[int, ...] = ()
    """Per group, the chunks ``offload_all`` offloads (bit ``c``: chunk ``c``)."""


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    mode = draw(st.sampled_from(["none", "none", "eagle", "lookahead"]))
    if "local" in layout and mode == "eagle":
        mode = "none"  # vLLM does not run EAGLE with chunked local attention
    stores = draw(
        st.lists(
            st.builds(Store, st.integers(0, 2), st.sampled_from(VARIANTS), st.integers(1, 4)),
            min_size=1,
            max_size=3,
        )
    )
    stores = [Store(s.seq, s.variant, s.tokens * 32) for s in stores]
    ng = len(LAYOUTS[layout])
    removals = draw(
        st.lists(
            st.tuples(st.integers(0, len(stores) - 1), st.integers(0, ng - 1), st.integers(0, 9)),
            max_size=6,
        )
    )
    chunks = draw(
        st.lists(
            st.tuples(
                st.integers(0, len(stores) - 1),
                st.integers(0, ng - 1),
                st.integers(0, 9),
                st.sampled_from(["CPU", "CPU", "STORAGE"]),
            ),
            max_size=8,
        )
    )
    return Spec(
        layout,
        mode == "eagle",
        1 if mode == "lookahead" else 0,
        draw(st.sampled_from([0, 1, 2])),
        stores,
        removals,
        chunks,
        draw(st.sampled_from([None, "CPU", "STORAGE"])),
        draw(st.sampled_from([0, 16, 32, 48, 64, 128])),
        tuple(draw(st.one_of(st.just(255), st.integers(0, 255))) for _ in range(ng)),
    )


def build(specs: list[Spec]) -> tuple[BlockIndex, dict[int, dict[tuple[int, str], Counter[Any]]]]:
    index = BlockIndex(
        blocks_per_chunk={("w", w): s.bpc for w, s in enumerate(specs) if s.bpc},
        eagle_drop={("w", w): s.eagle for w, s in enumerate(specs)},
        lookahead_tokens={("w", w): s.lookahead for w, s in enumerate(specs)},
    )
    model: dict[int, dict[tuple[int, str], Counter[Any]]] = {}
    for w, spec in enumerate(specs):
        groups = LAYOUTS[spec.layout]
        held: dict[tuple[int, str], Counter[Any]] = {
            (g, t): Counter() for g in range(len(groups)) for t in ("GPU", "CPU", "STORAGE")
        }
        events: list[KVEvent] = []
        la = spec.lookahead
        hashes: list[list[list[int]]] = []
        for st_ in spec.stores:
            key = request(st_.seq, st_.variant)
            raw = raw_hashes(key, la)
            per_group = []
            for g, grp in enumerate(groups):
                k = grp.size // 16
                hs = raw[k - 1 :: k]
                nb = st_.tokens // grp.size
                per_group.append(hs[:nb])
                blocks = range(nb)
                extras = [block_extra_keys(key, i * grp.size, (i + 1) * grp.size + la)
                          for i in blocks]  # fmt: skip
                events.append(
                    BlockStored(
                        hs[:nb],
                        None,
                        list(key.tokens[: nb * grp.size]),
                        grp.size,
                        None,
                        "GPU",
                        key.lora_name,
                        extra_keys=extras if any(e is not None for e in extras) else None,
                        group_idx=g,
                        kv_cache_spec_kind=KINDS[grp.cls],
                        kv_cache_spec_sliding_window=grp.window or None,
                        lookahead_token_ids=[
                            list(key.tokens[(i + 1) * grp.size :][:la]) for i in blocks
                        ]
                        if la
                        else None,
                    )
                )
                for i in blocks:
                    prefix = key.tokens[: (i + 1) * grp.size + la]
                    held[(g, "GPU")][ident(st_.variant, tuple(prefix))] += 1
            hashes.append(per_group)
        removals = list(spec.removals)
        offloads = list(spec.chunks)
        if spec.offload_all:
            for si in range(len(spec.stores)):
                for g in range(len(groups)):
                    mask = spec.masks[g] if spec.masks else 255
                    offloads += [(si, g, c, spec.offload_all) for c in range(8) if mask >> c & 1]
                    removals += [
                        (si, g, b)
                        for b in range(len(hashes[si][g]))
                        if (b + 1) * groups[g].size > spec.keep_gpu
                    ]
        for si, g, b in removals:
            hs = hashes[si][g]
            if b < len(hs):
                events.append(BlockRemoved([hs[b]], "GPU", group_idx=g))
                st_ = spec.stores[si]
                size = groups[g].size
                prefix = tuple(request(st_.seq, st_.variant).tokens[: (b + 1) * size + la])
                c = held[(g, "GPU")]
                if c[ident(st_.variant, prefix)] > 0:
                    c[ident(st_.variant, prefix)] -= 1
        if spec.bpc:
            for si, g, c, tier in offloads:
                hs = hashes[si][g]
                last = (c + 1) * spec.bpc - 1
                if last < len(hs):
                    events.append(BlockStored([hs[last]], None, [], 0, None, tier, None,
                                              group_idx=g))  # fmt: skip
                    st_ = spec.stores[si]
                    end = (last + 1) * groups[g].size + la
                    prefix = tuple(request(st_.seq, st_.variant).tokens[:end])
                    held[(g, tier)][ident(st_.variant, prefix)] += 1
        index.apply("w", w, KVEventBatch(0.0, events))
        model[w] = held
    return index, model


@settings(max_examples=200, deadline=None)
@given(fleet=st.lists(specs(), min_size=1, max_size=4))
def test_router_equals_vllm_model(fleet: list[Spec]) -> None:
    index, model = build(fleet)
    router = Router(index)
    for seq in range(3):
        for n in (N, 121, 100, 65, 64, 49, 33, 32, 17, 16):
            for variant in VARIANTS:
                key = request(seq, variant, n)
                want = {}
                for w, spec in enumerate(fleet):
                    held = {k: {x for x, c in v.items() if c > 0} for k, v in model[w].items()}
                    m = expected_match(
                        LAYOUTS[spec.layout],
                        held,
                        key.tokens,
                        spec.bpc,
                        eagle=spec.eagle,
                        lookahead=spec.lookahead,
                        ident=lambda p, v=variant: ident(v, p),  # type: ignore[misc]
                    )
                    if any(m):
                        want[("w", w)] = m
                got = router.find_matches(key)
                assert got == want, (seq, n, variant, fleet)


def test_model_sanity() -> None:
    """The model itself on a hand-checked case (full + sliding window, 129 tokens)."""
    toks = tuple(range(129))
    held = {(0, "GPU"): {toks[:e] for e in range(16, 129, 16)},
            (1, "GPU"): {toks[:e] for e in (48, 64, 128)}}  # fmt: skip
    groups = [Group(16), Group(16, "sw", 32)]
    assert expected_match(groups, held, toks, 0) == Match(64, 0, 0)
