"""CONTRACT C§5.8 / C§8.5: OffloadingEvent → KV events (scenarios A–C, ported assertions)."""

from __future__ import annotations

import logging

import pytest

from kvevents.codec import decode_batch, encode_batch
from kvevents.errors import OffloadError
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.hashing import hash_request_blocks, to_wire_hash
from kvevents.publishers.offload import (
    CPUOffloadingManager,
    OffloadEventTranslator,
    OffloadGroup,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    drain_kv_events,
    make_offload_key,
)

CPU, STORAGE = "CPU", "STORAGE"
TOKENS = list(range(100, 164))
H = [10428775992902877628, 8101442038445348984, 9222808348315984622, 10472129487708613277]

# C§8.1 V2: the placeholder batch vLLM 0.33 puts on the wire.
V2_HEX = (
    "93cb000000000000000092de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368"
    "657391cfffffffffffffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390"
    "aa626c6f636b5f73697a6500a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65"
    "c0a967726f75705f6964780084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368"
    "657392cfffffffffffffffff05a66d656469756da3435055a967726f75705f6964780003"
)


def stored(keys: list[OffloadKey], medium: str = CPU, **kw: object) -> OffloadingEvent:
    return OffloadingEvent(list(keys), medium, removed=False, **kw)  # type: ignore[arg-type]


def removed(keys: list[OffloadKey], medium: str = CPU, **kw: object) -> OffloadingEvent:
    return OffloadingEvent(list(keys), medium, removed=True, **kw)  # type: ignore[arg-type]


# --- scenario A ---------------------------------------------------------------------------


def scenario_a(self_describing: bool) -> tuple[OffloadEventTranslator, list[OffloadKey]]:
    raw = hash_request_blocks(TOKENS, 16, algo="sha256_cbor", seed="vllm-none-hash")
    assert [to_wire_hash(d) for d in raw] == H
    tr = OffloadEventTranslator(
        [OffloadGroup(16)], blocks_per_chunk=2, tokens_per_hash=16, self_describing=self_describing
    )
    chunk_keys = tr.chunk_keys(raw, 0)
    keys = [k for k, _ in chunk_keys]
    # C§9.10: the key is the raw digest at the chunk's last boundary + the group suffix.
    assert keys == [make_offload_key(raw[1], 0), make_offload_key(raw[3], 0)]
    assert [pos for _, pos in chunk_keys] == [32, 64]
    for c, key in enumerate(keys):
        tr.record_chunk(key, c, raw, TOKENS)
    return tr, keys


def test_scenario_a_self_describing() -> None:
    tr, keys = scenario_a(True)
    out = tr.translate([stored(keys)])
    assert out == [
        BlockStored(
            block_hashes=[H[0], H[1]],
            parent_block_hash=None,
            token_ids=list(range(100, 132)),
            block_size=16,
            lora_id=None,
            medium=CPU,
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockStored(
            block_hashes=[H[2], H[3]],
            parent_block_hash=H[1],
            token_ids=list(range(132, 164)),
            block_size=16,
            lora_id=None,
            medium=CPU,
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
    ]
    assert tr.translate([removed(keys)]) == [BlockRemoved(H, CPU, group_idx=0)]
    assert tr.num_snapshots == 0


def test_scenario_a_placeholder() -> None:
    tr, keys = scenario_a(False)
    assert tr.num_snapshots == 0  # placeholder mode keeps nothing
    out = tr.translate([stored(keys)])
    assert out == [
        BlockStored([H[1]], None, [], 0, None, CPU, None, group_idx=0),
        BlockStored([H[3]], None, [], 0, None, CPU, None, group_idx=0),
    ]
    assert tr.translate([removed(keys)]) == [BlockRemoved([H[1], H[3]], CPU, group_idx=0)]


# --- scenario B ---------------------------------------------------------------------------


def test_scenario_b_hybrid_groups_of_different_block_sizes_in_one_event() -> None:
    raw = hash_request_blocks(TOKENS, 4, algo="sha256_cbor", seed="vllm-none-hash")
    r = [to_wire_hash(d) for d in raw]
    groups = [OffloadGroup(16), OffloadGroup(8, kind="sliding_window", sliding_window=32)]
    tr = OffloadEventTranslator(groups, tokens_per_hash=4, self_describing=True)
    assert groups[1].sliding_window_size_in_chunks(tr.tokens_per_chunk(1)) == 4
    g0 = [k for k, _ in tr.chunk_keys(raw, 0)]
    g1 = [k for k, _ in tr.chunk_keys(raw, 1)]
    assert [to_wire_hash(k[:-4]) for k in g0] == [r[3], r[7], r[11], r[15]]
    assert [to_wire_hash(k[:-4]) for k in g1[:3]] == [r[1], r[3], r[5]]
    assert g0[0][:-4] == g1[1][:-4] and g0[0] != g1[1]  # r3 keys both groups
    for c, key in enumerate(g0):
        assert tr.record_chunk(key, c, raw, TOKENS)
    for c, key in enumerate(g1):
        assert not tr.record_chunk(key, c, raw, TOKENS)  # SWA: no snapshot

    keys = [g0[0], g0[1], g1[0], g1[1]]
    out = tr.translate([stored(keys)])
    assert out == [
        BlockStored(
            [r[3]], None, list(range(100, 116)), 16, None, CPU, None,
            group_idx=0, kv_cache_spec_kind="full_attention",
        ),
        BlockStored(
            [r[7]], r[3], list(range(116, 132)), 16, None, CPU, None,
            group_idx=0, kv_cache_spec_kind="full_attention",
        ),
        BlockStored(
            [r[1]], None, [], 0, None, CPU, None,
            group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32,
        ),
        BlockStored(
            [r[3]], None, [], 0, None, CPU, None,
            group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32,
        ),
    ]  # fmt: skip
    assert tr.translate([removed(keys)]) == [
        BlockRemoved([r[3], r[7]], CPU, group_idx=0),
        BlockRemoved([r[1], r[3]], CPU, group_idx=1),
    ]


# --- scenario C ---------------------------------------------------------------------------


def test_scenario_c_secondary_tier_keeps_snapshot_until_last_residency() -> None:
    tr, keys = scenario_a(True)
    assert len(tr.translate([stored(keys)])) == 2
    out = tr.translate(
        [stored(keys[:1], STORAGE, locality="REMOTE", ownership="fs", removal_expected=True)]
    )
    assert len(out) == 1 and isinstance(out[0], BlockStored)
    assert (out[0].medium, out[0].locality, out[0].ownership) == (STORAGE, "REMOTE", "fs")
    assert out[0].block_hashes == [H[0], H[1]] and out[0].block_size == 16

    assert tr.translate([removed(keys)]) == [BlockRemoved(H, CPU, group_idx=0)]
    assert tr.snapshot(keys[0]) is not None  # STORAGE still holds chunk 0
    assert tr.snapshot(keys[1]) is None

    out = tr.translate([removed(keys[:1], STORAGE, locality="REMOTE", ownership="fs")])
    assert out == [
        BlockRemoved([H[0], H[1]], STORAGE, group_idx=0, locality="REMOTE", ownership="fs")
    ]
    assert tr.num_snapshots == 0
    assert tr.translate([removed(keys, metadata_only=True)]) == []
    assert tr.stats.skipped["metadata_only"] == 1


# --- ported upstream assertions (C§8.5) ---------------------------------------------------


def W(i: int) -> int:
    return to_wire_hash(str(i).encode())


def raw_hashes(n: int, start: int = 0) -> list[bytes]:
    return [str(i).encode() for i in range(start, start + n)]


def toks(n: int) -> list[int]:
    return list(range(1, n + 1))


def translator(
    bpc: int = 1, self_describing: bool = True, n_groups: int = 1
) -> OffloadEventTranslator:
    return OffloadEventTranslator(
        [OffloadGroup(4)] * n_groups,
        blocks_per_chunk=bpc,
        tokens_per_hash=4,
        self_describing=self_describing,
    )


def recorded(
    tr: OffloadEventTranslator, raw: list[bytes], tokens: list[int], group: int = 0
) -> list[OffloadKey]:
    keys = [k for k, _ in tr.chunk_keys(raw, group)]
    for c, k in enumerate(keys):
        tr.record_chunk(k, c, raw, tokens)
    return keys


def test_ported_locality_is_forwarded_to_rich_and_placeholder_stores_and_removals() -> None:
    tr = translator()
    keys = recorded(tr, raw_hashes(1), toks(4))
    unknown = make_offload_key(b"zz", 0)
    out = tr.translate([stored([keys[0], unknown], locality="REMOTE")])
    assert [e.locality for e in out] == ["REMOTE", "REMOTE"]
    assert [len(e.token_ids) for e in out if isinstance(e, BlockStored)] == [4, 0]
    rm = tr.translate([removed([keys[0], unknown], locality="REMOTE")])
    assert len(rm) == 1 and rm[0].locality == "REMOTE"


def test_ported_six_single_block_chunks_in_two_batches() -> None:
    tr = translator()
    keys = recorded(tr, raw_hashes(6), toks(24))
    first = tr.translate([stored(keys[:3])])
    second = tr.translate([stored(keys[3:])])
    assert len(first) == 3 and len(second) == 3
    for i, ev in enumerate(first + second):
        assert isinstance(ev, BlockStored)
        assert ev.block_hashes == [W(i)]
        assert ev.token_ids == list(range(4 * i + 1, 4 * i + 5))
        assert ev.parent_block_hash == (W(i - 1) if i else None)
        assert ev.kv_cache_spec_kind == "full_attention"
        assert ev.extra_keys is None
    assert second[0].parent_block_hash == first[-1].block_hashes[-1]


def test_ported_three_blocks_per_chunk() -> None:
    tr = translator(bpc=3)
    keys = recorded(tr, raw_hashes(6), toks(24))
    out = tr.translate([stored(keys)])
    assert [e.block_hashes for e in out] == [[W(0), W(1), W(2)], [W(3), W(4), W(5)]]
    assert [e.parent_block_hash for e in out] == [None, W(2)]  # type: ignore[union-attr]
    rm = tr.translate([removed(keys)])
    assert rm == [BlockRemoved([W(i) for i in range(6)], CPU, group_idx=0)]
    assert tr.num_snapshots == 0


def test_ported_unknown_key_falls_back_to_placeholder(caplog: pytest.LogCaptureFixture) -> None:
    tr = translator(bpc=3)
    k0, k1 = recorded(tr, raw_hashes(6), toks(24))
    unknown = make_offload_key(b"nope", 0)
    with caplog.at_level(logging.WARNING):
        out = tr.translate([stored([k1, unknown, k0])])
        tr.translate([stored([unknown])])
    assert [len(e.block_hashes) for e in out] == [3, 1, 3]
    assert out[1].block_size == 0  # type: ignore[union-attr]
    assert tr.stats.placeholder_fallbacks == 2
    assert sum("no snapshot" in r.message for r in caplog.records) == 1  # warned once


def test_ported_opt_out_gives_placeholders() -> None:
    tr = translator(self_describing=False)
    keys = recorded(tr, raw_hashes(3), toks(12))
    out = tr.translate([stored(keys)])
    assert all(e.block_size == 0 and e.token_ids == [] for e in out)  # type: ignore[union-attr]
    assert len(out) == 3
    assert tr.translate([removed(keys)]) == [BlockRemoved([W(0), W(1), W(2)], CPU, group_idx=0)]


def test_ported_swa_group_has_no_snapshot() -> None:
    tr = OffloadEventTranslator(
        [OffloadGroup(4, kind="sliding_window", sliding_window=8)],
        tokens_per_hash=4,
        self_describing=True,
    )
    keys = recorded(tr, raw_hashes(2), toks(8))
    assert tr.num_snapshots == 0
    out = tr.translate([stored(keys[:1])])
    assert out[0].block_size == 0 and out[0].block_hashes == [W(0)]  # type: ignore[union-attr]
    assert tr.stats.placeholder_fallbacks == 0  # SWA never describes itself


def test_ported_removal_is_split_by_group() -> None:
    tr = translator(n_groups=2)
    k0 = recorded(tr, raw_hashes(2), toks(8), group=0)
    k1 = recorded(tr, raw_hashes(2, start=10), toks(8), group=1)
    tr.translate([stored(k0 + k1)])
    rm = tr.translate([removed([k0[0], k1[0], k0[1], k1[1]])])
    assert {e.group_idx: e.block_hashes for e in rm} == {0: [W(0), W(1)], 1: [W(10), W(11)]}
    assert [e.group_idx for e in rm] == [0, 1]


def test_ported_restore_after_eviction_uses_new_tokens() -> None:
    tr = translator()
    (key,) = recorded(tr, raw_hashes(1), toks(4))
    tr.translate([stored([key])])
    tr.translate([removed([key])])
    assert tr.num_snapshots == 0
    tr.record_chunk(key, 0, raw_hashes(1), [9, 9, 9, 9])
    (ev,) = tr.translate([stored([key])])
    assert ev.token_ids == [9, 9, 9, 9]  # type: ignore[union-attr]


def test_ported_lookup_hit_recorded_before_store_describes_the_store() -> None:
    tr = translator(bpc=2)
    raw, tokens = raw_hashes(2), toks(8)
    (key,) = [k for k, _ in tr.chunk_keys(raw, 0)]
    tr.record_chunk(key, 0, raw, tokens)  # lookup HIT on a promotion
    out = tr.translate([stored([key])])
    assert len(out) == 1
    assert len(out[0].block_hashes) == 2 and out[0].block_size == 4  # type: ignore[union-attr]
    assert out[0].token_ids == tokens  # type: ignore[union-attr]


def test_ported_abort_before_hit_then_later_hit_heals_removal() -> None:
    tr = translator(bpc=2)
    raw, tokens = raw_hashes(2), toks(8)
    (key,) = [k for k, _ in tr.chunk_keys(raw, 0)]
    (ev,) = tr.translate([stored([key])])  # request gone before any record
    assert ev.block_hashes == [W(1)] and ev.block_size == 0  # type: ignore[union-attr]
    tr.record_chunk(key, 0, raw, tokens)  # a later lookup HIT
    assert tr.translate([removed([key])]) == [BlockRemoved([W(0), W(1)], CPU, group_idx=0)]
    assert tr.num_snapshots == 0


# --- wire shape and the manager path ------------------------------------------------------


def test_placeholder_events_encode_to_vllm_bytes() -> None:
    tr = OffloadEventTranslator()  # placeholder mode needs no geometry
    k_max = make_offload_key(b"\x00" * 24 + b"\xff" * 8, 0)
    k_five = make_offload_key(b"\x11" * 24 + (5).to_bytes(8, "big"), 0)
    events = tr.translate([stored([k_max]), removed([k_max, k_five])])
    payload = encode_batch(KVEventBatch(ts=0.0, events=list(events), data_parallel_rank=3))
    assert payload.hex() == V2_HEX
    decoded = decode_batch(payload)
    st = decoded.events[0]
    assert isinstance(st, BlockStored)
    assert (st.block_size, st.token_ids, st.parent_block_hash, st.group_idx) == (0, [], None, 0)


def test_drain_from_manager_with_mixed_block_size_groups() -> None:
    m = CPUOffloadingManager(3, enable_events=True)
    tr = OffloadEventTranslator(
        [OffloadGroup(16), OffloadGroup(32)], blocks_per_chunk=2, tokens_per_hash=16
    )
    raw = hash_request_blocks(list(range(128)), 16, algo="sha256_cbor", seed="vllm-none-hash")
    g0 = [k for k, _ in tr.chunk_keys(raw, 0)]  # chunks of 32 tokens: raw[1], raw[3], …
    g1 = [k for k, _ in tr.chunk_keys(raw, 1)]  # chunks of 64 tokens: raw[3], raw[7]
    assert len(g0) == 4 and len(g1) == 2
    ctx = ReqContext("r")
    keys = [g0[0], g1[0], g0[1]]
    out = m.prepare_store(keys, ctx)
    assert out is not None
    assert drain_kv_events(m, tr) == []  # nothing stored yet
    m.complete_store(keys, ctx)
    m.prepare_store([g1[1]], ctx)  # evicts g0[0]
    events = drain_kv_events(m, tr)
    assert [type(e).__name__ for e in events] == ["BlockStored"] * 3 + ["BlockRemoved"]
    assert [(e.group_idx, e.block_hashes) for e in events] == [
        (0, [to_wire_hash(raw[1])]),
        (1, [to_wire_hash(raw[3])]),
        (0, [to_wire_hash(raw[3])]),
        (0, [to_wire_hash(raw[1])]),
    ]
    assert all(e.block_size == 0 for e in events if isinstance(e, BlockStored))
    encode_batch(KVEventBatch(ts=1.0, events=list(events)))  # encodes as a batch


def test_bad_geometry_and_short_requests_raise() -> None:
    with pytest.raises(OffloadError, match="multiple of tokens_per_hash"):
        OffloadEventTranslator([OffloadGroup(12)], tokens_per_hash=8)
    with pytest.raises(OffloadError, match="needs the groups"):
        OffloadEventTranslator(self_describing=True)
    tr = translator(bpc=2)
    key = make_offload_key(b"1", 0)
    with pytest.raises(OffloadError, match="needs 4 hashes"):
        tr.record_chunk(key, 1, raw_hashes(3), toks(16))
    with pytest.raises(OffloadError, match="needs 8 tokens"):
        tr.record_chunk(key, 0, raw_hashes(2), toks(7))
    assert tr.num_snapshots == 0


def test_bytes_hash_mode() -> None:
    tr = OffloadEventTranslator(int_hashes=False)
    key = make_offload_key(b"abc", 2)
    (ev,) = tr.translate([stored([key])])
    assert ev.block_hashes == [b"abc"] and ev.group_idx == 2


def test_hash_form_follows_vllm_env_var_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # C§4.1: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (default "1") picks int or raw bytes.
    key = make_offload_key(b"\x00" * 24 + b"\x01" * 8, 0)
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    (ev,) = OffloadEventTranslator().translate([stored([key])])
    assert ev.block_hashes == [int.from_bytes(b"\x01" * 8, "big")]
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    (ev,) = OffloadEventTranslator().translate([stored([key])])
    assert ev.block_hashes == [b"\x00" * 24 + b"\x01" * 8]
    (ev,) = OffloadEventTranslator(int_hashes=True).translate([stored([key])])
    assert isinstance(ev.block_hashes[0], int)  # an explicit choice wins
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "yes")
    with pytest.raises(OffloadError, match="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"):
        OffloadEventTranslator()
