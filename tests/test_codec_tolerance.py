"""The tolerant decoder: every historical and foreign shape, and nothing but DecodeError.

C§1.3, C§9.2, C§9.3: array events of any historical length, map events with unknown or
missing keys, missing medium/lora_name, signed/unsigned/bytes hashes, map-shaped batches,
unknown tags skipped and counted.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from _sglang_wire import SglBatch, SglMetadata, SglRemoved, SglStored, SglStoredWithMetadata
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    DecodeError,
    DecodeStats,
    KVEventBatch,
    decode_batch,
    describe_payload,
    encode_batch,
)

enc = msgspec.msgpack.encode

# --- strategies ----------------------------------------------------------------------

u64 = st.integers(min_value=0, max_value=2**64 - 1)
i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
hashes = st.one_of(u64, i64, st.binary(min_size=1, max_size=32))
opt_str = st.none() | st.text(max_size=8)
opt_int = st.none() | st.integers(min_value=0, max_value=2**31 - 1)
scalar = st.one_of(st.text(max_size=6), st.integers(-(2**31), 2**31), st.binary(max_size=4))
flat_extra = st.none() | st.lists(
    st.none() | st.tuples(scalar) | st.tuples(scalar, scalar), max_size=3
)


@st.composite
def block_stored(draw: st.DrawFn) -> BlockStored:
    hs = draw(st.lists(hashes, max_size=5))
    return BlockStored(
        hs,
        draw(st.none() | hashes),
        draw(st.lists(st.integers(0, 2**31 - 1), max_size=40)),
        draw(st.integers(0, 1024)),
        draw(opt_int),
        draw(st.none() | st.sampled_from(["GPU", "CPU", "STORAGE"])),
        draw(opt_str),
        extra_keys=draw(flat_extra),
        group_idx=draw(opt_int),
        kv_cache_spec_kind=draw(
            st.none() | st.sampled_from(["full_attention", "sliding_window", "mamba"])
        ),
        kv_cache_spec_sliding_window=draw(opt_int),
        locality=draw(st.none() | st.sampled_from(["LOCAL", "REMOTE"])),
        ownership=draw(opt_str),
        session_id=draw(opt_str),
        lookahead_token_ids=draw(
            st.none() | st.lists(st.lists(st.integers(0, 100), max_size=3), max_size=3)
        ),
    )


block_removed = st.builds(
    BlockRemoved,
    st.lists(hashes, max_size=5),
    st.none() | st.sampled_from(["GPU", "CPU", "STORAGE"]),
    group_idx=opt_int,
    locality=st.none() | st.sampled_from(["LOCAL", "REMOTE"]),
    ownership=opt_str,
)
events = st.lists(st.one_of(block_stored(), block_removed, st.just(AllBlocksCleared())), max_size=6)
batches = st.builds(
    KVEventBatch,
    st.floats(allow_nan=False, allow_infinity=False),
    events,
    st.none() | st.integers(0, 2**31 - 1),
)


# --- round trips ---------------------------------------------------------------------


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_round_trip_of_arbitrary_batches(batch: KVEventBatch) -> None:
    data = encode_batch(batch)
    back = decode_batch(data)
    assert back == batch
    assert encode_batch(back) == data


def _as_legacy_array(e: Any, n_fields: int) -> list[Any]:
    """Encode an event positionally as a vLLM <= 0.23 producer with n_fields fields."""
    values = [getattr(e, f) for f in e.__struct_fields__][:n_fields]
    return [type(e).__name__, *values]


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(batches, st.sampled_from([5, 6, 7, 9, 11, 14, 17]), st.booleans())
def test_legacy_array_events_of_any_length(
    batch: KVEventBatch, n_fields: int, two_elements: bool
) -> None:
    """Positional events carrying the first n fields (fewer: older, more: newer producer)."""
    raw_events = []
    for e in batch.events:
        if isinstance(e, BlockRemoved):
            raw_events.append(_as_legacy_array(e, max(1, n_fields - 4)))
        else:
            raw_events.append(_as_legacy_array(e, n_fields))
    extra_tail = [["future", 1]] if n_fields > 15 else []
    raw_events = [ev + (extra_tail if n_fields > 15 else []) for ev in raw_events]
    raw = (
        [batch.ts, raw_events] if two_elements else [batch.ts, raw_events, batch.data_parallel_rank]
    )
    back = decode_batch(enc(raw))
    assert len(back.events) == len(batch.events)
    for got, want in zip(back.events, batch.events):
        assert type(got) is type(want)
        names = want.__struct_fields__
        # Array events never carried more than 0.23's fields; later positions are ignored.
        kept = min(n_fields, 11) if isinstance(want, BlockStored) else min(max(1, n_fields - 4), 3)
        for i, name in enumerate(names):
            if i < kept:
                assert getattr(got, name) == getattr(want, name), name
            else:
                assert getattr(got, name) is None, name
    assert back.data_parallel_rank == (None if two_elements else batch.data_parallel_rank)


# --- tolerance -------------------------------------------------------------------------


def _map_event(**fields: Any) -> dict[str, Any]:
    return fields


def test_unknown_tag_is_skipped_and_counted_keeping_the_rest() -> None:
    raw = [
        1.0,
        [
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
            {"type": "BlockPinned", "block_hashes": [2]},
            ["FutureArrayEvent", 1, 2],
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    stats = DecodeStats()
    batch = decode_batch(enc(raw), stats)
    assert batch.events == [BlockRemoved([1], "GPU"), AllBlocksCleared()]
    assert stats.skipped_events["unknown_tag"] == 2
    assert stats.unknown_tags == {"BlockPinned": 1, "FutureArrayEvent": 1}


def test_map_events_with_unknown_keys_and_missing_required_medium_and_lora() -> None:
    raw = [
        5.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [3],
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": 2,
                "new_field_from_0_40": {"x": 1},
            },
            {"type": "BlockRemoved", "block_hashes": [3], "whatever": [1, 2]},
        ],
        1,
    ]
    batch = decode_batch(enc(raw))
    s, r = batch.events
    assert (
        isinstance(s, BlockStored)
        and s.medium is None
        and s.lora_name is None
        and s.lora_id is None
    )
    assert s.block_hashes == [3] and s.token_ids == [1, 2]
    assert r == BlockRemoved([3], None)


def test_sglang_style_map_batch() -> None:
    raw = {
        "ts": 3.5,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [-5],
                "parent_block_hash": -4,
                "token_ids": [9],
                "block_size": 1,
                "lora_id": None,
            }
        ],
        "attn_dp_rank": 2,
    }
    batch = decode_batch(enc(raw))
    assert batch.ts == 3.5 and batch.data_parallel_rank == 2
    e = batch.events[0]
    assert isinstance(e, BlockStored) and e.block_hashes == [-5] and e.parent_block_hash == -4


def test_signed_unsigned_and_bytes_hashes() -> None:
    raw = [0.0, [["BlockRemoved", [-(2**63), 2**64 - 1, b"\x00\x01"]]], 0]
    e = decode_batch(enc(raw)).events[0]
    assert isinstance(e, BlockRemoved)
    assert e.block_hashes == [-(2**63), 2**64 - 1, b"\x00\x01"]


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ([1.0], "$"),
        ("nope", "$"),
        (["x", []], "$[0]"),
        ([1.0, 5], "$[1]"),
        ([1.0, [], "r"], "$[2]"),
        ([1.0, [{"block_hashes": []}]], "$[1][0]"),
        ([1.0, [[]]], "$[1][0]"),
        ([1.0, [7]], "$[1][0]"),
        ([1.0, [], 0, 1], None),  # extra trailing batch elements are fine
        (
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "parent_block_hash": None,
                        "token_ids": [1],
                        "block_size": "16",
                    }
                ],
            ],
            "$[1][0]",
        ),
        ([1.0, [{"type": "BlockRemoved", "medium": "GPU"}]], "$[1][0]"),
        ([1.0, [["BlockStored", [1], None]]], "$[1][0]"),
    ],
)
def test_malformed_batches_raise_decode_error_with_location(raw: Any, where: str | None) -> None:
    if where is None:
        decode_batch(enc(raw))
        return
    with pytest.raises(DecodeError) as info:
        decode_batch(enc(raw))
    assert str(info.value).startswith(where)


def test_error_names_the_field() -> None:
    raw = [
        1.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": [1],
                "block_size": "16",
                "medium": "GPU",
                "lora_id": None,
                "lora_name": None,
            }
        ],
    ]
    with pytest.raises(DecodeError, match="block_size"):
        decode_batch(enc(raw))


def test_non_bytes_payload_is_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        decode_batch("not bytes")  # type: ignore[arg-type]


def test_decoder_accepts_memoryview_and_bytearray() -> None:
    data = encode_batch(KVEventBatch(1.0, [AllBlocksCleared()], 0))
    assert decode_batch(memoryview(data)).events == [AllBlocksCleared()]
    assert decode_batch(bytearray(data)).events == [AllBlocksCleared()]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_decode_error(data: bytes) -> None:
    try:
        decode_batch(data)
    except DecodeError:
        pass


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(batches, st.data())
def test_mutated_payloads_raise_only_decode_error(batch: KVEventBatch, data: st.DataObject) -> None:
    payload = bytearray(encode_batch(batch))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        pos = data.draw(st.integers(0, max(0, len(payload) - 1)))
        if op == "flip" and payload:
            payload[pos] ^= data.draw(st.integers(1, 255))
        elif op == "truncate":
            del payload[pos:]
        elif op == "insert":
            payload[pos:pos] = data.draw(st.binary(min_size=1, max_size=3))
        elif op == "delete" and payload:
            del payload[pos]
    try:
        out = decode_batch(bytes(payload))
    except DecodeError:
        return
    assert isinstance(out, KVEventBatch)
    try:
        describe_payload(bytes(payload))
    except DecodeError:
        pass


def test_batch_decoder_keeps_its_own_stats() -> None:
    a, b = BatchDecoder(), BatchDecoder()
    data = enc([0.0, [{"type": "Nope"}], 0])
    a.decode(data)
    assert a.stats.skipped_events["unknown_tag"] == 1
    assert b.stats.skipped_events["unknown_tag"] == 0
    assert a.stats.tolerant_batches == 1


def test_well_formed_traffic_takes_the_fast_paths() -> None:
    dec = BatchDecoder()
    dec.decode(encode_batch(KVEventBatch(0.0, [BlockRemoved([1], "GPU")], 0)))
    dec.decode(enc([0.0, [["BlockRemoved", [1], "GPU"]], 0]))
    assert dec.stats.tolerant_batches == 0


@pytest.mark.parametrize(
    ("raw", "form", "versions"),
    [
        ([0.0, [["BlockStored", [1], None, [], 0, None]]], "array", "0.9"),
        ([0.0, [["BlockStored", [1], None, [], 0, None, "GPU"]], 0], "array", "0.11-0.15"),
        (
            [0.0, [["BlockStored", [1], None, [], 0, None, "GPU", None, None, 0, None, None]], 0],
            "array",
            "0.21-0.23",
        ),
        (
            [0.0, [{"type": "BlockRemoved", "block_hashes": [], "medium": "GPU"}], 0],
            "map",
            ">=0.24",
        ),
        (
            [
                0.0,
                [
                    {
                        "type": "BlockRemoved",
                        "block_hashes": [],
                        "medium": "GPU",
                        "locality": "LOCAL",
                    }
                ],
                0,
            ],
            "map",
            ">=0.26",
        ),
        ([0.0, [], 0], "none", ">=0.10"),
        ([0.0, []], "none", "0.9"),
    ],
)
def test_describe_payload_infers_the_producer_generation(
    raw: Any, form: str, versions: str
) -> None:
    shape = describe_payload(enc(raw))
    assert (shape.event_form, shape.vllm_versions) == (form, versions)


def test_sglang_salted_store_with_foreign_trailing_field_keeps_the_batch() -> None:
    salted = SglStoredWithMetadata(
        [11, 12], None, [1, 2, 3, 4], 2, None, "GPU", metadata=SglMetadata("salt")
    )
    payload = msgspec.msgpack.encode(
        SglBatch(2.0, [salted, SglRemoved([9], "GPU"), SglStored([13], 12, [5, 6], 2, None)], 1)
    )
    assert msgspec.msgpack.decode(payload)[1][0][-1] == {"cache_salt": "salt"}
    stats = DecodeStats()
    batch = BatchDecoder(stats).decode(payload)
    assert batch.data_parallel_rank == 1
    stored, removed, plain = batch.events
    assert stored == BlockStored([11, 12], None, [1, 2, 3, 4], 2, None, "GPU", None)
    assert removed == BlockRemoved([9], "GPU")
    assert plain == BlockStored([13], 12, [5, 6], 2, None, None, None)
    # The foreign value is not silently taken for a LoRA name: it is dropped and counted.
    assert stats.ignored_fields == {"BlockStored.lora_name": 1}


def test_array_event_with_a_mistyped_required_field_is_still_an_error() -> None:
    raw = [1.0, [["BlockStored", [1], None, [1], {"x": 1}, None, "GPU"]], 0]
    with pytest.raises(DecodeError, match="block_size"):
        decode_batch(enc(raw))


def test_describe_payload_does_not_date_a_foreign_positional_event() -> None:
    # An SGLang salted store has 8 elements like a vLLM 0.13-0.18 store, but its last
    # element is a map, which no vLLM release wrote there: no vLLM version is claimed.
    salted = SglStoredWithMetadata([1], None, [1, 2], 2, None, "GPU", metadata=SglMetadata("s"))
    payload = msgspec.msgpack.encode(SglBatch(1.0, [salted], 0))
    assert describe_payload(payload).event_form == "array"
    assert describe_payload(payload).vllm_versions == ""
    plain = SglStored([1], None, [1, 2], 2, None, "GPU")
    assert describe_payload(msgspec.msgpack.encode(SglBatch(1.0, [plain], 0))).vllm_versions == (
        "0.11-0.15"
    )


def test_array_elements_past_vllm_023_are_not_read_as_map_only_fields() -> None:
    """vLLM never wrote locality/ownership/... positionally: a foreign 13th element
    (a string here) must not turn into ``locality``."""
    raw = [
        0.0,
        [
            ["BlockStored", [1], None, [1, 2], 2, None, "CPU", None, None, 0, None, None, "x", "y"],
            ["BlockRemoved", [1], "CPU", 0, "REMOTE"],
        ],
        0,
    ]
    stored, removed = decode_batch(enc(raw)).events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.locality is None and stored.ownership is None and stored.group_idx == 0
    assert removed.locality is None and removed.group_idx == 0
