"""Write a small, hand-built capture of one engine's stream (how examples/sample.kvcap,
which the docs and tests read, was made).

It shows a GPU store of two 16-token blocks (vLLM sha256_cbor hashes), the offload of
the second to CPU as a placeholder (block_size 0, no tokens), a GPU eviction, and a seq
gap (seq 3 is missing) before the last batch, which evicts from both tiers.

Run: python examples/make_sample_capture.py [OUT.kvcap]   (default: a new temporary
directory; the tracked examples/sample.kvcap is never rewritten unless named)
"""

import sys
import tempfile
from pathlib import Path

from kvevents import BlockRemoved, BlockStored, CaptureWriter, KVEventBatch, encode_batch
from kvevents.hashing import hash_request_blocks, to_wire_hash

tokens = list(range(100, 132))
h0, h1 = (to_wire_hash(d) for d in hash_request_blocks(tokens, 16, algo="sha256_cbor"))
src = "tcp://127.0.0.1:5557"
batches = [
    (
        0,
        [
            BlockStored(
                [h0, h1],
                None,
                tokens,
                16,
                None,
                "GPU",
                None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        ],
    ),
    (1, [BlockStored([h1], None, [], 0, None, "CPU", None, group_idx=0)]),
    (2, [BlockRemoved([h1], "GPU", group_idx=0)]),
    (4, [BlockRemoved([h0], "GPU", group_idx=0), BlockRemoved([h1], "CPU", group_idx=0)]),
]
if len(sys.argv) > 1:
    out = Path(sys.argv[1])
else:
    out = Path(tempfile.mkdtemp(prefix="kvevents-sample-")) / "sample.kvcap"
with CaptureWriter(out, meta={"description": "kvevents sample capture"}) as w:
    for i, (seq, events) in enumerate(batches):
        payload = encode_batch(KVEventBatch(1700000000.0 + i, events, 0))
        w.write(src, b"", seq, payload, recv_ts=1700000000.001 + i)
print(f"wrote {out}")
