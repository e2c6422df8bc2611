"""Nothing but DecodeError escapes the decoders, whatever the depth or size of a payload.

Deeply nested values and huge (or hugely announced) containers at every place a payload
can hold them, on every decode path: the typed map path (vLLM >= 0.24), the typed
positional path (<= 0.23), and the generic tolerant path (unknown tags, map-shaped
batches, malformed shapes).  Plus a mutation fuzz of the golden vLLM payloads and a
process whose recursion limit was raised (where msgspec alone would overflow the C stack).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents import BatchDecoder, DecodeError, KVEventBatch, decode_batch, describe_payload
from kvevents.codec import MAX_NESTING_DEPTH
from kvevents.codec.guards import nested_deeper_than as _nested_deeper_than

GOLDEN = [
    bytes.fromhex(json.loads(line)["payload_hex"])
    for line in (Path(__file__).parent / "golden" / "vllm-wire-vectors.jsonl")
    .read_text()
    .splitlines()
    if line.strip()
]
enc = msgspec.msgpack.encode

# --- raw msgpack pieces (msgspec's encoder itself recurses, so deep values are built here)


def deep(depth: int, kind: str = "map", leaf: bytes = b"\x01") -> bytes:
    """``depth`` nested one-entry maps (``{"a": {"a": ...}}``) or one-element arrays."""
    return (b"\x81\xa1a" if kind == "map" else b"\x91") * depth + leaf


MARK = "\x00mark\x00"


def with_value(template: Any, value: bytes) -> bytes:
    """Encode ``template`` and put the raw msgpack ``value`` where ``MARK`` is."""
    data = enc(template)
    mark = enc(MARK)
    assert data.count(mark) == 1
    return data.replace(mark, value)


STORED_MAP = {
    "type": "BlockStored",
    "block_hashes": [1, 2],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4],
    "block_size": 2,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}
STORED_ARRAY = ["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None]

# Where a payload can hold a value, and whether a well-formed value there is accepted
# (so a shallow one must decode).
PLACES: dict[str, tuple[Any, bool]] = {
    # typed map path: an unknown key is skipped, extra_keys holds Any
    "map_event.unknown_key": ([0.0, [{**STORED_MAP, "future": MARK}], 0], True),
    "map_event.extra_keys": ([0.0, [{**STORED_MAP, "extra_keys": [[MARK]]}], 0], True),
    # typed positional path (vLLM <= 0.23): extra_keys is the 8th field
    "array_event.extra_keys": ([0.0, [[*STORED_ARRAY, [[MARK]]]], 0], True),
    # generic path: an unknown tag, a map-shaped batch, a foreign positional slot
    "unknown_tag_event": ([0.0, [{"type": "Future", "x": MARK}], 0], True),
    "map_batch.event_unknown_key": ({"ts": 0.0, "events": [{**STORED_MAP, "x": MARK}]}, True),
    "array_event.foreign_slot": ([0.0, [["BlockRemoved", [1], MARK]], 0], True),
    # not a valid place for a container: always an error
    "ts": ([MARK, [], 0], False),
    "event": ([0.0, [MARK], 0], False),
    "events": ([0.0, MARK, 0], False),
    "block_hashes": ([0.0, [{**STORED_MAP, "block_hashes": MARK}], 0], False),
    "batch": (MARK, False),
}

DECODERS: dict[str, Callable[[bytes], object]] = {
    "decode_batch": decode_batch,
    "array_first_decoder": lambda p: _array_first().decode(p),
    "describe_payload": describe_payload,
}


def _array_first() -> BatchDecoder:
    dec = BatchDecoder()
    dec.decode(enc([0.0, [["AllBlocksCleared"]], 0]))  # now tries array events first
    return dec


def outcome(decode: Callable[[bytes], object], payload: bytes) -> str:
    """``"ok"`` or ``"DecodeError"``; any other exception fails the test."""
    try:
        decode(payload)
    except DecodeError:
        return "DecodeError"
    return "ok"


# --- the reproduction -----------------------------------------------------------


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("decoder", list(DECODERS))
def test_995_nested_one_key_maps_are_a_decode_error(place: str, decoder: str) -> None:
    payload = with_value(PLACES[place][0], deep(995))
    with pytest.raises(DecodeError, match="nested"):
        DECODERS[decoder](payload)


@pytest.mark.parametrize("place", [p for p, (_, ok) in PLACES.items() if ok])
def test_shallow_nesting_where_a_value_is_accepted_still_decodes(place: str) -> None:
    payload = with_value(PLACES[place][0], deep(40))
    for decoder in DECODERS.values():
        assert outcome(decoder, payload) == "ok"


def test_decoder_keeps_working_after_a_too_deep_payload() -> None:
    dec = BatchDecoder()
    good = enc([0.0, [STORED_MAP], 0])
    for _ in range(3):
        with pytest.raises(DecodeError):
            dec.decode(with_value(PLACES["map_event.unknown_key"][0], deep(5000, "array")))
        assert len(dec.decode(good).events) == 1


def _released_view() -> memoryview:
    view = memoryview(enc([0.0, [], 0]))
    view.release()
    return view


@pytest.mark.parametrize(
    "make",
    [lambda: memoryview(enc([0.0, [], 0]) * 2)[::2], _released_view],
    ids=["non_contiguous_memoryview", "released_memoryview"],
)
@pytest.mark.parametrize("decoder", list(DECODERS))
def test_unreadable_buffers_are_a_decode_error(
    make: Callable[[], memoryview], decoder: str
) -> None:
    with pytest.raises(DecodeError, match="cannot read the payload buffer"):
        DECODERS[decoder](make())  # type: ignore[arg-type]


# --- properties -------------------------------------------------------------------------

depths = st.one_of(st.integers(0, 1500), st.sampled_from([995, 1000, 1001, 5000, 100_000]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(list(PLACES)),
    depths,
    st.sampled_from(["map", "array"]),
    st.sampled_from(list(DECODERS)),
)
def test_any_nesting_anywhere_decodes_or_is_a_decode_error(
    place: str, depth: int, kind: str, decoder: str
) -> None:
    template, accepted = PLACES[place]
    result = outcome(DECODERS[decoder], with_value(template, deep(depth, kind)))
    if accepted and depth <= 100:
        assert result == "ok"
    if depth >= 2000:
        assert result == "DecodeError"


# Container headers announcing up to 2**32 - 1 entries or bytes, then little or nothing.
HUGE_HEADERS = [
    b"\xdd\xff\xff\xff\xff",  # array32
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xdc\xff\xff",  # array16
    b"\xde\xff\xff",  # map16
    b"\xdb\xff\xff\xff\xff",  # str32
    b"\xc6\xff\xff\xff\xff",  # bin32
    b"\xc9\xff\xff\xff\xff\x01",  # ext32
]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(list(PLACES)),
    st.sampled_from(HUGE_HEADERS),
    st.binary(max_size=64),
    st.sampled_from(list(DECODERS)),
)
def test_announced_huge_containers_are_a_decode_error(
    place: str, header: bytes, tail: bytes, decoder: str
) -> None:
    assert outcome(DECODERS[decoder], with_value(PLACES[place][0], header + tail)) == "DecodeError"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 300_000),
    st.sampled_from(["block_hashes", "token_ids", "unknown_map", "unknown_tag", "events"]),
    st.sampled_from(list(DECODERS)),
)
def test_huge_real_containers_decode(n: int, where: str, decoder: str) -> None:
    event: Any = dict(STORED_MAP)
    events = [event]
    if where == "block_hashes":
        event["block_hashes"] = list(range(n))
    elif where == "token_ids":
        event["token_ids"] = [i % 150_000 for i in range(n)]
    elif where == "unknown_map":
        event["future"] = {str(i): i for i in range(n)}
    elif where == "unknown_tag":
        events.append({"type": "Future", "x": list(range(n))})
    else:
        events = [
            {"type": "BlockRemoved", "block_hashes": [i], "medium": "CPU"} for i in range(n // 10)
        ]
    payload = enc([0.0, events, 0])
    out = DECODERS[decoder](payload)
    if isinstance(out, KVEventBatch) and where == "block_hashes":
        assert len(out.events[0].block_hashes) == n  # type: ignore[union-attr]


def _depth(obj: Any) -> int:
    if isinstance(obj, (list, dict)):
        children = obj.values() if isinstance(obj, dict) else obj
        return 1 + max((_depth(c) for c in children), default=0)
    return 0


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=300),
    lambda children: (
        st.lists(children, max_size=20)
        | st.dictionaries(st.text(max_size=5), children, max_size=20)
    ),
    max_leaves=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgpack_values, st.integers(0, 8))
def test_nesting_scan_agrees_with_the_structure(value: Any, limit: int) -> None:
    # The iterative scan that bounds nesting when the recursion limit is raised.
    assert _nested_deeper_than(enc(value), limit) == (_depth(value) > limit)


def test_nesting_scan_counts_ext_and_fixext_values_as_scalars() -> None:
    ext = enc(msgspec.msgpack.Ext(5, b"x" * 300))
    fixext = enc(msgspec.msgpack.Ext(5, b"abcd"))
    assert not _nested_deeper_than(b"\x92" + ext + fixext, 1)
    assert _nested_deeper_than(b"\x92" + fixext + b"\x91\x90", 1)


def test_raised_recursion_limit_does_not_let_a_deep_payload_crash_the_process() -> None:
    # With a raised limit, msgspec would walk 100,000 levels and overflow the C stack.
    code = (
        "import sys; sys.setrecursionlimit(10**7)\n"
        "from kvevents import DecodeError, decode_batch, describe_payload\n"
        "payload = b'\\x93\\xcb' + bytes(8) + b'\\x91' + b'\\x91' * 100000 + b'\\x01\\xc0'\n"
        "for decode in (decode_batch, describe_payload):\n"
        "    try:\n"
        "        decode(payload)\n"
        "    except DecodeError as exc:\n"
        "        print(exc)\n"
        "print(len(decode_batch(b'\\x93\\xcb' + bytes(8) + b'\\x90\\xc0').events))\n"
        "try:\n"
        "    decode_batch(memoryview(payload * 2)[::2])\n"
        "except DecodeError as exc:\n"
        "    print(str(exc).split(':')[1].strip())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        f"$: containers nested deeper than {MAX_NESTING_DEPTH} levels",
        f"$: containers nested deeper than {MAX_NESTING_DEPTH} levels",
        "0",
        "cannot read the payload buffer",
    ]


# --- mutation fuzz of the golden payloads -------------------------------------------------


def _structural(rng: random.Random, payload: bytes) -> bytes:
    """Replace one value of a golden payload by a deep, huge or odd value."""
    raw = msgspec.msgpack.decode(payload)
    slots: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, child in list(items):
            slots.append((node, k))
            if isinstance(child, (list, dict)):
                walk(child)

    walk(raw)
    if not slots:
        return payload
    parent, key = rng.choice(slots)
    parent[key] = MARK
    value = rng.choice(
        [
            deep(rng.choice([50, 500, 990, 995, 1000, 3000, 50_000]), rng.choice(["map", "array"])),
            rng.choice(HUGE_HEADERS) + rng.randbytes(rng.randint(0, 8)),
            enc(rng.choice([None, -1, 2**64 - 1, -(2**63), 1.5, "x", b"\x00", [], {}, [[]]])),
            enc(msgspec.msgpack.Ext(rng.randint(-128, 127), rng.randbytes(rng.randint(0, 20)))),
        ]
    )
    return with_value(raw, value)


def _bytewise(rng: random.Random, payload: bytes) -> bytes:
    data = bytearray(payload)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(data) + 1)
        op = rng.randrange(5)
        if op == 0 and pos < len(data):
            data[pos] = rng.randrange(256)
        elif op == 1:
            data[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 2:
            del data[pos : pos + rng.randint(1, 8)]
        elif op == 3:
            data[pos:pos] = rng.choice([*HUGE_HEADERS, b"\x91" * 2000, b"\x81\xa1a" * 2000])
        else:  # splice another golden payload's tail
            other = rng.choice(GOLDEN)
            data[pos:] = other[rng.randrange(len(other) + 1) :]
    return bytes(data)


def test_mutated_golden_payloads_raise_only_decode_error() -> None:
    rng = random.Random(20261203)
    seen = {"ok": 0, "DecodeError": 0}
    for _ in range(3000):
        payload = rng.choice(GOLDEN)
        mutant = _structural(rng, payload) if rng.random() < 0.5 else _bytewise(rng, payload)
        for decode in DECODERS.values():
            seen[outcome(decode, mutant)] += 1
    # Both outcomes are common: the fuzz exercises accepting and rejecting paths.
    assert seen["ok"] > 500 and seen["DecodeError"] > 500, seen
