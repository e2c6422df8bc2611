"""The one-command demo: simulated engines behind ``kvevents serve``, driven over HTTP.

For each policy (KV-aware, KV-aware on the GPU tier only, round-robin, random)
:func:`run_demo` starts fresh simulated engines, each with an OpenAI-compatible HTTP
front and a KV-event publisher, puts ``kvevents serve`` with that policy in front of
them (its subscriber, block index and router, all on real ZMQ and HTTP on loopback), and
sends the same seeded multi-turn chat workload through the service with the load
generator (``kvevents loadgen``), so what it reports is what a user's clients would see:
requests arrive while earlier answers are still streaming, and the index routes on the
events it has received by then.

The GPU-only KV-aware router is fed only the GPU events (as routers that drop events
without tokens are: CPU offload placeholders carry none), so it cannot see what the CPU
tier holds; the difference between the two KV-aware rows is what the join is worth.

Hit rates are what the engines actually reused (ground truth, from the engines' own
counters), per tier: ``gpu_hit_tokens / prompt_tokens`` and ``cpu_hit_tokens /
prompt_tokens``.  The service checks every prediction against the ``cached_tokens`` the
engine reported (its online truth check); time to first token and throughput are the
load generator's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvevents.capture import CaptureWriter
from kvevents.errors import ConfigError
from kvevents.sim.block_pool import KVCacheGroupSpec
from kvevents.sim.engine import SimEngineConfig
from kvevents.sim.workload import SimRequest

__all__ = [
    "POLICIES",
    "POLICY_LABELS",
    "DemoConfig",
    "DemoReport",
    "PolicyResult",
    "format_report",
    "report_to_json",
    "run_demo",
    "run_policy",
    "waves",
    "write_plot",
]

logger = logging.getLogger(__name__)

POLICIES: tuple[str, ...] = ("kv-aware", "kv-aware-gpu", "round-robin", "random")
"""The routing policies the demo compares (``kv-aware-gpu``: KV-aware on GPU events only)."""

POLICY_LABELS: dict[str, str] = {"kv-aware-gpu": "kv-aware (GPU only)"}
"""How the report names a policy, where it differs from its id."""

_KV_AWARE = ("kv-aware", "kv-aware-gpu")

WorkerId = tuple[str, int]


def _default_engine() -> SimEngineConfig:
    return SimEngineConfig(
        groups=(KVCacheGroupSpec(16),),
        num_gpu_blocks=96,
        num_cpu_chunks=128,
        blocks_per_chunk=4,
        decode_tokens_per_step=16,
        max_running=8,
    )


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs.  ``engine=None`` picks the default shape: one group of
    16-token blocks, 96 GPU blocks and 128 CPU chunks of 4 blocks per engine (small
    enough that placement matters).  ``wave`` is how many requests arrive between two
    catch-ups of the index.  ``bind`` is the engines' PUB endpoint (see
    :class:`~kvevents.sim.cluster.ClusterConfig`; a fixed port lets ``kvevents record``
    follow the engines).  ``hold_s`` keeps each policy's engines up that many seconds
    before routing starts and after it ends, so outside subscribers have time to
    connect (ZMQ retries a refused connection only every ~100 ms) and to fetch replays.
    ``device`` holds the engines' simulated KV cache (``"cuda"`` moves the offload copies
    through CUDA streams and pinned host memory).  ``record_path`` writes every batch the
    service's subscriber receives to a capture file (all policies, each its own engines).
    ``concurrency`` is how many requests the load generator keeps in flight;
    ``step_s`` / ``prefill_s_per_token`` the simulated engines' timing (100 µs per prompt
    token computed: 10k tokens/s of prefill, so reuse shows in time to first token); with
    ``dp_ranks`` > 1 every rank is its own simulated engine with its own HTTP front;
    ``load_tokens`` is the service's price of a request in flight (``--load-tokens``)."""

    engines: int = 4
    requests: int = 320
    seed: int = 0
    concurrency: int = 8
    dp_ranks: int = 1
    tenants: int = 4
    concurrent_sessions: int = 16
    policies: tuple[str, ...] = POLICIES
    engine: SimEngineConfig | None = None
    catch_up_timeout_s: float = 20.0
    bind: str = "tcp://127.0.0.1:0"
    hold_s: float = 0.0
    device: str = "cpu"
    record_path: str | None = None
    step_s: float = 0.002
    prefill_s_per_token: float = 1e-4
    load_tokens: float = 64.0

    @classmethod
    def quick(cls, **overrides: Any) -> DemoConfig:
        """A seconds-long run (fewer engines and requests)."""
        base = cls(engines=3, requests=72, concurrent_sessions=9, tenants=3, concurrency=6)
        return replace(base, **overrides)

    def engine_config(self) -> SimEngineConfig:
        """The engine shape: :attr:`engine`, else the default, on :attr:`device`."""
        base = self.engine or _default_engine()
        return base if self.device == "cpu" else replace(base, device=self.device)

    def loadgen(self, url: str) -> Any:
        """The load generator's configuration against ``url``."""
        from kvevents.serve.loadgen import LoadgenConfig

        return LoadgenConfig(
            url,
            requests=self.requests,
            tenants=self.tenants,
            sessions=self.concurrent_sessions,
            concurrency=self.concurrency,
            seed=self.seed,
        )


@dataclass
class PolicyResult:
    """What one policy achieved on the workload (tokens are prompt tokens)."""

    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    computed_tokens: int = 0
    predicted_tokens: int = 0
    predicted_exact: int = 0
    batches: int = 0
    events: int = 0
    wall_s: float = 0.0
    """Seconds spent routing and serving the workload (after start-up)."""
    consume_s: float = 0.0
    anomalies: Counter[str] = field(default_factory=Counter)
    anomaly_details: list[str] = field(default_factory=list)
    requests_per_worker: Counter[str] = field(default_factory=Counter)
    saved_curve: list[int] = field(default_factory=list)
    index_holdings: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    """What the index held at the end: per ``source#rank`` and tier, (entries, tokens)."""
    reported_cached_tokens: int = 0
    """Σ ``cached_tokens`` the engines reported to the clients."""
    failed: int = 0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    requests_per_s: float = 0.0

    @property
    def tokens_saved(self) -> int:
        return self.gpu_hit_tokens + self.cpu_hit_tokens

    def rate(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens reused from any tier."""
        return self.rate(self.tokens_saved)

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class DemoReport:
    """All policies' results, with the configuration that produced them."""

    config: DemoConfig
    engine: SimEngineConfig
    results: list[PolicyResult]
    wall_s: float
    notes: list[str] = field(default_factory=list)

    def result(self, policy: str) -> PolicyResult:
        for r in self.results:
            if r.policy == policy:
                return r
        raise KeyError(policy)


def waves(requests: Sequence[SimRequest], size: int) -> list[list[SimRequest]]:
    """Split arrivals into waves of at most ``size``; a wave never holds two turns of one
    session (the later turn waits for the earlier answer)."""
    out: list[list[SimRequest]] = []
    cur: list[SimRequest] = []
    sessions: set[int] = set()
    for r in requests:
        if len(cur) >= size or r.session in sessions:
            out.append(cur)
            cur, sessions = [], set()
        cur.append(r)
        sessions.add(r.session)
    if cur:
        out.append(cur)
    return out


class _DemoWorker:
    """What ``on_start`` callers print about an engine (name, endpoints)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine.engine
        self.endpoint = engine.events_endpoint
        self.replay_endpoint = engine.replay_endpoint
        self.engine_endpoint: str = engine.publisher.endpoint
        """The address the engine's publisher is bound to (``endpoint`` is where to
        connect: a wildcard bind reads as loopback there)."""
        self.engine_replay_endpoint: str | None = engine.publisher.replay_endpoint
        self.url = engine.url


class _DemoFleet:
    """The engines and the service of one policy, as ``on_start`` sees them."""

    def __init__(self, stack: Any) -> None:
        self.url = stack.url
        self.workers = [_DemoWorker(e) for e in stack.engines]


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
    import asyncio

    import httpx

    from kvevents.serve.config import ServeConfig
    from kvevents.serve.loadgen import run_loadgen
    from kvevents.serve.stack import LocalStack
    from kvevents.sim.http import SimHTTPConfig

    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    engine_cfg = config.engine_config()
    res = PolicyResult(policy)
    sim = SimHTTPConfig(
        engine=engine_cfg, step_s=config.step_s, prefill_s_per_token=config.prefill_s_per_token
    )
    serve = ServeConfig(
        policy=policy,
        blocks_per_chunk=engine_cfg.blocks_per_chunk,
        seed=config.seed,
        scrape_interval_s=0.25,
        load_tokens=config.load_tokens,
    )
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
            on_start(policy, _DemoFleet(stack))
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
    from kvevents.serve import require_serve_extra

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


def format_report(report: DemoReport) -> str:
    """The demo's comparison as a text table."""
    cfg, eng = report.config, report.engine
    sizes = "/".join(str(g.block_size) for g in eng.groups)
    cpu = (
        f"CPU {eng.num_cpu_chunks} chunks x {eng.blocks_per_chunk} blocks ({eng.cpu_cache_policy})"
        if eng.num_cpu_chunks
        else "no CPU tier"
    )
    lines = [
        f"kvevents demo: {cfg.engines} engines x {cfg.dp_ranks} DP rank(s), GPU {eng.num_gpu_blocks} "
        f"blocks of {sizes} tokens, {cpu}"
        + (f", KV on {eng.device}" if eng.device != "cpu" else ""),
        f"workload: {cfg.requests} chat requests over HTTP through kvevents serve, "
        f"{cfg.tenants} tenants with shared system prompts, {cfg.concurrent_sessions} "
        f"conversations open at once, {cfg.concurrency} requests in flight, seed {cfg.seed}",
        "",
    ]
    header = (
        f"{'policy':<20} {'GPU hit':>8} {'CPU hit':>8} {'total':>7} {'tokens saved':>13} "
        f"{'prefilled':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'req/s':>6} {'events/s':>9} "
        f"{'anomalies':>9}"
    )
    lines += [header, "-" * len(header)]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    for r in report.results:
        lines.append(
            f"{POLICY_LABELS.get(r.policy, r.policy):<20} {r.rate(r.gpu_hit_tokens):>8.1%} "
            f"{r.rate(r.cpu_hit_tokens):>8.1%} {r.hit_rate:>7.1%} {r.tokens_saved:>13,} "
            f"{r.computed_tokens:>10,} {ms(r.ttft_p50_s):>9} {ms(r.ttft_p99_s):>9} "
            f"{r.requests_per_s:>6.1f} {r.events_per_s:>9,.0f} {sum(r.anomalies.values()):>9}"
        )
    lines.append("")
    names = [r.policy for r in report.results]
    if "kv-aware" in names and "round-robin" in names:
        kv, rr = report.result("kv-aware"), report.result("round-robin")
        if rr.computed_tokens:
            lines.append(
                f"KV-aware routing reused {kv.hit_rate:.1%} of prompt tokens vs {rr.hit_rate:.1%} "
                f"for round-robin: {rr.computed_tokens / max(kv.computed_tokens, 1):.2f}x fewer "
                "tokens to prefill."
            )
    if "kv-aware" in names and "kv-aware-gpu" in names:
        kv, gpu = report.result("kv-aware"), report.result("kv-aware-gpu")
        lines.append(
            f"Seeing the CPU tier (GPU and CPU events joined) reused {kv.hit_rate:.1%} vs "
            f"{gpu.hit_rate:.1%} for a router fed GPU events only."
        )
    for policy in _KV_AWARE:
        if policy in names:
            kv = report.result(policy)
            if kv.requests:
                lines.append(
                    f"Router prediction ({POLICY_LABELS.get(policy, policy)}, index built from "
                    f"the event stream at arrival) matched the cached_tokens the engine "
                    f"reported exactly for {kv.predicted_exact}/{kv.requests} requests."
                )
    for r in report.results:
        if r.anomalies:
            kinds = ", ".join(f"{k} x{n}" for k, n in sorted(r.anomalies.items()))
            lines.append(f"anomalies ({r.policy}): {kinds}")
            lines.extend(f"  {d}" for d in r.anomaly_details)
    if not any(r.anomalies for r in report.results):
        lines.append("anomalies: none (no seq gaps, losses or restarts)")
    lines.extend(f"note: {n}" for n in report.notes)
    lines.append(f"total wall time {report.wall_s:.1f} s")
    return "\n".join(lines)


def report_to_json(report: DemoReport) -> dict[str, Any]:
    """The report as a JSON-ready dict (rates are fractions, times seconds)."""
    policies = []
    for r in report.results:
        policies.append(
            {
                "policy": r.policy,
                "requests": r.requests,
                "prompt_tokens": r.prompt_tokens,
                "gpu_hit_tokens": r.gpu_hit_tokens,
                "cpu_hit_tokens": r.cpu_hit_tokens,
                "computed_tokens": r.computed_tokens,
                "tokens_saved": r.tokens_saved,
                "gpu_hit_rate": r.rate(r.gpu_hit_tokens),
                "cpu_hit_rate": r.rate(r.cpu_hit_tokens),
                "hit_rate": r.hit_rate,
                "predicted_exact": r.predicted_exact,
                "reported_cached_tokens": r.reported_cached_tokens,
                "failed": r.failed,
                "ttft_p50_s": r.ttft_p50_s,
                "ttft_p99_s": r.ttft_p99_s,
                "requests_per_s": r.requests_per_s,
                "batches": r.batches,
                "events": r.events,
                "events_per_s": r.events_per_s,
                "wall_s": r.wall_s,
                "anomalies": dict(r.anomalies),
                "anomaly_details": list(r.anomaly_details),
                "requests_per_worker": dict(r.requests_per_worker),
            }
        )
    cfg, eng = report.config, report.engine
    return {
        "engines": cfg.engines,
        "dp_ranks": cfg.dp_ranks,
        "requests": cfg.requests,
        "concurrency": cfg.concurrency,
        "seed": cfg.seed,
        "engine": {
            "block_sizes": [g.block_size for g in eng.groups],
            "num_gpu_blocks": eng.num_gpu_blocks,
            "num_cpu_chunks": eng.num_cpu_chunks,
            "blocks_per_chunk": eng.blocks_per_chunk,
            "cpu_cache_policy": eng.cpu_cache_policy,
            "device": eng.device,
        },
        "policies": policies,
        "wall_s": report.wall_s,
        "notes": list(report.notes),
    }


def write_plot(report: DemoReport, path: str) -> str | None:
    """Write a PNG comparing the policies; returns ``None`` on success, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvevents[demo]')"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    names = [POLICY_LABELS.get(r.policy, r.policy).replace(" (", "\n(") for r in report.results]
    gpu = [100 * r.rate(r.gpu_hit_tokens) for r in report.results]
    cpu = [100 * r.rate(r.cpu_hit_tokens) for r in report.results]
    ax1.bar(names, gpu, label="GPU hit", color="#3b75af")
    ax1.bar(names, cpu, bottom=gpu, label="CPU hit", color="#9ecae9")
    for i, r in enumerate(report.results):
        ax1.text(i, gpu[i] + cpu[i] + 1, f"{r.hit_rate:.0%}", ha="center")
    ax1.set_ylabel("prompt tokens reused (%)")
    ax1.set_ylim(0, 100)
    ax1.set_title("prefix-cache hit rate by tier")
    ax1.legend(loc="upper right")
    for r in report.results:
        label = POLICY_LABELS.get(r.policy, r.policy)
        ax2.plot(range(1, len(r.saved_curve) + 1), r.saved_curve, label=label)
    ax2.set_xlabel("requests routed")
    ax2.set_ylabel("prompt tokens saved (cumulative)")
    ax2.set_title("tokens saved over the workload")
    ax2.legend(loc="upper left")
    cfg = report.config
    fig.suptitle(f"kvevents demo: {cfg.engines} engines, {cfg.requests} requests, seed {cfg.seed}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
