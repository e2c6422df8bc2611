"""``kvevents serve``: routing overhead per request and requests/s, against calling the
engine directly in the same run.

Three processes on loopback: a stub engine (a minimal ASGI app on uvicorn that answers
every completion with the same small JSON body, ``/metrics`` with vLLM's gauges and
``/v1/models``), the service, and this script as the client.  The service fronts 64
engines whose HTTP URLs all point at the stub; their indexes are filled in process with
synthetic GPU and CPU events (each engine holds a random-length prefix of one of 8
8k-token prompts on GPU, the following chunks on CPU), so every request is scored over
64 engines' indexes.

* ``latency``: sequential requests with an 8,192-token prompt (token ids, so no
  tokeniser call), p50 and p99, through the service and straight to the stub.  The
  overhead is the difference.  ``routing decision`` is the service's own time from
  request to chosen engine (JSON parse, key, score over 64 engines), from its
  ``kvevents_serve_routing_overhead_seconds`` histogram (bucket upper bounds).
* ``requests/s``: 32 concurrent clients for a few seconds, through the service and
  straight to the stub.

The service freezes its startup heap as ``kvevents serve`` does (``--no-freeze``: it
does not, for an A/B).  Run: ``python benchmarks/serve.py [--quick] [--no-freeze]``.
The machine is shared: figures carry scheduling noise.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ENGINES = 64
PROMPT_TOKENS = 8192
FAMILIES = 8
BS = 16
BPC = 4


# --- the stub engine ------------------------------------------------------------------------
def stub_app() -> Any:
    body = json.dumps(
        {
            "id": "cmpl-stub",
            "object": "text_completion",
            "created": 0,
            "model": "stub",
            "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": PROMPT_TOKENS,
                "completion_tokens": 1,
                "total_tokens": PROMPT_TOKENS + 1,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
    ).encode()
    metrics = (
        b'vllm:num_requests_running{engine="0"} 0.0\n'
        b'vllm:num_requests_waiting{engine="0"} 0.0\n'
        b'vllm:kv_cache_usage_perc{engine="0"} 0.0\n'
    )
    models = b'{"object":"list","data":[{"id":"stub","object":"model","parent":null}]}'

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while True:  # drain the body
            msg = await receive()
            if not msg.get("more_body"):
                break
        path = scope["path"]
        out = metrics if path == "/metrics" else models if path == "/v1/models" else body
        ctype = b"text/plain" if path == "/metrics" else b"application/json"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", ctype)]})  # fmt: skip
        await send({"type": "http.response.body", "body": out})

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_stub(port: int) -> None:
    import uvicorn

    uvicorn.run(stub_app(), host="127.0.0.1", port=port, log_level="error", access_log=False)


# --- the service, with synthetic indexes -------------------------------------------------------
def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 50_000) for _ in range(PROMPT_TOKENS)] for _ in range(FAMILIES)]


def fill_index(service: Any, seed: int = 0) -> int:
    """Each engine holds a random-length prefix of one prompt family on GPU and the next
    chunks on CPU.  Returns the blocks stored."""
    from kvevents.events import BlockStored, KVEventBatch

    rng = random.Random(seed + 1)
    fams = prompts(seed)
    n = 0
    fleet = service.fleet
    for st in fleet.ranks:
        toks = fams[rng.randrange(FAMILIES)]
        blocks = PROMPT_TOKENS // BS
        gpu = rng.randrange(1, blocks)
        cpu = min(blocks, gpu + BPC * rng.randrange(0, 16))
        hashes = [rng.getrandbits(63) for _ in range(blocks)]
        events: list[Any] = [
            BlockStored(hashes[:cpu], None, toks[: cpu * BS], BS, None, "GPU", None,
                        group_idx=0, kv_cache_spec_kind="full_attention")
        ]  # fmt: skip
        events += [
            BlockStored([hashes[i]], None, [], 0, None, "CPU", None, group_idx=0)
            for i in range(BPC - 1, cpu, BPC)
        ]
        from kvevents.events import BlockRemoved

        events.append(BlockRemoved(hashes[gpu:cpu], "GPU", group_idx=0))
        with fleet.lock:
            fleet.index.apply(st.source, st.rank, KVEventBatch(0.0, events))
        n += cpu
    return n


def run_service(stub_port: int, port: int, freeze: bool = True) -> None:
    import uvicorn

    from kvevents.serve.app import ServeApp
    from kvevents.serve.commands import freeze_startup_heap
    from kvevents.serve.config import ServeConfig, parse_engine_spec

    # events endpoints where nothing publishes: the indexes are filled here instead
    specs = tuple(
        parse_engine_spec(f"e{i}=http://127.0.0.1:{stub_port},tcp://127.0.0.1:{free_port()}")
        for i in range(ENGINES)
    )
    service = ServeApp(ServeConfig(engines=specs, blocks_per_chunk=BPC, scrape_interval_s=1.0))
    if freeze:  # as ``kvevents serve`` does once the service is built
        freeze_startup_heap()
    fill_index(service)
    print("filled", flush=True)
    uvicorn.run(service.app, host="127.0.0.1", port=port, log_level="error", access_log=False)


# --- the client ---------------------------------------------------------------------------------
def wait_http(url: str, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url + "/v1/models", timeout=2)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def sequential(url: str, bodies: list[bytes]) -> list[float]:
    import httpx

    out = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for b in bodies[:5]:
            c.post("/v1/completions", content=b)  # warm up
        for b in bodies:
            t0 = time.perf_counter()
            r = c.post("/v1/completions", content=b)
            out.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    return out


async def _throughput(url: str, bodies: list[bytes], seconds: float, conc: int) -> float:
    import httpx

    done = 0
    stop = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as c:

        async def worker(k: int) -> None:
            nonlocal done
            i = k
            while time.perf_counter() < stop:
                r = await c.post("/v1/completions", content=bodies[i % len(bodies)])
                assert r.status_code == 200
                done += 1
                i += conc

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(conc)))
        return done / (time.perf_counter() - t0)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def routing_overhead_from_metrics(url: str) -> tuple[float, float]:
    """p50/p99 upper bucket bounds of the service's routing overhead histogram."""
    import httpx

    text = httpx.get(url + "/metrics").text
    buckets = [
        (float(m.group(1)), float(m.group(2)))
        for m in re.finditer(
            r'kvevents_serve_routing_overhead_seconds_bucket\{le="([^"]+)"\} (\S+)', text
        )
    ]
    total = buckets[-1][1]

    def q(p: float) -> float:
        for le, n in buckets:
            if n >= p * total:
                return le
        return float("inf")

    return q(0.5), q(0.99)


def main() -> None:
    from _common import arg_parser, report, result

    p = arg_parser(__doc__ or "")
    p.add_argument(
        "--no-freeze",
        action="store_true",
        help="the service skips the gc.freeze() that kvevents serve does at start (an A/B)",
    )
    args = p.parse_args()
    n = 40 if args.quick else 400
    seconds = 1.5 if args.quick else 6.0
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    stub_port, service_port = free_port(), free_port()
    me = str(Path(__file__).resolve())
    stub = subprocess.Popen([sys.executable, me, "--role", "stub", str(stub_port)], env=env)
    service = subprocess.Popen(
        [sys.executable, me, "--role", "service", str(stub_port), str(service_port)]
        + (["no-freeze"] if args.no_freeze else []),
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        stub_url = f"http://127.0.0.1:{stub_port}"
        serve_url = f"http://127.0.0.1:{service_port}"
        assert service.stdout is not None
        assert service.stdout.readline().strip() == "filled"
        wait_http(stub_url)
        wait_http(serve_url)
        rng = random.Random(7)
        fams = prompts()
        bodies = []
        for _ in range(max(n, 64)):
            toks = list(fams[rng.randrange(FAMILIES)])
            toks[-rng.randrange(1, 2048) :] = [rng.randrange(1, 50_000)] * 1  # a new tail
            toks = (toks + [rng.randrange(1, 50_000) for _ in range(PROMPT_TOKENS)])[:PROMPT_TOKENS]
            bodies.append(json.dumps({"prompt": toks, "max_tokens": 1}).encode())
        direct = sequential(stub_url, bodies[:n])
        via = sequential(serve_url, bodies[:n])
        ro50, ro99 = routing_overhead_from_metrics(serve_url)
        rps_direct = asyncio.run(_throughput(stub_url, bodies, seconds, 32))
        rps_via = asyncio.run(_throughput(serve_url, bodies, seconds, 32))
    finally:
        for p in (service, stub):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    ms = 1000.0
    tag = f"{PROMPT_TOKENS // 1024}k-token prompt, {ENGINES} engines"
    results = [
        result(f"latency p50 via serve ({tag}) vs direct", pct(via, 0.5) * ms, "ms", pct(direct, 0.5) * ms),
        result(f"latency p99 via serve ({tag}) vs direct", pct(via, 0.99) * ms, "ms", pct(direct, 0.99) * ms),
        result("overhead p50 (via - direct)", (pct(via, 0.5) - pct(direct, 0.5)) * ms, "ms"),
        result("overhead p99 (via - direct)", (pct(via, 0.99) - pct(direct, 0.99)) * ms, "ms"),
        result("routing decision p50 (histogram bound)", ro50 * ms, "ms"),
        result("routing decision p99 (histogram bound)", ro99 * ms, "ms"),
        result("requests/s via serve, 32 clients, vs direct", rps_via, "req/s", rps_direct),
    ]  # fmt: skip
    report("serve", results)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        if sys.argv[2] == "stub":
            run_stub(int(sys.argv[3]))
        else:
            run_service(int(sys.argv[3]), int(sys.argv[4]), freeze="no-freeze" not in sys.argv)
    else:
        main()
