"""``BlockIndex.apply_payload`` against its specification, ``apply(decode(payload))``.

Two indexes are fed the same payload stream: one through ``apply_payload`` (with the
compiled core when it runs: the native parser, native content keys, GPU removals applied
as runs, its tables the core's flat ones), the other, the Python core's index (its
tables ``TierMarks``, dicts and an ``OrderedDict``), through :class:`~kvevents.codec.BatchDecoder` and
``apply``.  After
every stream they must be indistinguishable: snapshot bytes, ``find_matches`` for the
stream's prompts, ``summary``, ``len``, gauges and every counter; a payload one side
refuses (:class:`~kvevents.errors.DecodeError`) the other refuses too, with nothing
applied.  Streams: every golden vLLM payload (every release's shape), SGLang's map and
array forms, random streams of every event shape over shared token sequences (joins,
orphans, partial tails, LoRA, salts, multimodal and lookahead keys, sliding windows,
bytes and negative hashes, unknown media and tags, caps, clears, resets) in map and
array forms, and mutated payloads.  Runs in both modes: with ``KVEVENTS_NATIVE=0`` it
holds ``apply_payload`` to the decoder path it is then made of.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from _sglang_wire import SglBatch, SglMetadata, SglRemoved, SglStored, SglStoredWithMetadata
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvevents.consumers.index.join as join_module
import kvevents.consumers.index.marks as marks_module
import kvevents.consumers.index.records as records_module
from kvevents.codec import BatchDecoder
from kvevents.consumers import BlockIndex
from kvevents.consumers.index.bulk import reads_natively
from kvevents.consumers.index.marks import TierMarks
from kvevents.consumers.router import Router
from kvevents.errors import DecodeError
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "vllm-wire-vectors.jsonl"
BS = 4
NSEQ = 4
NBLK = 8
WORKERS = [("a", 0), ("a", 1), ("b", 0)]
TOKENS = [[1000 * (s % 2) + i for i in range(4 * BS)] + [5000 * s + i for i in range((NBLK - 4) * BS)]
          for s in range(NSEQ)]  # fmt: skip
HASHES = [[100 * (s + 1) + i for i in range(NBLK)] for s in range(NSEQ)]
ALL = [h for hs in HASHES for h in hs]
NATIVE = reads_natively()
ENC = msgspec.msgpack.Encoder()


def golden_payloads() -> list[bytes]:
    rows = [json.loads(line) for line in GOLDEN.read_text().splitlines() if line.strip()]
    return [bytes.fromhex(r["payload_hex"]) for r in rows]


# --- the comparison -------------------------------------------------------------------


def feed_both(
    stream: list[tuple[tuple[str, int], bytes]], **config: Any
) -> tuple[BlockIndex, BlockIndex]:
    """The stream through ``apply_payload`` and through decode + ``apply``; checks that
    each payload is refused by both or by neither, and returns both indexes."""
    ours, spec = BlockIndex(**config), python_core_index(**config)
    decoder = BatchDecoder()
    for (source, rank), payload in stream:
        before = ours.snapshot() if len(stream) < 40 else None
        try:
            batch = decoder.decode(payload)
        except DecodeError:
            with pytest.raises(DecodeError):
                ours.apply_payload(source, rank, payload)
            if before is not None:
                assert ours.snapshot() == before  # nothing of it applied
            continue
        with python_core():
            spec.apply(source, rank, batch)
        ours.apply_payload(source, rank, payload)
    assert_python_tables(spec)
    if marks_module.NATIVE is not None:  # the compiled core's tables on the other side
        assert type(ours._marks[0]) is not TierMarks and type(ours._retired) is not OrderedDict
    return ours, spec


@contextmanager
def python_core() -> Iterator[None]:
    """While it lasts, new index tables are the Python core's (``TierMarks``, dicts,
    an ``OrderedDict``), whichever core runs."""
    modules = (marks_module, records_module, join_module)
    saved = [m.NATIVE for m in modules]
    for m in modules:
        m.NATIVE = None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m, native in zip(modules, saved):
            m.NATIVE = native  # type: ignore[attr-defined]


def python_core_index(**config: Any) -> BlockIndex:
    """An index keeping its tables as the Python core does, whichever core runs (feed
    it under :func:`python_core` too: a group's tables are made when it first appears)."""
    with python_core():
        return BlockIndex(**config)


def python_core_restore(data: bytes) -> BlockIndex:
    """``BlockIndex.restore`` as the Python core restores."""
    with python_core():
        return BlockIndex.restore(data)


def assert_python_tables(index: BlockIndex) -> None:
    assert all(type(m) is TierMarks for m in index._marks)
    assert type(index._retired) is OrderedDict
    for w in index._workers.values():
        for gs in w.groups.values():
            assert type(gs.meta) is dict and all(type(r) is dict for r in gs.refs)


def assert_same(ours: BlockIndex, spec: BlockIndex, prompts: list[list[int]]) -> None:
    assert ours.snapshot() == spec.snapshot()
    assert ours.stats == spec.stats
    assert ours.summary() == spec.summary()
    assert len(ours) == len(spec) and ours.gauges() == spec.gauges()
    r_ours, r_spec = Router(ours), Router(spec)
    for p in prompts:
        assert r_ours.find_matches(p) == r_spec.find_matches(p)


def payload_counts(index: BlockIndex) -> tuple[int, int, int]:
    s = index.payload_stats
    return s.native, s.python, s.fallbacks


# --- fixed streams -----------------------------------------------------------------


def test_golden_payloads_of_every_release() -> None:
    payloads = golden_payloads()
    stream = [(WORKERS[i % len(WORKERS)], p) for i, p in enumerate(payloads)]
    for config in ({}, {"canonical_block_size": 1, "keep_token_ids": True, "max_blocks": 7}):
        ours, spec = feed_both(stream, **config)
        assert_same(ours, spec, [list(range(10, 40)), [1, 2, 3, 4, 5, 6, 7, 8]])
        if NATIVE:  # every golden payload is a shape read natively
            assert payload_counts(ours) == (len(payloads), 0, 0)
        else:
            assert payload_counts(ours) == (0, len(payloads), 0)


def test_sglang_map_and_array_forms_fall_back_counted() -> None:
    map_form = ENC.encode(
        {
            "ts": 3.5,
            "events": [
                {"type": "BlockStored", "block_hashes": [-5, 7], "parent_block_hash": None,
                 "token_ids": list(range(8)), "block_size": 4, "lora_id": None},
                {"type": "BlockRemoved", "block_hashes": [7]},
            ],
            "attn_dp_rank": 2,
        }
    )  # fmt: skip
    array_form = ENC.encode(
        SglBatch(2.0, [SglStoredWithMetadata([11, 12], None, list(range(8)), 4, None, "GPU",
                                   metadata=SglMetadata("salt")),
                        SglRemoved([11], "GPU"), SglStored([13], 12, [5, 6, 7, 8], 4, None)], 1)
    )  # fmt: skip
    stream = [(("s", 0), map_form), (("s", 1), array_form), (("s", 0), map_form)]
    ours, spec = feed_both(stream)
    assert_same(ours, spec, [list(range(12))])
    assert len(ours) > 0
    if NATIVE:
        # the map-form batch is SGLang's, the 6-element store with a metadata map is
        # not vLLM's: both are left to the Python decoder, and counted
        assert payload_counts(ours) == (0, 3, 3)
    else:
        assert payload_counts(ours) == (0, 3, 0)


def test_malformed_payload_raises_decode_error_and_keeps_the_index() -> None:
    index = BlockIndex()
    good = ENC.encode(
        KVEventBatch(0.0, [BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", None)])
    )
    index.apply_payload("w", 0, good)
    before = index.snapshot()
    for bad in (b"", b"\xc1", good[:-3], b"\x92\xcb" + b"\x00" * 8 + b"\x91\x05", b"\x93" * 40):
        with pytest.raises(DecodeError):
            index.apply_payload("w", 0, bad)
    assert index.snapshot() == before and len(index) == 2
    stats = index.payload_stats
    assert stats.python == (0 if NATIVE else 1)
    assert stats.fallbacks == (5 if NATIVE else 0)
    assert index.payload_stats is stats  # one per index, beside it (not in its snapshot)
    assert BlockIndex.restore(before).snapshot() == before


def test_vllm_shaped_payloads_never_fall_back() -> None:
    if not NATIVE:
        pytest.skip("pure-Python mode: no compiled parser")
    rng = random.Random(5)
    stream = [(rng.choice(WORKERS), ENC.encode(random_batch(rng, form="map", hostile=False)))
              for _ in range(200)]  # fmt: skip
    ours, spec = feed_both(stream, blocks_per_chunk=2)
    assert_same(ours, spec, PROMPTS)
    assert payload_counts(ours) == (200, 0, 0)


# --- random streams ---------------------------------------------------------------------


PROMPTS = [TOKENS[s] for s in range(NSEQ)] + [TOKENS[0][:9], TOKENS[1][: 3 * BS + 1]]


def _gpu_store(rng: random.Random) -> BlockStored:
    seq = rng.randrange(NSEQ)
    start = rng.randrange(NBLK)
    stop = rng.randrange(start + 1, NBLK + 1)
    hashes: list[Any] = HASHES[seq][start:stop]
    parent: Any = HASHES[seq][start - 1] if start else None
    toks = TOKENS[seq][start * BS : stop * BS]
    if rng.random() < 0.08:
        parent = rng.choice([77, -3, b"\x01\x02"])  # an orphan
    lora = extra = la = None
    shape = rng.random()
    if shape < 0.1:
        lora = "ad"
        extra = [("ad",)] * len(hashes)
    elif shape < 0.16:
        extra = [None] * len(hashes)
        extra[0] = (("img", 1),) if start else ("salt-x",)
    elif shape < 0.22:
        la = [[TOKENS[seq][(i + 1) * BS % len(TOKENS[seq])]] for i in range(start, stop)]
    elif shape < 0.25:
        toks = [7, 7, 7, 7, *toks]  # leading tokens of no block (a window's null blocks)
    elif shape < 0.27:
        hashes = [-h for h in hashes]
    size = BS
    if rng.random() < 0.05:
        size = BS // 2  # a partial tail at finer granularity
        toks = toks[: len(hashes) * size]
    return BlockStored(
        hashes, parent, toks, size, None, rng.choice(["GPU", "GPU", None, "GPU"]), lora,
        extra, group_idx=rng.choice([0, 0, 0, 1, None]),
        kv_cache_spec_kind=rng.choice(["full_attention", None, None, "sliding_window", "mamba"]),
        kv_cache_spec_sliding_window=rng.choice([None, None, None, 8]),
        lookahead_token_ids=la,
    )  # fmt: skip


def _event(rng: random.Random, hostile: bool) -> Any:
    r = rng.random()
    if r < 0.35:
        return _gpu_store(rng)
    if r < 0.6:  # GPU removals: vLLM sends one per block, in runs
        hs = rng.sample([*ALL, 55], rng.choice([1, 1, 1, 2]))
        return BlockRemoved(hs, rng.choice(["GPU", "GPU", None]),
                            group_idx=rng.choice([0, 0, 1, None]))  # fmt: skip
    tier = rng.choice(["CPU", "STORAGE", "CPU"] + (["DISK"] if hostile else []))
    group = rng.choice([0, 0, 1])
    if r < 0.78:  # placeholders
        hs = rng.sample([*ALL[1::2], 55], rng.choice([1, 1, 2]))
        return BlockStored(hs, None, [], 0, None, tier, None, group_idx=group)
    if r < 0.83:  # a self-describing chunk of two blocks
        seq = rng.randrange(NSEQ)
        i = 2 * rng.randrange(NBLK // 2)
        parent = HASHES[seq][i - 1] if i else None
        return BlockStored(HASHES[seq][i : i + 2], parent, TOKENS[seq][i * BS : (i + 2) * BS],
                           BS, None, tier, None, group_idx=group)  # fmt: skip
    if r < 0.85:  # vLLM <= 0.23: bytes hashes, no group
        h = rng.choice(ALL).to_bytes(8, "big")
        if rng.random() < 0.5:
            return BlockStored([h], None, [], 0, None, tier, None)
        return BlockRemoved([h], tier)
    if r < 0.97:
        hs = rng.sample([*ALL[1::2], 55], rng.choice([1, 1, 2]))
        return BlockRemoved(hs, tier, group_idx=group)
    return AllBlocksCleared()


def _array_form(ev: Any) -> list[Any]:
    """The event as vLLM <= 0.23 wrote it (a positional array, tag first)."""
    if isinstance(ev, BlockStored):
        return ["BlockStored", ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                ev.block_size, ev.lora_id, ev.medium, ev.lora_name, ev.extra_keys,
                ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window]  # fmt: skip
    if isinstance(ev, BlockRemoved):
        return ["BlockRemoved", ev.block_hashes, ev.medium, ev.group_idx]
    return ["AllBlocksCleared"]


def random_batch(rng: random.Random, form: str, hostile: bool) -> Any:
    events = [_event(rng, hostile) for _ in range(rng.randrange(0, 7))]
    if form == "array":
        for ev in events:  # (the array form has no lookahead ids)
            if isinstance(ev, BlockStored):
                ev.lookahead_token_ids = None
        return [0.0, [_array_form(e) for e in events], rng.choice([None, 0, 3])]
    if hostile and events and rng.random() < 0.1:
        raw = msgspec.msgpack.decode(ENC.encode(KVEventBatch(1.0, events)))
        raw[1].insert(rng.randrange(len(raw[1]) + 1), {"type": "FutureEvent", "x": 1})
        return raw  # an unknown tag: skipped and counted by the decoder
    return KVEventBatch(rng.random(), events, rng.choice([None, 1]))


def _mutate(p: bytes, rng: random.Random) -> bytes:
    b = bytearray(p)
    op = rng.randrange(3)
    if op == 0 and b:
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == 1:
        del b[rng.randrange(len(b) + 1) :]
    else:
        at = rng.randrange(len(b) + 1)
        b[at:at] = rng.randbytes(rng.randrange(1, 5))
    return bytes(b)


def random_stream(rng: random.Random, n: int) -> list[tuple[tuple[str, int], bytes]]:
    stream = []
    for _ in range(n):
        form = rng.choice(["map", "map", "map", "array"])
        payload = ENC.encode(random_batch(rng, form, hostile=True))
        if rng.random() < 0.05:
            payload = _mutate(payload, rng)
        stream.append((rng.choice(WORKERS), payload))
    return stream


CONFIGS = st.fixed_dictionaries(
    {
        "blocks_per_chunk": st.sampled_from([None, 2, 1]),
        "canonical_block_size": st.sampled_from([BS, 2, 1, 3]),
        "max_blocks": st.sampled_from([4_000_000, 20, 5]),
        "gpu_metadata_retention": st.sampled_from([200_000, 6, 0]),
        "max_pending": st.sampled_from([100_000, 3]),
        "keep_token_ids": st.booleans(),
        "lookahead_tokens": st.sampled_from([None, 0, 1]),
        "eagle_drop": st.booleans(),
    }
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False), CONFIGS, st.integers(1, 60))
def test_random_streams_leave_the_same_index(rng: random.Random, config: Any, n: int) -> None:
    stream = random_stream(rng, n)
    ours, spec = feed_both(stream, **config)
    assert_same(ours, spec, PROMPTS)
    s = ours.payload_stats
    assert s.native + s.python == sum(not _refused(p) for _, p in stream)


def _refused(payload: bytes) -> bool:
    try:
        BatchDecoder().decode(payload)
    except DecodeError:
        return True
    return False


def test_resets_removed_workers_and_restored_snapshots() -> None:
    rng = random.Random(11)
    stream = random_stream(rng, 300)
    ours, spec = BlockIndex(max_blocks=40), python_core_index(max_blocks=40)
    decoder = BatchDecoder()
    for i, ((source, rank), payload) in enumerate(stream):
        if i % 50 == 49:
            ours.reset_worker((source, rank))
            spec.reset_worker((source, rank))
        if i % 70 == 69:  # a worker removed comes back under the same id
            ours.remove_worker((source, rank))
            spec.remove_worker((source, rank))
        if i == 150:  # a restored index goes on applying payloads alike
            ours = BlockIndex.restore(ours.snapshot())
        if i == 220:  # each core restores the other's snapshot (the same bytes)
            ours, spec = BlockIndex.restore(spec.snapshot()), python_core_restore(ours.snapshot())
            assert type(spec.marks(0)) is TierMarks
        try:
            batch = decoder.decode(payload)
        except DecodeError:
            continue
        with python_core():
            spec.apply(source, rank, batch)
        ours.apply_payload(source, rank, payload)
    assert_python_tables(spec)
    assert_same(ours, spec, PROMPTS)
