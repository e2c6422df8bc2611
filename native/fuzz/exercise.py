"""Exercise every entry point of kvevents_native on small random inputs, for a run under
the sanitizers (native/sanitize_python.sh): the parser on golden payloads and their
mutations (with the apply steps and chained keys of what it reads), the content keys,
the tier marks, the record table, the retained order, the GPU store and removal rules, the walk (over a dict and over the
marks), the assembly and the per-worker lookup (random plans over the marks).  Checks
nothing itself; the sanitizers do."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import kvevents_native as kn

from kvevents.consumers.index import LookupPlan, SpecGroup
from kvevents.consumers.router.match import Match

rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 33)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 300
golden = Path(__file__).resolve().parents[2] / "tests" / "golden" / "vllm-wire-vectors.jsonl"
corpus = [bytes.fromhex(json.loads(line)["payload_hex"]) for line in golden.open()]

for i in range(rounds):
    p = bytearray(corpus[i % len(corpus)])
    for _ in range(rng.randrange(3)):
        if p:
            p[rng.randrange(len(p))] = rng.randrange(256)
    if rng.random() < 0.3:
        del p[rng.randrange(len(p) + 1) :]
    parsed = kn.parse_batch(bytes(p))
    if parsed is not None:
        for j in range(len(parsed)):
            parsed.event(j)
            parsed.block_keys(j, rng.getrandbits(64), rng.choice([1, 2, 16]))
            parsed.chain_blocks(j, rng.randrange(-2, 40), rng.randrange(-1, 20),
                                rng.getrandbits(64), rng.choice([-1, 0, 1, 2, 16]),
                                rng.randrange(-1, 70))  # fmt: skip
        parsed.ops()

for _ in range(rounds):
    toks = [rng.randrange(-(2**63), 2**63) for _ in range(rng.randrange(80))]
    kn.prompt_keys(toks, rng.choice([1, 3, 16]), rng.getrandbits(64))
    nslots = rng.choice([3, 64, 65, 130])
    keys = [rng.getrandbits(64) for _ in range(rng.randrange(20))]
    marks = {k: rng.getrandbits(nslots) for k in keys if rng.random() < 0.8}
    step = rng.choice([1, 2])
    end = [0] * (nslots + 1)
    starts = {step * rng.randrange(1, 10): rng.getrandbits(nslots) for _ in range(rng.randrange(3))}
    nxt = [(rng.choice([1, 2, 4]), rng.getrandbits(nslots)) for _ in range(rng.randrange(3))]
    slot_marks = kn.SlotMarks()
    for k, bits in marks.items():
        slot_marks.load(k, bits)
    for _ in range(rng.randrange(60)):  # marks and unmarks over few keys and slots
        k, slot = rng.choice(keys or [0]), rng.randrange(nslots)
        (slot_marks.mark if rng.random() < 0.6 else slot_marks.unmark)(k, slot)
    slot_marks.items(), slot_marks.dup_items(), slot_marks.get(rng.getrandbits(64), 0)
    records = kn.RecordTable()
    for _ in range(rng.randrange(200)):  # sets, deletions, growth, compaction, a spill
        h = (
            rng.choice([rng.randrange(50), rng.getrandbits(64), -1, b"h"])
            if rng.random() < 0.02
            else rng.randrange(50)
        )
        if rng.random() < 0.6:
            records[h] = rng.choice([rng.getrandbits(192) | 1, rng.getrandbits(200), (1, 2)])
        elif h in records:
            del records[h]
    records.items(), records.isdisjoint(range(10)), len(records), records.nbytes
    retained = kn.RetainedQueue()
    for _ in range(rng.randrange(200)):  # retire, forget, trim, a spill now and then
        key = (("w", rng.randrange(3)), rng.randrange(2), rng.randrange(40))
        if rng.random() < 0.01:
            key = (("w", 0), -1, b"h")
        r = rng.random()
        if r < 0.6:
            retained[key] = None
        elif r < 0.8:
            retained.pop(key, None)
        elif len(retained):
            retained.popitem(last=False)
    retained.items(), len(retained), retained.nbytes
    cpu, storage = kn.RecordTable(), kn.RecordTable()
    size = rng.choice([1, 2, 4, 16])
    nb = rng.randrange(6)
    hashes = [rng.choice([rng.randrange(40), rng.getrandbits(64), -1]) for _ in range(nb)]
    tokens = bytes(rng.getrandbits(8) for _ in range(8 * (nb * size + rng.randrange(-3, 4)) or 0))
    kn.gpu_store_blocks(records if not records.spilled else kn.RecordTable(), cpu, storage,
                        slot_marks, rng.randrange(nslots), hashes, 0, tokens, rng.randrange(3),
                        size, rng.choice([1, 2, 4]), rng.getrandbits(64),
                        rng.choice([None, rng.randrange(100)]),
                        rng.choice([None, rng.getrandbits(64)]))  # fmt: skip
    if not records.spilled:
        kn.gpu_remove_run(records, cpu, storage, slot_marks, rng.randrange(nslots),
                          [rng.choice([*hashes, rng.randrange(40), b"x"]) for _ in range(nb)])  # fmt: skip
    for get in (marks.get, slot_marks.get):
        kn.walk(
            keys,
            get,
            step,
            16,
            rng.getrandbits(nslots),
            starts,
            rng.getrandbits(nslots),
            end,
            [0] + [1 << s for s in range(nslots)],
            nxt,
        )
    lay = SimpleNamespace(nslots=nslots, pos_wids=[None] + [("w", s) for s in range(nslots)])
    cpu = [e + rng.randrange(3) for e in end]
    kn.assembler(Match)(lay, end, cpu, None, rng.choice([-1, rng.getrandbits(nslots)]))


def random_plan(w: int, nslots: int) -> LookupPlan:
    groups, chunks = [], []
    for _ in range(rng.randrange(1, 4)):
        cls = rng.choice(["full", "sw", "local"])
        size = 16 * rng.choice([1, 2])
        slot = rng.randrange(nslots)
        window = 0 if cls == "full" else rng.randrange(1, 100)
        groups.append(SpecGroup(cls, size, window, 1 << slot, (slot,)))
        chunks.append((cls, size, rng.randrange(4), 1 << slot))
    groups.sort(key=lambda g: g.cls != "full")
    return LookupPlan(("w", w), None, len(groups) == 1, tuple(groups), 32, tuple(chunks),
                      rng.random() < 0.5, rng.choice([0, 1, 4]), 0, rng.random() < 0.3)  # fmt: skip


for _ in range(rounds):
    nslots = rng.choice([3, 64, 65, 130])
    n = rng.randrange(0, 300)
    keys = [rng.getrandbits(64) for _ in range(n // 16)]
    tiers = [kn.SlotMarks() for _ in range(3)]
    for tier in tiers:
        for k in keys:
            if rng.random() < 0.7:
                tier.load(k, rng.getrandbits(nslots))
    plans = [random_plan(w, nslots) for w in range(rng.randrange(4))]
    prefix = rng.choice([None, [rng.randrange(300) for _ in range(nslots + 1)], [0]])
    try:
        kn.Lookups(plans, Match).matches(*tiers, keys, n, 16, prefix, {})
    except IndexError:
        pass  # a slot past a short prefix, as in Python
print(f"exercised {rounds} rounds")
