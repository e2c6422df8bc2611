"""``BatchDecoder.decode_raw_tokens``: the same events as ``decode``, token ids kept as msgpack.

Differential against :meth:`BatchDecoder.decode` over arbitrary batches, every golden vLLM
payload (modern and legacy), foreign shapes, and malformed or too-deep input (nothing but
``DecodeError`` escapes, on decoding or on reading the tokens).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from test_codec_robustness import (
    PLACES,
    STORED_MAP,
    _bytewise,
    _structural,
    deep,
    with_value,
)
from test_codec_tolerance import batches

from kvevents import BatchDecoder, BlockStored, DecodeError, DecodeStats, encode_batch
from kvevents.codec import RawTokensBatch, RawTokensBlockStored

enc = msgspec.msgpack.encode
VECTORS = [
    json.loads(line)
    for line in (Path(__file__).parent / "golden" / "vllm-wire-vectors.jsonl")
    .read_text()
    .splitlines()
    if line.strip()
]


def plain(batch: RawTokensBatch) -> list[Any]:
    return [e.to_stored() if isinstance(e, RawTokensBlockStored) else e for e in batch.events]


def assert_same(payload: bytes) -> RawTokensBatch:
    """``decode_raw_tokens`` agrees with ``decode`` on ``payload`` (both fresh decoders)."""
    want = BatchDecoder().decode(payload)
    got = BatchDecoder().decode_raw_tokens(payload)
    assert isinstance(got, RawTokensBatch)
    assert (got.ts, got.data_parallel_rank) == (want.ts, want.data_parallel_rank)
    assert plain(got) == want.events
    for g, w in zip(got.events, want.events):
        if isinstance(w, BlockStored):
            assert isinstance(g, RawTokensBlockStored)
            assert g.token_list() == w.token_ids
    return got


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_same_events_as_decode_and_same_bytes_back(batch: Any) -> None:
    data = encode_batch(batch)
    got = assert_same(data)
    assert encode_batch(got) == data  # raw token ids are written back verbatim


@pytest.mark.parametrize("vector", VECTORS, ids=[v["id"] for v in VECTORS])
def test_every_golden_payload(vector: dict[str, Any]) -> None:
    assert_same(bytes.fromhex(vector["payload_hex"]))


def test_array_first_decoder_and_mixed_producers() -> None:
    dec = BatchDecoder()
    legacy = enc([1.0, [["BlockStored", [7], None, [1, 2], 2, None, "GPU", None]], 0])
    modern = enc([2.0, [{**STORED_MAP}], 0])
    for payload in (legacy, legacy, modern, legacy, modern, modern):
        got = dec.decode_raw_tokens(payload)
        assert plain(got) == BatchDecoder().decode(payload).events
    assert dec.stats.tolerant_batches == 0


def test_unknown_tags_are_skipped_and_counted_as_decode_does() -> None:
    payload = enc([0.0, [{"type": "Future", "x": 1}, STORED_MAP], 0])
    stats = DecodeStats()
    got = BatchDecoder(stats).decode_raw_tokens(payload)
    assert [type(e) for e in got.events] == [RawTokensBlockStored]
    assert stats.skipped_events["unknown_tag"] == 1


@pytest.mark.parametrize("tokens", ["abc", [1, "x"], {"a": 1}, [1.5], [None]])
def test_bad_token_ids_are_a_decode_error_when_read(tokens: Any) -> None:
    payload = enc([0.0, [{**STORED_MAP, "token_ids": tokens}], 0])
    with pytest.raises(DecodeError):
        BatchDecoder().decode(payload)
    event = BatchDecoder().decode_raw_tokens(payload).events[0]
    assert isinstance(event, RawTokensBlockStored)
    with pytest.raises(DecodeError, match="token_ids"):
        event.token_list()
    with pytest.raises(DecodeError):
        event.to_stored()


@pytest.mark.parametrize("depth", [995, 5000, 50_000])
def test_deep_token_ids_only_raise_decode_error(depth: int) -> None:
    payload = with_value([0.0, [{**STORED_MAP, "token_ids": "\x00mark\x00"}], 0], deep(depth))
    try:
        event = BatchDecoder().decode_raw_tokens(payload).events[0]
    except DecodeError:
        return
    assert isinstance(event, RawTokensBlockStored)
    with pytest.raises(DecodeError):
        event.token_list()


@pytest.mark.parametrize("place", list(PLACES))
def test_995_nested_maps_anywhere_are_a_decode_error(place: str) -> None:
    with pytest.raises(DecodeError, match="nested"):
        BatchDecoder().decode_raw_tokens(with_value(PLACES[place][0], deep(995)))


def test_mutated_golden_payloads_agree_with_decode_or_raise_decode_error() -> None:
    rng = random.Random(20261204)
    golden = [bytes.fromhex(v["payload_hex"]) for v in VECTORS]
    outcomes = {"ok": 0, "DecodeError": 0}
    for _ in range(1500):
        payload = rng.choice(golden)
        mutant = _structural(rng, payload) if rng.random() < 0.5 else _bytewise(rng, payload)
        try:
            want: Any = BatchDecoder().decode(mutant).events
        except DecodeError:
            want = DecodeError
        try:
            got: Any = plain(BatchDecoder().decode_raw_tokens(mutant))
        except DecodeError:
            got = DecodeError
        # The raw path reads token ids only when asked, so it may accept a payload whose
        # token ids ``decode`` rejects; reading them then raises DecodeError (above).
        if want is not DecodeError:
            assert got == want
        outcomes["ok" if got is not DecodeError else "DecodeError"] += 1
    assert outcomes["ok"] > 40 and outcomes["DecodeError"] > 200, outcomes


def test_the_raw_token_store_is_derived_from_block_stored() -> None:
    """Same tag, fields, order and defaults as ``BlockStored`` but for ``token_ids``: a
    field vLLM adds to ``BlockStored`` cannot be missed here."""
    raw = {f.name: f for f in msgspec.structs.fields(RawTokensBlockStored)}
    plain = {f.name: f for f in msgspec.structs.fields(BlockStored)}
    assert list(raw) == list(plain)
    assert RawTokensBlockStored.__struct_config__.tag == BlockStored.__struct_config__.tag
    for name, f in plain.items():
        assert raw[name].default == f.default, name
        assert raw[name].type == (msgspec.Raw if name == "token_ids" else f.type), name
