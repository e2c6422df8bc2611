"""The router's prediction equals what the engine then reuses, for every engine shape.

For each configuration two simulated engines publish on real ZMQ sockets; a subscriber
thread feeds every batch into a ``BlockIndex``.  A seeded chat workload (shared system
prompts, multi-turn sessions, a pool small enough to evict, a CPU tier small enough to
evict) arrives in waves; each session sticks to one engine.  Right before an engine looks
a request up for admission it publishes what it changed so far; the test then waits until
the index has applied every batch that engine published, asks the router for the
request's key on that engine, and compares the answer with the engine's own lookup:
``Match(gpu, cpu)`` must equal the engine's ``(gpu_hit_tokens, cpu_hit_tokens)`` for every
admission (readmissions after preemption included).  100% exact is the bar.

The engine follows vLLM 0.33's rules independently of the router (``kvevents.sim``), so a
rule either side gets wrong shows up here as a mismatch.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvevents.consumers import BlockIndex, ReceivedBatch, Router, Subscriber
from kvevents.demo import waves
from kvevents.request import RequestKey
from kvevents.sim import (
    ClusterConfig,
    KVCacheGroupSpec,
    SimCluster,
    SimEngine,
    SimEngineConfig,
    SimRequest,
    WorkloadConfig,
    generate_workload,
)

WorkerId = tuple[str, int]

FA16 = KVCacheGroupSpec(16)


@dataclass(frozen=True)
class Case:
    """One engine shape and the workload that exercises it."""

    engine: SimEngineConfig
    workload: WorkloadConfig
    speculative: dict[str, Any] = field(default_factory=dict)
    """What the wire does not say, told to the index (EAGLE modes: ``BlockIndex``'s
    ``lookahead_tokens`` / ``eagle_drop``)."""


def _workload(**kw: Any) -> WorkloadConfig:
    base: dict[str, Any] = dict(
        num_requests=300,
        num_tenants=3,
        concurrent_sessions=8,
        system_prompt_tokens=(96, 200),
        first_message_tokens=(8, 60),
        followup_message_tokens=(5, 40),
        output_tokens=(8, 40),
        turns_per_session=(2, 5),
        seed=11,
    )
    base.update(kw)
    return WorkloadConfig(**base)


def _engine(**kw: Any) -> SimEngineConfig:
    base: dict[str, Any] = dict(
        groups=(FA16,),
        num_gpu_blocks=56,
        num_cpu_chunks=160,
        blocks_per_chunk=1,
        decode_tokens_per_step=8,
        max_running=4,
        transfers=False,
    )
    base.update(kw)
    return SimEngineConfig(**base)


CASES: dict[str, Case] = {
    "one_group": Case(_engine(), _workload()),
    "preemption": Case(
        _engine(num_gpu_blocks=48, preemption=True, decode_tokens_per_step=16, max_running=6),
        _workload(output_tokens=(40, 120), seed=12),
    ),
    "full_and_sliding_window": Case(
        _engine(
            groups=(FA16, KVCacheGroupSpec(16, "sliding_window", sliding_window=48)),
            num_gpu_blocks=120,
            num_cpu_chunks=160,
            decode_tokens_per_step=16,
        ),
        _workload(output_tokens=(24, 96), seed=13),
    ),
    # two windows: when the second lowers the CPU bound, the first must be checked again
    # at the lower bound (the window it found may now stick out past it)
    "full_and_two_sliding_windows": Case(
        _engine(
            groups=(
                FA16,
                KVCacheGroupSpec(16, "sliding_window", sliding_window=48),
                KVCacheGroupSpec(16, "sliding_window", sliding_window=80),
            ),
            num_gpu_blocks=180,
            num_cpu_chunks=200,
            decode_tokens_per_step=16,
        ),
        _workload(output_tokens=(24, 96), seed=2001),
    ),
    "two_groups_16_32": Case(
        _engine(groups=(FA16, KVCacheGroupSpec(32)), num_gpu_blocks=90, num_cpu_chunks=200),
        _workload(seed=14),
    ),
    "lora": Case(_engine(), _workload(lora_names=(None, "lora-a", "lora-b"), seed=15)),
    "cache_salt": Case(_engine(), _workload(cache_salts=(None, "salt-1", "salt-2"), seed=16)),
    "multimodal": Case(_engine(), _workload(images=3, seed=17)),
    # block-aligned system prompts: the block before each first message is hashed with
    # that message's first token, so equal blocks get different hashes
    "eagle_lookahead": Case(
        _engine(lookahead_tokens=1),
        _workload(system_prompt_tokens=(160, 160), seed=18),
        {"lookahead_tokens": 1},
    ),
    "eagle_drop": Case(_engine(eagle_drop=True), _workload(seed=19), {"eagle_drop": True}),
    "blocks_per_chunk_4": Case(_engine(blocks_per_chunk=4, num_cpu_chunks=40), _workload(seed=20)),
}


class _Follower:
    """Subscriber → BlockIndex on a thread; knows the last seq applied per worker."""

    def __init__(self, cluster: SimCluster, index: BlockIndex) -> None:
        self.index = index
        self.lock = threading.Lock()
        self.sub = Subscriber(cluster.endpoints, replay_endpoints=cluster.replay_endpoints)
        self.applied: dict[WorkerId, int] = {}
        self.anomalies: Counter[str] = Counter()
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                item = self.sub.receive(timeout=0.05)
                if item is None:
                    continue
                if isinstance(item, ReceivedBatch):
                    with self.lock:
                        self.index.apply(item.source, item.dp_rank, item.batch)
                    with self._cond:
                        wid = (item.source, item.dp_rank)
                        self.applied[wid] = max(self.applied.get(wid, -1), item.seq)
                        self._cond.notify_all()
                else:
                    self.anomalies[getattr(item, "kind", type(item).__name__)] += 1
        except BaseException as exc:  # surfaced by wait_for
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def seen(self, wid: WorkerId) -> bool:
        with self._cond:
            return wid in self.applied

    def wait_for(self, wid: WorkerId, seq: int, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.applied.get(wid, -1) < seq:
                if self.error is not None:
                    raise RuntimeError("the subscriber thread failed") from self.error
                left = deadline - time.monotonic()
                assert left > 0, f"the index did not apply seq {seq} of {wid} in time"
                self._cond.wait(left)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sub.close()


@dataclass
class Outcome:
    exact: int = 0
    total: int = 0
    mismatches: list[str] = field(default_factory=list)


def run_case(case: Case, *, engines: int = 2) -> tuple[Outcome, list[SimEngine]]:
    """Route and run ``case``'s workload; compare every admission with its prediction."""
    requests = generate_workload(case.workload)
    index = BlockIndex(blocks_per_chunk=case.engine.blocks_per_chunk, **case.speculative)
    router = Router(index)
    rng = random.Random(case.workload.seed)
    with SimCluster(ClusterConfig(num_engines=engines, engine=case.engine)) as cluster:
        follower = _Follower(cluster, index)
        try:
            assert cluster.announce(follower.seen) == [], "a publisher never reached the SUB"
            by_engine = {w.engine.name: w for w in cluster.workers}
            predicted: dict[str, dict[int, tuple[str, int, int]]] = {n: {} for n in by_engine}

            def before_lookup(engine: SimEngine, req: SimRequest, key: RequestKey) -> None:
                w = by_engine[engine.name]
                follower.wait_for(w.worker_id, engine.stats.batches_published - 1)
                with follower.lock:
                    m = router.find_matches(key).get(w.worker_id)
                gpu, cpu = (int(m.gpu), int(m.cpu)) if m is not None else (0, 0)
                # the last call before an admission is the one it answers
                predicted[engine.name][len(engine.admissions)] = (req.request_id, gpu, cpu)

            for w in cluster.workers:
                w.engine.before_lookup = before_lookup
            home: dict[int, SimEngine] = {}
            for wave in waves(requests, 6):
                for r in wave:
                    if r.session not in home:
                        home[r.session] = rng.choice(cluster.engines)
                    home[r.session].add_request(r)
                cluster.run_until_idle()
            out = Outcome()
            for e in cluster.engines:
                for i, a in enumerate(e.admissions):
                    rid, gpu, cpu = predicted[e.name][i]
                    assert rid == a.request_id
                    out.total += 1
                    if (gpu, cpu) == (a.gpu_hit_tokens, a.cpu_hit_tokens):
                        out.exact += 1
                    elif len(out.mismatches) < 8:
                        out.mismatches.append(
                            f"{e.name} {a.request_id} (attempt {a.attempt}, "
                            f"{a.num_tokens} tokens): router gpu={gpu} cpu={cpu}, "
                            f"engine gpu={a.gpu_hit_tokens} cpu={a.cpu_hit_tokens}"
                        )
            assert not follower.anomalies, f"stream anomalies: {dict(follower.anomalies)}"
            return out, cluster.engines
        finally:
            follower.close()


def _exercised(name: str, case: Case, engines: list[SimEngine]) -> None:
    """The workload did what the configuration is about (so an exact score means
    something): evictions, re-hits, and the configuration's own feature."""
    stats = [e.stats for e in engines]
    assert sum(e.pool.stats.evictions for e in engines) > 0, "no GPU eviction"
    assert sum(s.gpu_hit_tokens for s in stats) > 0, "no GPU re-hit"
    if case.engine.num_cpu_chunks:
        assert sum(s.cpu_hit_tokens for s in stats) > 0, "no CPU hit"
    if case.engine.preemption:
        assert sum(s.preemptions for s in stats) > 0, "no preemption"
    if not all(g.is_full for g in case.engine.groups):
        assert sum(s.hits_cut_by_groups for s in stats) > 0, "no GPU hit cut by the window"
        if case.engine.num_cpu_chunks:
            cut = sum(e.offload.stats.cut_by_window for e in engines if e.offload is not None)
            assert cut > 0, "no CPU hit cut by the window"
    elif len(case.engine.groups) > 1:
        cuts = sum(s.hits_cut_by_groups + s.hits_cut_by_alignment for s in stats)
        assert cuts > 0, "no hit cut by alignment or by another group"


@pytest.mark.parametrize("name", list(CASES))
def test_router_predicts_the_engines_reuse_exactly(name: str) -> None:
    case = CASES[name]
    out, engines = run_case(case)
    _exercised(name, case, engines)
    assert out.exact == out.total, (
        f"{name}: {out.exact}/{out.total} predictions exact; first mismatches:\n  "
        + "\n  ".join(out.mismatches)
    )
