"""The compiled wire parser reads every payload exactly as the Python decoder does, or
leaves it to the Python decoder: golden vLLM payloads, random batches of every event
shape, mutated payloads and random bytes.  Its content keys equal the Python chain.

Skipped when ``kvevents-native`` is not installed (``pip install ./native``); run in
both modes, since ``KVEVENTS_NATIVE=0`` changes what kvevents uses, not what these
tests compare."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

kn = pytest.importorskip("kvevents_native")

from kvevents.codec.decode import BatchDecoder  # noqa: E402
from kvevents.consumers.content import chain_units  # noqa: E402
from kvevents.errors import DecodeError  # noqa: E402
from kvevents.events import BlockStored, KVEventBatch  # noqa: E402
from kvevents.native import batch_from_parsed  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "vllm-wire-vectors.jsonl"


def golden_payloads() -> list[tuple[str, bytes]]:
    rows = [json.loads(line) for line in GOLDEN.read_text().splitlines() if line.strip()]
    return [(r["id"], bytes.fromhex(r["payload_hex"])) for r in rows]


def python_reading(payload: bytes) -> KVEventBatch | DecodeError:
    try:
        return BatchDecoder().decode(payload)
    except DecodeError as exc:
        return exc


def check_same(payload: bytes | bytearray | memoryview) -> bool:
    """Native and Python agree on ``payload``; True when the native parser read it."""
    parsed = kn.parse_batch(payload)
    if parsed is None:
        return False
    want = python_reading(bytes(payload))
    assert not isinstance(want, DecodeError), f"native read what Python refuses: {want}"
    got = batch_from_parsed(parsed)
    # (compared as encoded bytes: a NaN ts is not equal to itself)
    assert msgspec.msgpack.encode(got) == msgspec.msgpack.encode(want)
    if want.ts == want.ts:
        assert got == want  # (and tuples stay tuples, lists lists)
    assert [type(e) for e in got.events] == [type(e) for e in want.events]
    assert parsed.block_events == sum(len(getattr(e, "block_hashes", ())) for e in want.events)
    return True


def test_every_golden_payload_is_read_natively_and_the_same() -> None:
    payloads = golden_payloads()
    assert len(payloads) >= 100
    native = [pid for pid, p in payloads if check_same(p)]
    # every release's golden batch and edge cases is a shape the native parser reads
    assert len(native) == len(payloads), sorted({pid for pid, _ in payloads} - set(native))


def test_bytearray_and_memoryview_payloads() -> None:
    _, p = golden_payloads()[-1]
    buf = bytearray(p)
    parsed = kn.parse_batch(buf)
    assert parsed is not None
    buf[:] = b"\x00" * len(buf)  # the parsed batch holds its own copy
    assert batch_from_parsed(parsed) == BatchDecoder().decode(p)
    assert check_same(memoryview(p))


# --- random batches -------------------------------------------------------------------

u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
small = st.integers(0, 40)
hashes = st.one_of(u64, i64, st.binary(min_size=0, max_size=40))
text = st.one_of(st.sampled_from(["GPU", "CPU", "STORAGE", "LOCAL", "x"]), st.text(max_size=8))
any_leaf = st.one_of(st.none(), st.booleans(), i64, st.floats(allow_nan=False), text, st.binary())
wrong = st.one_of(st.booleans(), st.floats(allow_nan=False), st.text(max_size=3), st.binary())


def maybe(strat: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strat)


extra_item = st.one_of(
    st.none(),
    st.lists(
        st.one_of(any_leaf, st.tuples(text, st.integers(-5, 40)), st.lists(any_leaf, max_size=2)),
        max_size=3,
    ),
    st.dictionaries(text, i64, max_size=1),  # a map inside: left to Python
)

STORED_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "block_hashes": st.lists(hashes, max_size=4),
    "parent_block_hash": maybe(hashes),
    "token_ids": st.lists(st.one_of(i64, small), max_size=24),
    "block_size": st.one_of(small, i64),
    "lora_id": maybe(i64),
    "medium": maybe(text),
    "lora_name": maybe(text),
    "extra_keys": maybe(st.lists(extra_item, max_size=3)),
    "group_idx": maybe(small),
    "kv_cache_spec_kind": maybe(text),
    "kv_cache_spec_sliding_window": maybe(small),
    "locality": maybe(text),
    "ownership": maybe(text),
    "session_id": maybe(text),
    "lookahead_token_ids": maybe(st.lists(st.lists(i64, max_size=3), max_size=3)),
}
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
ARRAY_ORDER = {
    "BlockStored": list(STORED_FIELDS)[:11],
    "BlockRemoved": ["block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": [],
}


@st.composite
def raw_event(draw: st.DrawFn, form: str) -> Any:
    tag = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]))
    names = (
        list(STORED_FIELDS)
        if tag == "BlockStored"
        else list(REMOVED_FIELDS)
        if tag == "BlockRemoved"
        else []
    )
    values = {n: draw(STORED_FIELDS[n]) for n in names}
    if draw(st.integers(0, 9)) == 0 and names:  # a value of the wrong type
        values[draw(st.sampled_from(names))] = draw(wrong)
    if form == "map":
        keep = [n for n in names if draw(st.integers(0, 11)) > 0]  # sometimes one missing
        ev: dict[str, Any] = {}
        if draw(st.integers(0, 15)) == 0:
            ev["junk"] = draw(any_leaf)  # an unknown key before the tag
        ev["type"] = tag
        for n in keep:
            ev[n] = values[n]
        if draw(st.integers(0, 7)) == 0:
            ev["future_field"] = draw(st.one_of(any_leaf, st.lists(any_leaf, max_size=2)))
        return ev
    order = ARRAY_ORDER.get(tag, [])
    n = draw(st.integers(0, len(order) + 1))
    return [tag] + [values.get(name) for name in order[:n]] + [None] * max(0, n - len(order))


@st.composite
def raw_batch(draw: st.DrawFn) -> Any:
    form = draw(st.sampled_from(["map", "array", "mixed"]))
    events = [
        draw(raw_event(form if form != "mixed" else draw(st.sampled_from(["map", "array"]))))
        for _ in range(draw(st.integers(0, 5)))
    ]
    ts = draw(st.one_of(st.floats(allow_nan=False), i64, st.booleans()))
    batch = [ts, events]
    shape = draw(st.integers(0, 3))
    if shape >= 1:
        batch.append(draw(st.one_of(st.none(), small, u64, st.booleans())))
    if shape == 3:
        batch.append(0)
    return batch


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw_batch())
def test_random_batches_read_the_same_or_fall_back(batch: Any) -> None:
    check_same(msgspec.msgpack.encode(batch))


@st.composite
def vllm_batch(draw: st.DrawFn) -> KVEventBatch:
    """A well-formed batch as vLLM 0.33's classes write it."""
    from kvevents.events import AllBlocksCleared, BlockRemoved

    events: list[Any] = []
    for _ in range(draw(st.integers(0, 6))):
        k = draw(st.integers(0, 4))
        nb = draw(st.integers(0, 3))
        hs = draw(st.lists(st.one_of(u64, i64), min_size=nb, max_size=nb))
        if k <= 2:
            bs = draw(st.sampled_from([1, 2, 4, 16]))
            toks = draw(st.lists(st.integers(0, 2**20), min_size=nb * bs, max_size=nb * bs))
            events.append(
                BlockStored(
                    hs,
                    draw(maybe(u64)),
                    toks,
                    bs,
                    draw(maybe(small)),
                    draw(st.sampled_from(["GPU", "CPU", None])),
                    draw(maybe(text)),
                    group_idx=draw(maybe(small)),
                    kv_cache_spec_kind=draw(maybe(st.sampled_from(["full_attention", "mamba"]))),
                )
            )
        elif k == 3:
            events.append(BlockRemoved(hs, draw(st.sampled_from(["GPU", "CPU"])), draw(small)))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(draw(st.floats(0, 2e9)), events, draw(maybe(small)))


@settings(max_examples=300, deadline=None)
@given(vllm_batch(), st.sampled_from([1, 2, 4]), u64)
def test_vllm_shaped_batches_are_native_and_keyed_alike(
    batch: KVEventBatch, unit: int, parent: int
) -> None:
    payload = msgspec.msgpack.encode(batch)
    assert check_same(payload)  # vLLM's own shape never falls back
    parsed = kn.parse_batch(payload)
    for i, ev in enumerate(batch.events):
        keys = parsed.block_keys(i, parent, unit)
        if not isinstance(ev, BlockStored) or ev.block_size % unit:
            assert keys is None or isinstance(ev, BlockStored)
            continue
        want, k = [], parent
        for b in range(len(ev.block_hashes)):
            k = chain_units(k, ev.token_ids[b * ev.block_size : (b + 1) * ev.block_size], unit)
            want.append(k)
        assert keys == want


# --- hostile input ---------------------------------------------------------------------


def mutations(p: bytes, rng: random.Random) -> bytes:
    b = bytearray(p)
    op = rng.randrange(6)
    if op == 0 and b:
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == 1 and b:
        b[rng.randrange(len(b))] = rng.choice([0xC1, 0xDD, 0xDF, 0xCF, 0xDB, 0xFF, 0x00, 0xC0])
    elif op == 2:
        del b[rng.randrange(len(b) + 1) :]
    elif op == 3:
        at = rng.randrange(len(b) + 1)
        b[at:at] = rng.randbytes(rng.randrange(1, 9))
    elif op == 4 and b:
        at = rng.randrange(len(b))
        b[at : at + 4] = struct.pack(">I", rng.choice([0xFFFFFFFF, 0x7FFFFFFF, 1 << 20]))
    else:
        a, c = sorted(rng.randrange(len(b) + 1) for _ in range(2))
        b[a:a] = b[a:c]
    return bytes(b)


def test_mutated_golden_payloads_never_crash_nor_disagree() -> None:
    rng = random.Random(33)
    corpus = [p for _, p in golden_payloads()]
    native = 0
    for i in range(20_000):
        p = corpus[i % len(corpus)]
        for _ in range(rng.randrange(1, 4)):
            p = mutations(p, rng)
        native += check_same(p)
    assert native > 0  # some mutations stay well-formed (a flipped token id, say)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(data: bytes) -> None:
    check_same(data)


def test_huge_declared_lengths_are_refused_cheaply() -> None:
    # an array that claims 4 G elements in a few bytes must not allocate for them
    for p in (
        b"\x92\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff",
        b"\x93\x00\x91\x82\xa4type\xabBlockStored\xacblock_hashes\xdd\xff\xff\xff\xff",
        b"\xdd\xff\xff\xff\xff",
    ):
        assert kn.parse_batch(p) is None
        assert isinstance(python_reading(p), DecodeError)


def test_deep_nesting_is_left_to_python() -> None:
    ev = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "x": []}
    inner: Any = 1
    for _ in range(500):
        inner = [inner]
    ev["x"] = inner
    p = msgspec.msgpack.encode([1.0, [ev], 0])
    assert kn.parse_batch(p) is None
    assert python_reading(p) is not None  # whatever Python makes of it, no crash here
