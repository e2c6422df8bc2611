"""Write examples/sample.kvcap: a small, hand-built capture of one engine's stream.

It shows a GPU store of two 16-token blocks (vLLM sha256_cbor hashes), their offload
to CPU as a placeholder (block_size 0, no tokens), a GPU eviction, a replayed batch
and a seq gap.  Run: python examples/make_sample_capture.py
"""

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
out = Path(__file__).with_name("sample.kvcap")
with CaptureWriter(out, meta={"description": "kvevents sample capture"}) as w:
    for i, (seq, events) in enumerate(batches):
        payload = encode_batch(KVEventBatch(1700000000.0 + i, events, 0))
        w.write(src, b"", seq, payload, recv_ts=1700000000.001 + i)
print(f"wrote {out}")
