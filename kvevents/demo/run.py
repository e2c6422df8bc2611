"""Running the demo: for each policy, fresh simulated engines behind ``kvevents serve``
on loopback, the load generator driving the workload through it, and the engines' own
counters read as ground truth.

One job: :func:`run_policy` and :func:`run_demo`.  Imports the capture writer, the demo's
config and results, the service's stack, config and load generator, and the simulated
HTTP engines (none of which needs an extra at import); httpx (the ``serve`` extra) only
when a policy runs, after :func:`run_demo` has checked the extra is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from kvevents.capture import CaptureWriter
from kvevents.demo.config import POLICIES, DemoConfig
from kvevents.demo.results import DemoReport, PolicyResult
from kvevents.demo.stack import LocalStack
from kvevents.errors import ConfigError
from kvevents.serve import require_serve_extra
from kvevents.serve.loadgen import run_loadgen
from kvevents.sim.engine import SimEngineConfig

__all__ = ["DemoFleet", "DemoWorker", "run_demo", "run_policy"]

logger = logging.getLogger(__name__)


class DemoWorker:
    """What ``on_start`` callers print about an engine: ``engine`` (the
    :class:`~kvevents.sim.engine.SimEngine`), ``endpoint`` / ``replay_endpoint`` (where
    to connect), ``engine_endpoint`` / ``engine_replay_endpoint`` (where its publisher is
    bound) and ``url`` (its HTTP front)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine.engine
        self.endpoint = engine.events_endpoint
        self.replay_endpoint = engine.replay_endpoint
        self.engine_endpoint: str = engine.publisher.endpoint
        """The address the engine's publisher is bound to (``endpoint`` is where to
        connect: a wildcard bind reads as loopback there)."""
        self.engine_replay_endpoint: str | None = engine.publisher.replay_endpoint
        self.url = engine.url


class DemoFleet:
    """The engines and the service of one policy, as ``on_start`` sees them: ``url`` (the
    service) and one :class:`DemoWorker` per engine."""

    def __init__(self, stack: Any) -> None:
        self.url = stack.url
        self.workers = [DemoWorker(e) for e in stack.engines]


def _engine_host_port(bind: str) -> tuple[str, int | None]:
    """The host and fixed PUB port asked for in ``bind`` (``tcp://HOST:P``; port 0: free
    ports)."""
    head, sep, port = bind.rpartition(":")
    if not bind.startswith("tcp://") or not sep or not port.isdigit():
        raise ConfigError(f"the demo's endpoint must be tcp://HOST:PORT, got {bind!r}")
    host = head[len("tcp://") :].strip("[]")
    return ("*" if host in ("", "*") else host), (int(port) or None)


def _wait_ready(url: str, timeout_s: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    return False


def run_policy(
    policy: str,
    config: DemoConfig,
    *,
    progress: Callable[[str, int, int], None] | None = None,
    on_start: Callable[[str, Any], None] | None = None,
    capture: CaptureWriter | None = None,
) -> PolicyResult:
    """Serve the workload with ``policy`` on fresh engines; see the module docstring.

    With ``capture``, every batch the service's subscriber receives is also written to it.
    """
    import httpx

    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    res = PolicyResult(policy)
    sim = config.sim_http()
    serve = config.serve(policy)
    n = config.engines * config.dp_ranks
    events_host, events_port = _engine_host_port(config.bind)
    with LocalStack(
        n,
        serve=serve,
        sim=sim,
        events_port=events_port,
        events_host=events_host,
        capture=capture,
    ) as stack:
        if on_start is not None:
            on_start(policy, DemoFleet(stack))
        if not _wait_ready(stack.url, config.catch_up_timeout_s):
            res.anomalies["service_not_ready"] += 1
        if config.hold_s > 0:
            time.sleep(config.hold_s)  # outside subscribers (kvevents record) join
        published0 = sum(e.engine.stats.events_published for e in stack.engines)

        def tick(done: int, total: int) -> None:
            if progress is not None:
                progress(policy, done, total)

        report = asyncio.run(run_loadgen(config.loadgen(stack.url), progress=tick))
        # the index has applied everything the engines published (for the holdings)
        deadline = time.monotonic() + config.catch_up_timeout_s
        workers: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            workers = httpx.get(stack.url + "/workers", timeout=10).json()["workers"]
            published = [e.engine.stats.batches_published for e in stack.engines]
            if all(w["batches"] >= p for w, p in zip(workers, published)):
                break
            time.sleep(0.02)
        else:
            res.anomalies["index_catch_up_timeout"] += 1
        if config.hold_s > 0:
            time.sleep(config.hold_s)  # let outside subscribers finish their replays
        lg = report.to_json()
        res.wall_s = report.wall_s
        res.requests = lg["ok"]
        res.failed = lg["failed"]
        if res.failed:
            res.anomalies["request_failed"] += res.failed
            res.anomaly_details.extend(f"{k}: {v}" for k, v in lg["errors"].items())
        res.ttft_p50_s = lg["ttft_p50_s"]
        res.ttft_p99_s = lg["ttft_p99_s"]
        res.requests_per_s = lg["requests_per_s"]
        res.reported_cached_tokens = lg["cached_tokens"]
        for w, count in lg["workers"].items():
            res.requests_per_worker[w] = count
        saved = 0
        for r in report.records:  # in the order the answers completed
            if r.ok:
                saved += r.cached_tokens or 0
                res.saved_curve.append(saved)
        for e in stack.engines:  # ground truth: what the engines reused
            st = e.engine.stats
            res.prompt_tokens += st.prompt_tokens
            res.gpu_hit_tokens += st.gpu_hit_tokens
            res.cpu_hit_tokens += st.cpu_hit_tokens
            res.computed_tokens += st.computed_tokens
        res.events = sum(e.engine.stats.events_published for e in stack.engines) - published0
        for w in workers:
            res.batches += w["batches"]
            res.predicted_exact += w["truth"]["exact"]
            res.predicted_tokens += w["predicted_cached_tokens"]
            for kind, k in w["anomalies"].items():
                res.anomalies[kind] += k
            res.anomaly_details.extend(f"{w['worker']}: {d}" for d in w["recent_anomalies"])
            res.index_holdings[w["worker"]] = {
                tier: (b["entries"], b["tokens"]) for tier, b in w["blocks"].items()
            }
    return res


def _warm_up(engine: SimEngineConfig) -> None:
    """Import what the first policy would otherwise pay for (torch, the consumers)."""
    import importlib

    names = ["kvevents.consumers", "kvevents.publishers", "kvevents.serve.app"]
    if engine.num_cpu_chunks and engine.transfers:
        names.append("kvevents.publishers.offload.transfer")
    for name in names:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def run_demo(
    config: DemoConfig | None = None,
    *,
    progress: Callable[[str, int, int], None] | None = None,
    on_start: Callable[[str, Any], None] | None = None,
) -> DemoReport:
    """Run every policy of ``config`` on the same seeded workload.  Needs the ``serve``
    extra (the engines and the service talk HTTP)."""
    require_serve_extra("kvevents demo")
    config = config or DemoConfig()
    t0 = time.perf_counter()
    notes: list[str] = []
    engine_cfg = config.engine_config()
    _warm_up(engine_cfg)
    if engine_cfg.num_cpu_chunks == 0:
        notes.append("CPU offload is off")
    capture = None
    if config.record_path:
        meta = {"recorder": "kvevents demo", "policies": list(config.policies), "seed": config.seed}
        capture = CaptureWriter(config.record_path, meta=meta, flush_every=64)
    try:
        results = [
            run_policy(p, config, progress=progress, on_start=on_start, capture=capture)
            for p in config.policies
        ]
    finally:
        if capture is not None:
            capture.close()
    return DemoReport(config, engine_cfg, results, time.perf_counter() - t0, notes)
