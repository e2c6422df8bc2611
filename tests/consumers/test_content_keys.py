"""The content key is a stable, documented algorithm: literal vectors pin it across
processes, machines and Python versions, and an independent re-implementation from the
module's documentation (xxh3-64 chained by seed over little-endian int64 token ids)
agrees with it on random inputs."""

from __future__ import annotations

import hashlib
import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvevents.consumers.content import lookahead_key, prompt_keys, request_keys, root_key
from kvevents.errors import ConfigError
from kvevents.request import MMFeature, RequestKey

# Literal vectors (computed once; a change here breaks every stored index snapshot).
VECTORS = {
    "plain 0..31 @16": [16680715524026282394, 13710502030508884005],
    "root lora": 13699707833697420007,
    "root salt": 5534444933958357481,
    "root lora+salt": 6508855288825350931,
    "lora+salt+image@3 0..31 @16": [10336656868550542707, 9639773990754874571],
    "lookahead [16] after unit 0..15": 13497747941152564113,
}


def test_literal_vectors() -> None:
    assert prompt_keys(list(range(32)), 16) == VECTORS["plain 0..31 @16"]
    assert root_key("my-lora") == VECTORS["root lora"]
    assert root_key(None, "salt") == VECTORS["root salt"]
    assert root_key("my-lora", "salt") == VECTORS["root lora+salt"]
    key = RequestKey(
        list(range(32)), lora_name="my-lora", cache_salt="s", mm_features=[MMFeature("img", 3, 10)]
    )
    assert request_keys(key, 16) == VECTORS["lora+salt+image@3 0..31 @16"]
    first = prompt_keys(list(range(16)), 16)[0]
    assert lookahead_key(first, [16]) == VECTORS["lookahead [16] after unit 0..15"]


def _b2(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def reference_keys(
    tokens: list[int], unit: int, lora: str | None = None, salt: str | None = None
) -> list[int]:
    """The documented algorithm, written again from the docstring."""
    if lora is None and salt is None:
        k = 0
    else:
        data = b"kvevents-lora\x00" + lora.encode() if lora is not None else b""
        if salt is not None:
            data += b"\x00kvevents-salt\x00" + salt.encode()
        k = _b2(data)
    out = []
    for j in range(len(tokens) // unit):
        packed = struct.pack(f"<{unit}q", *tokens[j * unit : (j + 1) * unit])
        k = xxhash.xxh3_64_intdigest(packed, seed=k)
        out.append(k)
    return out


@given(
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=80),
    st.sampled_from([1, 4, 16]),
    st.none() | st.text(max_size=5),
    st.none() | st.text(max_size=5),
)
def test_matches_the_documented_algorithm(
    tokens: list[int], unit: int, lora: str | None, salt: str | None
) -> None:
    assert prompt_keys(tokens, unit, lora, salt) == reference_keys(tokens, unit, lora, salt)


def test_token_ids_outside_int64_are_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="signed 64-bit"):
        prompt_keys([2**64], 1)


def test_an_event_with_token_ids_beyond_int64_is_skipped_not_raised() -> None:
    from kvevents.consumers import BlockIndex
    from kvevents.events import BlockStored, KVEventBatch

    index = BlockIndex()
    ok = BlockStored([1], None, list(range(16)), 16, None, "GPU", None)
    bad = BlockStored([2], 1, [2**64 - 1] * 16, 16, None, "GPU", None)
    index.apply("w", 0, KVEventBatch(0.0, [ok, bad]))
    assert index.stats.skipped["bad_token_ids"] == 1
    assert index.resident_count == 2  # both blocks are held; only the bad one is unkeyed
