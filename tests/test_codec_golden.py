"""Golden wire vectors: payloads encoded by vLLM's own classes, releases 0.9 to 0.34.

Each vector decodes to its logical form; vLLM 0.33/0.34 vectors re-encode to the same
bytes (C§8.1, C§9.1-9.2).  The vectors live in tests/golden/ (copied from the project's
shared golden set so the repository stands alone).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

VECTORS = [
    json.loads(line)
    for line in (Path(__file__).parent / "golden" / "vllm-wire-vectors.jsonl")
    .read_text()
    .splitlines()
    if line.strip()
]
V1_HEX = {v["version"]: v["payload_hex"] for v in VECTORS if v["id"].endswith("golden-V1")}


def _logical(batch: KVEventBatch) -> dict[str, Any]:
    def norm(o: Any) -> Any:
        if isinstance(o, bytes):
            return {"hex": o.hex()}
        if isinstance(o, (list, tuple)):
            return [norm(x) for x in o]
        return o

    events = []
    for e in batch.events:
        d: dict[str, Any] = {"type": type(e).__name__}
        for f in e.__struct_fields__:
            d[f] = norm(getattr(e, f))
        events.append(d)
    return {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events}


def _from_logical(logical: dict[str, Any]) -> KVEventBatch:
    def denorm(o: Any) -> Any:
        if isinstance(o, dict) and set(o) == {"hex"}:
            return bytes.fromhex(o["hex"])
        if isinstance(o, list):
            return [denorm(x) for x in o]
        return o

    classes = {
        "BlockStored": BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
    }
    events = []
    for e in logical["events"]:
        fields = {k: denorm(v) for k, v in e.items() if k != "type"}
        if fields.get("extra_keys") is not None:
            fields["extra_keys"] = [
                tuple(k) if k is not None else None for k in fields["extra_keys"]
            ]
        events.append(classes[e["type"]](**fields))
    return KVEventBatch(logical["ts"], events, logical["data_parallel_rank"])


def test_vector_set_is_complete() -> None:
    assert len(VECTORS) == 125
    assert {v["version"] for v in VECTORS} >= {"0.9.0", "0.23.0", "0.24.0", "0.33.0", "0.34.0"}


@pytest.mark.parametrize("vector", VECTORS, ids=[v["id"] for v in VECTORS])
def test_every_vector_decodes_to_its_logical_form(vector: dict[str, Any]) -> None:
    batch = decode_batch(bytes.fromhex(vector["payload_hex"]))
    assert _logical(batch) == vector["logical"]


MODERN = [v for v in VECTORS if v["version"] in ("0.33.0", "0.34.0")]


@pytest.mark.parametrize("vector", MODERN, ids=[v["id"] for v in MODERN])
def test_modern_vectors_encode_byte_identically(vector: dict[str, Any]) -> None:
    batch = _from_logical(vector["logical"])
    assert encode_batch(batch).hex() == vector["payload_hex"]


def test_contract_v1_to_v4_bytes() -> None:
    """C§8.1 V1-V4 built from the constructors the contract names."""
    v1 = KVEventBatch(
        1700000000.5,
        [
            BlockStored(
                [1, 2],
                None,
                [10, 11, 12, 13],
                2,
                None,
                "GPU",
                None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            BlockRemoved([1], "GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        0,
    )
    v2 = KVEventBatch(
        0.0,
        [
            BlockStored([2**64 - 1], None, [], 0, None, "CPU", None, group_idx=0),
            BlockRemoved([2**64 - 1, 5], "CPU", group_idx=0),
        ],
        3,
    )
    v3 = KVEventBatch(
        2.0,
        [
            BlockStored(
                [7],
                6,
                [1, 2],
                2,
                3,
                "STORAGE",
                "adapter",
                extra_keys=[("adapter", ("mm-hash", 0), "salt")],
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=128,
                locality="REMOTE",
                ownership="fs",
                session_id="s1",
                lookahead_token_ids=[[3]],
            ),
        ],
        None,
    )
    v4 = KVEventBatch(0.0, [BlockRemoved([bytes(range(32))], "GPU")], 0)
    by_id = {v["id"]: v["payload_hex"] for v in VECTORS}
    for name, batch, size in (("V1", v1, 249), ("V2", v2, 204), ("V3", v3, 311), ("V4", v4, 90)):
        data = encode_batch(batch)
        assert len(data) == size
        assert data.hex() == by_id[f"0.33.0/golden-{name}"]
        back = decode_batch(data)
        # Nested tuples in extra_keys come back as lists (C§1.2): equal on the wire.
        assert encode_batch(back) == data
        if name != "V3":
            assert back == batch


def test_block_stored_is_always_map16() -> None:
    """C§1.2: the map header size depends on the class (16 possible entries), not content."""
    data = encode_batch(KVEventBatch(0.0, [BlockStored([], None, [], 0, None, None, None)], 0))
    raw_event_start = data.index(b"\xde")
    assert data[raw_event_start : raw_event_start + 3] == b"\xde\x00\x08"


@pytest.mark.parametrize("version", ["0.9.0", "0.12.0", "0.23.0"])
def test_legacy_forms_decode_to_v1_content(version: str) -> None:
    """C§8.1: the legacy array forms of V1 give the same logical events as V1."""
    legacy = decode_batch(bytes.fromhex(V1_HEX[version]))
    modern = decode_batch(bytes.fromhex(V1_HEX["0.33.0"]))
    assert legacy.ts == modern.ts
    assert [type(e) for e in legacy.events] == [type(e) for e in modern.events]
    stored, removed = legacy.events[0], legacy.events[1]
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    want = modern.events[0]
    assert isinstance(want, BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size) == (
        want.block_hashes,
        want.parent_block_hash,
        want.token_ids,
        want.block_size,
    )
    assert removed.block_hashes == [1]


def test_contract_legacy_hex_literals() -> None:
    """The literal legacy hex strings of C§8.1 (not only the golden file's)."""
    hexes = [
        "92cb41d954fc402000009396ab426c6f636b53746f726564920102c0940a0b0c0d02c092ac426c6f636b52656d6f766564910191b0416c6c426c6f636b73436c6561726564",
        "93cb41d954fc402000009397ab426c6f636b53746f726564920102c0940a0b0c0d02c0a347505593ac426c6f636b52656d6f7665649101a347505591b0416c6c426c6f636b73436c656172656400",
        "93cb41d954fc40200000939cab426c6f636b53746f726564920102c0940a0b0c0d02c0a3475055c0c000ae66756c6c5f617474656e74696f6ec094ac426c6f636b52656d6f7665649101a34750550091b0416c6c426c6f636b73436c656172656400",
    ]
    for h in hexes:
        b = decode_batch(bytes.fromhex(h))
        s = b.events[0]
        assert isinstance(s, BlockStored)
        assert s.block_hashes == [1, 2] and s.token_ids == [10, 11, 12, 13] and s.block_size == 2
        assert isinstance(b.events[2], AllBlocksCleared)


def test_msgspec_reference_decoder_agrees_on_modern_vectors() -> None:
    """Cross-check: a plain msgspec decoder of our classes reads 0.24+ bytes the same."""
    ref = msgspec.msgpack.Decoder(KVEventBatch)
    for v in VECTORS:
        if tuple(int(p) for p in v["version"].split(".")) >= (0, 24, 0):
            data = bytes.fromhex(v["payload_hex"])
            assert ref.decode(data) == decode_batch(data)
