"""One build's answers to a fixed random workload, as JSON on stdout.

Run by ``test_compiled_differential.py`` once per build (pure Python with
``KVEVENTS_PURE_PYTHON=1``, the compiled core without), in fresh processes::

    python tests/consumers/_compiled_workload.py SEED [--snapshot-out PATH] [--restore PATH]

The workload: a random stream of msgpack batches (GPU stores with parents, LoRA and
multimodal extra keys, CPU placeholders, self-describing CPU stores, GPU and CPU removals,
clears) from simple workers, a 32-token worker and a hybrid worker (full attention plus a
sliding window), decoded by :class:`~kvevents.BatchDecoder` into a :class:`BlockIndex`
with a small cap, queried as it goes with ``find_matches`` / ``select`` for plain, LoRA,
salted and multimodal prompts.  Then the index's counters, gauges and summary, its
snapshot's digest, and the answers of the index restored from it.  ``--restore`` answers
the same queries from a snapshot another process wrote (``--snapshot-out``).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvevents import compiled
from kvevents.codec import BatchDecoder, encode_batch
from kvevents.consumers.index import BlockIndex
from kvevents.consumers.router import Router
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvevents.request import MMFeature, RequestKey, block_extra_keys

BS = 16
BPC = 2
# worker -> [(group, block size, kind, sliding window)]
WORKERS: dict[tuple[str, int], list[tuple[int, int, str, int | None]]] = {
    **{("e", r): [(0, 16, "full_attention", None)] for r in range(5)},
    ("big", 0): [(0, 32, "full_attention", None)],
    ("hyb", 0): [(0, 16, "full_attention", None), (1, 16, "sliding_window", 64)],
}
WIDS = sorted(WORKERS)


def _keys(rng: random.Random) -> list[RequestKey]:
    base = [rng.randrange(50_000) for _ in range(256)]
    other = base[:96] + [rng.randrange(50_000) for _ in range(160)]
    third = [rng.randrange(50_000) for _ in range(192)]
    imgs = [MMFeature("img-a", 20, 40), MMFeature("img-b", 130, 30)]
    return [
        RequestKey(base),
        RequestKey(other),
        RequestKey(third),
        RequestKey(base, lora_name="adapter-1"),
        RequestKey(other, cache_salt="salt-9"),
        RequestKey(base, mm_features=imgs),
    ]


def _hash(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


class Stream:
    """Random batches; remembers what each (worker, group, tier) was sent."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.keys = _keys(self.rng)
        self.held: dict[tuple[Any, int, str], list[int]] = {}

    def hashes(self, wid: tuple[str, int], g: int, k: int, bs: int) -> list[int]:
        n = len(self.keys[k].tokens) // bs
        return [_hash(wid[0], g, k, bs, i) for i in range(n)]

    def event(self, wid: tuple[str, int]) -> KVEvent:
        rng = self.rng
        g, bs, kind, window = rng.choice(WORKERS[wid])
        k = rng.randrange(len(self.keys))
        key = self.keys[k]
        hs = self.hashes(wid, g, k, bs)
        roll = rng.random()
        gpu = self.held.setdefault((wid, g, "GPU"), [])
        cpu = self.held.setdefault((wid, g, "CPU"), [])
        if roll < 0.35:  # GPU store of a run of blocks, continuing its parent or not
            a = rng.randrange(len(hs))
            b = min(len(hs), a + rng.randrange(1, 6))
            ex = [block_extra_keys(key, i * bs, (i + 1) * bs) for i in range(a, b)]
            gpu += hs[a:b]
            return BlockStored(hs[a:b], hs[a - 1] if a else None,
                               list(key.tokens[a * bs : b * bs]), bs, None, "GPU",
                               key.lora_name, extra_keys=ex if any(ex) else None,
                               group_idx=g, kv_cache_spec_kind=kind,
                               kv_cache_spec_sliding_window=window)  # fmt: skip
        if roll < 0.55:  # CPU placeholder: a chunk's tail hash only
            c = rng.randrange(len(hs) // BPC)
            tail = hs[(c + 1) * BPC - 1]
            cpu.append(tail)
            return BlockStored([tail], None, [], 0, None, "CPU", None, group_idx=g)
        if roll < 0.62:  # self-describing CPU store of one chunk
            c = rng.randrange(len(hs) // BPC)
            a, b = c * BPC, (c + 1) * BPC
            ex = [block_extra_keys(key, i * bs, (i + 1) * bs) for i in range(a, b)]
            cpu.append(hs[b - 1])
            return BlockStored(hs[a:b], hs[a - 1] if a else None,
                               list(key.tokens[a * bs : b * bs]), bs, None, "CPU",
                               key.lora_name, extra_keys=ex if any(ex) else None,
                               group_idx=g, kv_cache_spec_kind=kind,
                               kv_cache_spec_sliding_window=window)  # fmt: skip
        if roll < 0.85 and gpu:  # GPU removals (one hash per event, as vLLM sends)
            h = gpu.pop(rng.randrange(len(gpu)))
            return BlockRemoved([h], "GPU", group_idx=g)
        if roll < 0.97 and cpu:
            n = rng.randrange(1, min(3, len(cpu)) + 1)
            gone = [cpu.pop(rng.randrange(len(cpu))) for _ in range(n)]
            return BlockRemoved(gone, "CPU", group_idx=g)
        if roll < 0.975:
            for tier in ("GPU", "CPU"):
                for gg, *_ in WORKERS[wid]:
                    self.held[(wid, gg, tier)] = []
            return AllBlocksCleared()
        return BlockRemoved([rng.getrandbits(64)], "GPU", group_idx=g)  # unknown hash


def _wid(w: Any) -> str:
    return repr(w)


def _plain(v: Any) -> Any:
    return sorted((repr(k), n) for k, n in v.items()) if isinstance(v, dict) else v


def answers(index: BlockIndex, keys: list[RequestKey], loads: dict[Any, float]) -> list[Any]:
    router = Router(index)
    out: list[Any] = []
    for key in keys:
        found = router.find_matches(key)
        out.append(sorted((_wid(w), list(m)) for w, m in found.items()))
        if index.workers():
            out.append(_wid(router.select(key)))
            out.append(_wid(router.select(key, loads)))
            out.append([repr(c) for c in router.score(key, loads)[:5]])
    return out


def run(seed: int, snapshot_out: str | None, restore: str | None) -> dict[str, Any]:
    stream = Stream(seed)
    index = BlockIndex(max_blocks=180, gpu_metadata_retention=60, blocks_per_chunk=BPC)
    decoder = BatchDecoder()
    loads = {w: float(i % 3) for i, w in enumerate(WIDS)}
    queries = []
    for step in range(2_000):
        wid = stream.rng.choice(WIDS)
        events = [stream.event(wid) for _ in range(stream.rng.randrange(1, 7))]
        payload = encode_batch(KVEventBatch(float(step), events))
        index.apply(wid[0], wid[1], decoder.decode(payload))
        if step % 100 == 99:
            queries.append(answers(index, stream.keys, loads))
    data = index.snapshot()
    if snapshot_out:
        Path(snapshot_out).write_bytes(data)
    restored = BlockIndex.restore(data)
    out: dict[str, Any] = {
        "loaded": list(compiled.status().loaded),
        "queries": queries,
        "len": len(index),
        "gauges": index.gauges(),
        "stats": {f.name: _plain(getattr(index.stats, f.name)) for f in fields(index.stats)},
        "summary": {_wid(w): repr(s) for w, s in index.summary().items()},
        "snapshot_sha256": hashlib.sha256(data).hexdigest(),
        "restored": answers(restored, stream.keys, loads),
        "restored_snapshot_sha256": hashlib.sha256(restored.snapshot()).hexdigest(),
    }
    if restore:
        other = BlockIndex.restore(Path(restore).read_bytes())
        out["cross_restored"] = answers(other, stream.keys, loads)
    return out


def main() -> None:
    args = sys.argv[1:]
    seed = int(args[0])
    opt = {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--")}
    result = run(seed, opt.get("--snapshot-out"), opt.get("--restore"))
    print(json.dumps(result, sort_keys=True, default=repr))


if __name__ == "__main__":
    main()
