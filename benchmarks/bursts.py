"""Bursts of siblings sharing a new long context: the pending overlay against none.

Real processes: ``kvevents sim serve`` (4 simulated engines whose prefill takes
``--prefill-us`` per prompt token, so a burst's siblings overlap their first one's
prefill), ``kvevents serve`` in front of them, and the burst load generator
(``kvevents loadgen --burst``).  Four configurations, each on its own fresh contexts
(another seed), the same engines:

* one service, ``--pending-weight 0`` (the overlay off: the baseline) and the default;
* two replicas taking alternate requests (exchanging their reservations over a real
  ``nats-server``), weight 0 and the default.

Reported per configuration: recomputed prompt tokens per burst (Σ prompt − cached, as
the engines reported) and the time to first token; the ratios on / off are the results.
``--weights 0.25,0.5,1`` also runs one service at each weight (how the default was
chosen).  Last, a flood of unique prompts into a pending overlay with a 16 MiB bound: the
memory its tables take (traced by ``tracemalloc``) against the bound.  ``--quick`` sends
fewer, shorter bursts and a smaller flood.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvevents.consumers.router.pending import DEFAULT_PENDING_WEIGHT  # noqa: E402
from kvevents.serve.burstgen import BurstConfig, run_bursts  # noqa: E402

ENGINES = 4


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def _stop(procs: list[subprocess.Popen[Any]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def _serve(
    engines: list[str], weight: float, nats: str | None = None, name: str | None = None
) -> tuple[subprocess.Popen[Any], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "kvevents", "serve", "--port", str(port)]
    for e in engines:
        cmd += ["--engine", e]
    cmd += ["--pending-weight", str(weight)]
    if nats:
        cmd += ["--pending-nats", nats, "--replica", name or f"r{port}"]
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL)
    return p, f"http://127.0.0.1:{port}"


def _run(urls: list[str], cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    bc = BurstConfig(urls=tuple(urls), seed=seed, **cfg)
    return asyncio.run(run_bursts(bc)).to_json()


def flood(prompts: int, keys: int, bound: int) -> tuple[float, float, int]:
    """Reserve ``prompts`` unique prompts of ``keys`` content keys each into an overlay
    bounded to ``bound`` bytes; (traced peak bytes, estimated bytes at the end,
    reservations evicted for the bound)."""
    import random
    import tracemalloc

    from kvevents.consumers import PendingOverlay

    rng = random.Random(1)
    ov = PendingOverlay(max_bytes=bound, max_entries=1 << 30)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        peak = 0
        for i in range(prompts):
            ks = [rng.getrandbits(64) for _ in range(keys)]
            ov.reserve((f"engine-{i % 16}", 0), ks)
            del ks
            if i % 256 == 255:
                peak = max(peak, tracemalloc.get_traced_memory()[0] - base)
        peak = max(peak, tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    return float(peak), float(ov.nbytes), ov.stats.evicted_for_bound


def main() -> None:
    from _common import arg_parser, report, result

    p = arg_parser(__doc__ or "")
    p.add_argument("--prefill-us", type=float, default=100.0, help="engine prefill per token")
    p.add_argument("--weights", default="", help="also one service at each of these weights")
    args = p.parse_args()
    cfg: dict[str, Any] = {
        "burst": 8,
        "bursts": 3 if args.quick else 12,
        "context_words": (600, 900) if args.quick else (2000, 6000),
        "max_tokens": 8,
    }
    rows: list[tuple[str, dict[str, Any]]] = []
    weights = [0.0, DEFAULT_PENDING_WEIGHT] + [
        float(w) for w in args.weights.split(",") if w and float(w) != DEFAULT_PENDING_WEIGHT
    ]
    plan = [(f"one service, weight {w:g}", w, 1) for w in weights] + [
        (f"two replicas, weight {w:g}", w, 2) for w in (0.0, DEFAULT_PENDING_WEIGHT)
    ]
    from kvevents.errors import ConfigError
    from kvevents.jetstream import LocalNatsServer

    nats: LocalNatsServer | None = None
    try:
        nats = LocalNatsServer().start()
    except ConfigError as exc:  # no nats-server binary: the replicas' rows are left out
        print(f"two replicas skipped: {exc}")
        plan = [row for row in plan if row[2] == 1]
    try:
        for name, w, replicas in plan:
            # fresh engines for each configuration: every one gets the same prompts
            sim = subprocess.Popen(
                [sys.executable, "-m", "kvevents", "sim", "serve", "--engines", str(ENGINES),
                 "--prefill-us-per-token", str(args.prefill_us)],
                env=_env(), stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            procs: list[subprocess.Popen[Any]] = [sim]
            try:
                assert sim.stdout is not None
                engines = [sim.stdout.readline().split(" ", 1)[1].strip() for _ in range(ENGINES)]
                urls = []
                for i in range(replicas):
                    exch = nats.url if nats is not None and replicas > 1 else None
                    svc, url = _serve(engines, w, exch, f"r{i}")
                    procs.append(svc)
                    urls.append(url)
                for url in urls:
                    _wait_ready(url)
                if replicas > 1:
                    time.sleep(0.5)  # the replicas' exchange connects in the background
                rows.append((name, _run(urls, cfg, 101)))
            finally:
                _stop(procs[1:])  # the services first: then the engines
                _stop(procs[:1])
    finally:
        if nats is not None:
            nats.close()
    print(f"{'configuration':28} {'recomputed/burst':>17} {'prompt/burst':>13} "
          f"{'engines/burst':>14} {'TTFT burst mean':>16}")  # fmt: skip
    for name, j in rows:
        ttft = j["ttft_burst_mean_s"]
        print(
            f"{name:28} {j['recomputed_per_burst']:>17.0f} {j['prompt_per_burst']:>13.0f} "
            f"{j['engines_per_burst']:>14.2f} {(ttft or 0) * 1000:>13.1f} ms"
            + (f"  errors {j['errors']}" if j["errors"] else "")
        )
    by = dict(rows)
    d = f"{DEFAULT_PENDING_WEIGHT:g}"
    results = []
    for tag in ("one service", "two replicas"):
        if f"{tag}, weight 0" not in by:
            continue
        on, off = by[f"{tag}, weight {d}"], by[f"{tag}, weight 0"]
        results.append(
            result(f"recomputed prompt tokens per burst of 8, {tag}, overlay on vs off",
                   on["recomputed_per_burst"], "tokens", off["recomputed_per_burst"])
        )  # fmt: skip
        results.append(
            result(f"TTFT burst mean, {tag}, overlay on vs off",
                   (on["ttft_burst_mean_s"] or 0) * 1000, "ms",
                   (off["ttft_burst_mean_s"] or 0) * 1000)
        )  # fmt: skip
    for name, j in rows:
        if name.startswith("one service") and name not in (
            f"one service, weight {d}",
            "one service, weight 0",
        ):
            results.append(
                result(f"recomputed prompt tokens per burst, {name} vs off",
                       j["recomputed_per_burst"], "tokens",
                       by["one service, weight 0"]["recomputed_per_burst"])
            )  # fmt: skip
    n_flood = 5_000 if args.quick else 50_000
    bound = 16 << 20
    peak, est, evicted = flood(n_flood, 256, bound)
    print(
        f"flood: {n_flood} unique 4k-token prompts into a {bound >> 20} MiB overlay: traced peak "
        f"{peak / (1 << 20):.1f} MiB, estimate {est / (1 << 20):.1f} MiB, {evicted} evicted"
    )
    results.append(
        result(f"pending overlay memory, flood of {n_flood} unique 4k-token prompts, vs its bound",
               peak / (1 << 20), "MiB", bound / (1 << 20))
    )  # fmt: skip
    report("bursts", results)


if __name__ == "__main__":
    main()
