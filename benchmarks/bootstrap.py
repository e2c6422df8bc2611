"""A service that starts late: bootstrap from a peer's snapshot against a full catch-up.

``N`` engines (1,000; ``--quick``: 20) each have a history of ``H`` batches in their
replay ring, as simulated engines publish them under a chat workload (shared system
prompts per tenant, growing conversations, GPU and CPU tiers).  A service that starts
now can be caught up two ways:

* **full catch-up** (the baseline): every engine's whole ring is decoded and applied to
  a fresh index, what a service started without a peer does once the rings answer
  (the replays' network transfer is left out, which favours the baseline);
* **bootstrap**: a peer that follows the engines took its snapshot ``T`` batches before
  the end of each ring; the new service fetches it over HTTP on loopback (``GET
  /snapshot`` bytes served by a real HTTP server), decodes it, restores the index and
  applies each engine's last ``T`` batches (the replay from its resume point).

A row gives how long the peer takes its snapshot: its consumer thread (the index's only
writer) pauses that long; its routing goes on.

Both end with the same index (checked: per-worker holdings and a prompt's matches).
The rows give seconds to be caught up, each with the full catch-up as baseline, and the
snapshot's size.  Histories are ``K`` distinct simulated engines' streams (10),
assigned round-robin, each under its own worker id.
"""

from __future__ import annotations

import http.server
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: F401 - imported before the timings (fetch_snapshot uses it)
from _common import arg_parser, count, report, result

from kvevents.codec import BatchDecoder, encode_batch
from kvevents.consumers import BlockIndex, Router
from kvevents.events import KVEventBatch
from kvevents.serve.bootstrap import PeerSnapshot, StreamPoint, fetch_snapshot
from kvevents.sim.engine import SimEngine
from kvevents.sim.http.config import default_http_engine
from kvevents.sim.workload import SimRequest

BPC = 4
SYSTEM_TOKENS = 512


class _Sink:
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass


def history(seed: int, n_batches: int) -> tuple[list[bytes], list[int]]:
    """``n_batches`` payloads of one simulated engine under a chat workload, and its
    first system prompt."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30_000) for _ in range(SYSTEM_TOKENS)] for _ in range(4)]
    sink = _Sink()
    engine = SimEngine(default_http_engine(), sink, name=f"e{seed}")
    convs: dict[int, list[int]] = {}
    i = 0
    while len(sink.batches) < n_batches:
        session = rng.randrange(32)
        conv = convs.setdefault(session, list(systems[session % 4]))
        conv += [rng.randrange(1, 30_000) for _ in range(rng.randrange(16, 160))]
        out = tuple(rng.randrange(1, 30_000) for _ in range(16))
        engine.add_request(SimRequest(f"r{i}", session % 4, session, 0, tuple(conv), out))
        i += 1
        while not engine.idle:
            engine.step()
        conv += out
        if len(conv) > 6000:
            convs.pop(session)
    return [encode_batch(b) for b in sink.batches[:n_batches]], systems[0]


class _Peer:
    """Serves fixed ``/snapshot`` bytes on a loopback port."""

    def __init__(self, body: bytes) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def apply_all(index: BlockIndex, streams: list[tuple[str, list[bytes]]], lo: int, hi: int) -> int:
    """Decode and apply batches ``lo..hi-1`` of every stream; returns how many."""
    decode = BatchDecoder().decode
    n = 0
    for name, payloads in streams:
        for p in payloads[lo:hi]:
            index.apply(name, 0, decode(p))
            n += 1
    return n


def main() -> None:
    p = arg_parser(__doc__.split("\n")[0])
    p.add_argument("--engines", type=count, help="engines (1000; --quick 20)")
    p.add_argument("--batches", type=count, help="batches in each ring (300; --quick 100)")
    p.add_argument("--tail", type=count, help="batches after the snapshot (10)")
    p.add_argument("--distinct", type=count, default=10, help="distinct histories (10)")
    args = p.parse_args()
    n = args.engines or (20 if args.quick else 1000)
    h = args.batches or (100 if args.quick else 300)
    tail = min(args.tail or 10, h)
    k = min(args.distinct, n)

    t0 = time.perf_counter()
    made = [history(seed, h) for seed in range(k)]
    distinct = [payloads for payloads, _ in made]
    streams = [(f"engine-{i:04d}", distinct[i % k]) for i in range(n)]
    gen_s = time.perf_counter() - t0
    events = sum(len(BatchDecoder().decode(x).events) for x in distinct[0])

    # The peer followed every engine up to T batches before the end of its ring.
    peer = BlockIndex(blocks_per_chunk=BPC)
    apply_all(peer, streams, 0, h - tail)
    t0 = time.perf_counter()
    peer_bytes = peer.snapshot()
    take_s = time.perf_counter() - t0  # (the peer's consumer thread is paused this long)
    snap = PeerSnapshot(
        peer_bytes,
        tuple(StreamPoint(name, 0, (name, 0), h - tail - 1, 0, True) for name, _ in streams),
        time.time(),
    ).encode()
    del peer

    # Full catch-up: every ring, decoded and applied.
    t0 = time.perf_counter()
    full = BlockIndex(blocks_per_chunk=BPC)
    # (in the peer's order: the index's global bounds, metadata retention and the
    # entry cap, make the end state depend on the order across engines)
    applied_full = apply_all(full, streams, 0, h - tail) + apply_all(full, streams, h - tail, h)
    full_s = time.perf_counter() - t0

    # Bootstrap: fetch, decode, restore, apply the tails.
    server = _Peer(snap)
    try:
        t0 = time.perf_counter()
        doc = fetch_snapshot(server.url)
        fetch_s = time.perf_counter() - t0
        boot = BlockIndex.restore(doc.index)
        restore_s = time.perf_counter() - t0 - fetch_s
        applied_tail = apply_all(boot, streams, h - tail, h)
        boot_s = time.perf_counter() - t0
    finally:
        server.close()

    # The same index either way.
    assert boot.summary() == full.summary(), "bootstrap and full catch-up disagree"
    prompt = made[0][1] + [1, 2, 3]
    assert Router(full).find_matches(prompt) == Router(boot).find_matches(prompt)
    blocks = len(full)

    print(
        f"{n} engines x {h} batches ({events / h:.1f} block events a batch; "
        f"{k} distinct histories generated in {gen_s:.1f} s); index: {blocks:,} entries"
    )
    print(f"full catch-up: {applied_full:,} batches decoded and applied in {full_s:.2f} s")
    print(
        f"bootstrap: snapshot {len(snap) / 1e6:.1f} MB fetched in {fetch_s:.2f} s, "
        f"restored in {restore_s:.2f} s, {applied_tail:,} tail batches; {boot_s:.2f} s in all"
    )
    report(
        "bootstrap",
        [
            result(f"caught up, {n} engines: bootstrap from a peer", boot_s, "s", full_s),
            result("  of which: fetch the snapshot (HTTP, loopback)", fetch_s, "s", full_s),
            result("  of which: restore the index", restore_s, "s", full_s),
            result("peer: take the snapshot (applying paused)", take_s, "s"),
            result(f"caught up, {n} engines: full catch-up", full_s, "s"),
            result("snapshot size", len(snap) / 1e6, "MB"),
            result("index entries", blocks, "entries"),
        ],
    )


if __name__ == "__main__":
    main()
