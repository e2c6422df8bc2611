"""The benchmark baseline ``benchmarks/_vllm_standin.py`` is a second copy of vLLM 0.33's
wire classes on purpose (an independent reference for ``benchmarks/vs_vllm.py``); this
keeps the copy honest: for the same events, its msgspec encoding is byte for byte
kvevents', and kvevents decodes it back to equal objects."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

import kvevents.events as ours
from kvevents import BatchDecoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
standin = pytest.importorskip("_vllm_standin")


def events(ns: Any, rng: random.Random) -> list[Any]:
    out: list[Any] = []
    for i in range(40):
        hashes = [rng.getrandbits(64) for _ in range(rng.randrange(1, 4))]
        kind = i % 5
        if kind == 0:
            out.append(
                ns.BlockStored(hashes, rng.getrandbits(64), list(range(16 * len(hashes))), 16,
                               None, "GPU", None, group_idx=0,
                               kv_cache_spec_kind="full_attention")
            )  # fmt: skip
        elif kind == 1:
            out.append(ns.BlockStored(hashes, None, [], 0, None, "CPU", None))
        elif kind == 2:
            out.append(
                ns.BlockStored([h.to_bytes(8, "big") for h in hashes], None, [1, 2], 2, 7, None,
                               "lora", extra_keys=[("salt",)] * len(hashes), session_id="s")
            )  # fmt: skip
        elif kind == 3:
            out.append(ns.BlockRemoved(hashes, "GPU", group_idx=1, locality="LOCAL"))
        else:
            out.append(ns.AllBlocksCleared())
    return out


@pytest.mark.parametrize("seed", range(5))
def test_standin_bytes_are_kvevents_bytes(seed: int) -> None:
    theirs = standin.KVEventBatch(1.5, events(standin, random.Random(seed)), 3)
    mine = ours.KVEventBatch(1.5, events(ours, random.Random(seed)), 3)
    raw = msgspec.msgpack.encode(theirs)
    assert raw == msgspec.msgpack.encode(mine)
    assert BatchDecoder().decode(raw) == mine
