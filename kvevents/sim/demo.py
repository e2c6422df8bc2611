"""The one-command demo: simulated engines, the subscriber, the index and the router.

For each policy (KV-aware, KV-aware on the GPU tier only, round-robin, random)
:func:`run_demo` starts fresh engines on loopback, subscribes to all of them, feeds every
received batch into a ``BlockIndex`` on a consumer thread and routes the same seeded
workload.  The GPU-only KV-aware router is fed only the GPU events (as routers that drop
events without tokens are: CPU offload placeholders carry none), so it cannot see what the
CPU tier holds; the difference between the two KV-aware rows is what the join is worth.  Requests arrive in waves (a
session never has two turns in one wave, as a chat waits for its answer); after each
wave the engines run until idle and the index catches up with everything they
published, so the KV-aware router always routes on the index's view of real events.

Hit rates are what the engines actually reused (ground truth), per tier:
``gpu_hit_tokens / prompt_tokens`` and ``cpu_hit_tokens / prompt_tokens``.  For the
KV-aware policy the router's predicted match for its chosen worker is compared with
what that engine then reused.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvevents.capture import CaptureWriter
from kvevents.errors import ConfigError
from kvevents.sim.block_pool import KVCacheGroupSpec
from kvevents.sim.cluster import ClusterConfig, SimCluster
from kvevents.sim.engine import RequestResult, SimEngineConfig
from kvevents.sim.workload import SimRequest, WorkloadConfig, generate_workload

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
    demo's subscriber receives to a capture file (all policies, each its own engines)."""

    engines: int = 4
    requests: int = 320
    seed: int = 0
    wave: int = 8
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

    @classmethod
    def quick(cls, **overrides: Any) -> DemoConfig:
        """A seconds-long run (fewer engines and requests)."""
        base = cls(engines=3, requests=72, concurrent_sessions=9, tenants=3, wave=6)
        return replace(base, **overrides)

    def engine_config(self) -> SimEngineConfig:
        """The engine shape: :attr:`engine`, else the default, on :attr:`device`."""
        base = self.engine or _default_engine()
        return base if self.device == "cpu" else replace(base, device=self.device)

    def workload(self) -> WorkloadConfig:
        return WorkloadConfig(
            num_requests=self.requests,
            num_tenants=self.tenants,
            concurrent_sessions=self.concurrent_sessions,
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


class _Consumer:
    """Subscriber → BlockIndex on a thread; knows the last seq applied per worker."""

    def __init__(
        self,
        cluster: SimCluster,
        engine: SimEngineConfig,
        capture: CaptureWriter | None,
        *,
        gpu_only: bool = False,
    ) -> None:
        from kvevents.consumers import BlockIndex, Router, Subscriber

        self.capture = capture
        self.gpu_only = gpu_only
        self.lock = threading.Lock()
        self.subscriber = Subscriber(
            cluster.endpoints,
            replay_endpoints=cluster.replay_endpoints,
        )
        self.index = BlockIndex(blocks_per_chunk=engine.blocks_per_chunk)
        self.router = Router(self.index)
        self.last_seq: dict[WorkerId, int] = {}
        self.events = 0
        self.batches = 0
        self.busy_s = 0.0
        self.anomalies: Counter[str] = Counter()
        self.anomaly_details: list[str] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name="kvevents-demo-consumer", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # surfaced to the routing thread by wait_for()
            logger.exception("demo consumer failed")
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def _loop(self) -> None:
        from kvevents.consumers import Anomaly, ReceivedBatch

        while not self._stop.is_set():
            item = self.subscriber.receive(timeout=0.05)
            if item is None:
                continue
            t0 = time.perf_counter()
            if isinstance(item, ReceivedBatch):
                wid = (item.source, item.dp_rank)
                if self.capture is not None:
                    self.capture.write(
                        item.source,
                        item.topic,
                        item.seq,
                        item.payload,
                        recv_ts=item.recv_ts,
                        replayed=item.replayed,
                    )
                batch = _gpu_events(item.batch) if self.gpu_only else item.batch
                with self.lock:
                    self.index.apply(item.source, item.dp_rank, batch)
                self.batches += 1
                self.events += len(item.batch.events)
                with self._cond:
                    self.last_seq[wid] = max(self.last_seq.get(wid, -1), item.seq)
                    self._cond.notify_all()
            elif isinstance(item, Anomaly):
                self.anomalies[item.kind] += 1
                rank = "?" if item.dp_rank is None else item.dp_rank
                self.anomaly_details.append(f"{item.kind} {item.source}#{rank}: {item.detail}")
                if item.needs_reset and item.dp_rank is not None:
                    with self.lock:
                        self.index.reset_worker((item.source, item.dp_rank))
            self.busy_s += time.perf_counter() - t0

    def seen(self, wid: WorkerId) -> bool:
        with self._cond:
            return wid in self.last_seq

    def wait_for(self, targets: dict[WorkerId, int], timeout_s: float) -> bool:
        """Wait until every worker's applied seq reaches its target."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self.error is not None:
                    raise RuntimeError(f"the demo's consumer thread failed: {self.error}")
                if all(self.last_seq.get(w, -1) >= s for w, s in targets.items()):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.subscriber.close()


def _gpu_events(batch: Any) -> Any:
    """The batch without its CPU/STORAGE events (``medium`` ``None`` is GPU, ≤0.10)."""
    from kvevents.events import MEDIUM_GPU, KVEventBatch

    events = [e for e in batch.events if getattr(e, "medium", None) in (None, MEDIUM_GPU)]
    if len(events) == len(batch.events):
        return batch
    return KVEventBatch(batch.ts, events, batch.data_parallel_rank)


def run_policy(
    policy: str,
    requests: Sequence[SimRequest],
    config: DemoConfig,
    *,
    progress: Callable[[str, int, int], None] | None = None,
    on_start: Callable[[str, SimCluster], None] | None = None,
    capture: CaptureWriter | None = None,
) -> PolicyResult:
    """Route ``requests`` with ``policy`` on fresh engines; see the module docstring.

    With ``capture``, every batch the demo's subscriber receives is also written to it.
    """
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    engine_cfg = config.engine_config()
    res = PolicyResult(policy)
    rng = random.Random(config.seed ^ 0x5EED)
    cluster = SimCluster(
        ClusterConfig(
            num_engines=config.engines,
            dp_ranks=config.dp_ranks,
            engine=engine_cfg,
            bind=config.bind,
        )
    )
    consumer: _Consumer | None = None
    try:
        if on_start is not None:
            on_start(policy, cluster)
        consumer = _Consumer(cluster, engine_cfg, capture, gpu_only=policy == "kv-aware-gpu")
        if config.hold_s > 0:
            time.sleep(config.hold_s)  # outside subscribers (kvevents record) join
        missing = cluster.announce(consumer.seen)
        for wid in missing:
            res.anomalies["worker_not_connected"] += 1
            logger.warning("demo: no batch from %s#%d reached the subscriber", *wid)
        workers = [w.worker_id for w in cluster.workers]
        t0 = time.perf_counter()  # events/s covers routing and serving, not start-up
        events_before = consumer.events
        predicted: dict[str, int] = {}
        rr = 0
        done = 0
        for wave in waves(requests, config.wave):
            loads: dict[WorkerId, float] = dict.fromkeys(workers, 0.0)
            for r in wave:
                if policy in _KV_AWARE:
                    with consumer.lock:
                        sel = consumer.router.select(list(r.prompt), loads=loads)
                        wid = (str(sel[0]), int(sel[1]))
                        match = consumer.router.find_matches(list(r.prompt)).get(wid)
                    if match is not None:
                        predicted[r.request_id] = int(match.gpu) + int(match.cpu)
                elif policy == "round-robin":
                    wid = workers[rr % len(workers)]
                    rr += 1
                else:
                    wid = rng.choice(workers)
                w = cluster.worker(wid)
                w.engine.add_request(r)
                loads[w.worker_id] += len(r.prompt)
                res.requests_per_worker[w.engine.name] += 1
            cluster.run_until_idle()
            targets = {w.worker_id: w.engine.stats.batches_published - 1 for w in cluster.workers}
            if not consumer.wait_for(targets, config.catch_up_timeout_s):
                res.anomalies["index_catch_up_timeout"] += 1
            done += len(wave)
            if progress is not None:
                progress(policy, done, len(requests))
        by_id: dict[str, RequestResult] = {}
        for w in cluster.workers:
            for rr_res in w.engine.results:
                by_id[rr_res.request_id] = rr_res
        saved = 0
        for r in requests:
            got = by_id.get(r.request_id)
            if got is None:
                res.anomalies["request_not_finished"] += 1
                continue
            res.requests += 1
            res.prompt_tokens += got.prompt_tokens
            res.gpu_hit_tokens += got.gpu_hit_tokens
            res.cpu_hit_tokens += got.cpu_hit_tokens
            res.computed_tokens += got.computed_tokens
            saved += got.gpu_hit_tokens + got.cpu_hit_tokens
            res.saved_curve.append(saved)
            if r.request_id in predicted:
                p = predicted[r.request_id]
                res.predicted_tokens += p
                if p == got.gpu_hit_tokens + got.cpu_hit_tokens:
                    res.predicted_exact += 1
        res.wall_s = time.perf_counter() - t0
        if config.hold_s > 0:
            time.sleep(config.hold_s)  # let outside subscribers finish their replays
        res.batches = consumer.batches
        res.events = consumer.events - events_before
        res.consume_s = consumer.busy_s
        res.anomalies.update(consumer.anomalies)
        res.anomaly_details.extend(consumer.anomaly_details)
        with consumer.lock:
            res.index_holdings = _index_holdings(consumer.index)
    finally:
        if consumer is not None:
            consumer.close()
        cluster.close()
    return res


def _index_holdings(index: Any) -> dict[str, dict[str, tuple[int, int]]]:
    """Per worker (``source#rank``) and tier: (entries, tokens) the index holds."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for wid, ws in index.summary().items():
        out[f"{wid[0]}#{wid[1]}"] = {t: (s.entries, s.tokens) for t, s in ws.tiers.items()}
    return out


def _warm_up(engine: SimEngineConfig) -> None:
    """Import what the first policy would otherwise pay for (torch, the consumers)."""
    import importlib

    names = ["kvevents.consumers", "kvevents.publishers"]
    if engine.num_cpu_chunks and engine.transfers:
        names.append("kvevents.publishers.offload.transfer")
    for name in names:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def run_demo(
    config: DemoConfig | None = None,
    *,
    progress: Callable[[str, int, int], None] | None = None,
    on_start: Callable[[str, SimCluster], None] | None = None,
) -> DemoReport:
    """Run every policy of ``config`` on the same seeded workload."""
    config = config or DemoConfig()
    t0 = time.perf_counter()
    requests = generate_workload(config.workload())
    notes: list[str] = []
    engine_cfg = config.engine_config()
    _warm_up(engine_cfg)
    if engine_cfg.num_cpu_chunks == 0:
        notes.append("CPU offload is off (kvevents.publishers.offload is not available)")
    capture = None
    if config.record_path:
        meta = {"recorder": "kvevents demo", "policies": list(config.policies), "seed": config.seed}
        capture = CaptureWriter(config.record_path, meta=meta, flush_every=64)
    try:
        results = [
            run_policy(p, requests, config, progress=progress, on_start=on_start, capture=capture)
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
        f"workload: {cfg.requests} requests, {cfg.tenants} tenants with shared system prompts, "
        f"{cfg.concurrent_sessions} concurrent chat sessions, seed {cfg.seed}",
        "",
    ]
    header = (
        f"{'policy':<20} {'GPU hit':>8} {'CPU hit':>8} {'total':>7} {'tokens saved':>13} "
        f"{'prefilled':>10} {'events':>8} {'events/s':>9} {'anomalies':>9}"
    )
    lines += [header, "-" * len(header)]
    for r in report.results:
        lines.append(
            f"{POLICY_LABELS.get(r.policy, r.policy):<20} {r.rate(r.gpu_hit_tokens):>8.1%} {r.rate(r.cpu_hit_tokens):>8.1%} "
            f"{r.hit_rate:>7.1%} {r.tokens_saved:>13,} {r.computed_tokens:>10,} {r.events:>8,} "
            f"{r.events_per_s:>9,.0f} {sum(r.anomalies.values()):>9}"
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
                    f"the event stream at arrival) matched the engine's actual reuse exactly "
                    f"for {kv.predicted_exact}/{kv.requests} requests."
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
