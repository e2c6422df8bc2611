"""``;rank=R``: an HTTP front that serves global data-parallel ranks ``R..R+N-1``.

vLLM with external load balancing runs one API server per rank (``--data-parallel-rank
R``): every server is given the same ``kv_events_config`` endpoint and its publisher binds
it moved up by R, tagging its batches ``data_parallel_rank = R``.  With hybrid load
balancing one server per node serves ranks ``S..S+L-1`` and takes ``X-data-parallel-rank``
as an index among them.  Here each such server is a simulated engine (an HTTP front and a
vLLM-compatible publisher on real loopback sockets, run in this process) and the service
is a ``kvevents serve`` subprocess: the ``;rank=`` spec's batches are indexed under the
worker its spec gives, requests go to its front with the header vLLM expects, and a spec
that forgot ``;rank=`` is told so.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
import httpx
import zmq
from _ports import free_port_block

from kvevents.errors import KVEventsError
from kvevents.sim.http import SimHTTPEngine

from ._procs import Proc, serve, wait_until

T = TypeVar("T")


class _Loop:
    """An asyncio loop on a thread, for the simulated engines' HTTP fronts."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Rig:
    url: str
    svc: Proc
    engines: dict[str, SimHTTPEngine]
    ext_base: int
    """The ``kv_events_config`` endpoint port every external-LB server was given."""


def _engines() -> tuple[int, int, dict[str, SimHTTPEngine]]:
    """Simulated API servers, each given its mode's vLLM endpoints (``tcp://*:EXT`` events
    and ``tcp://*:EXT+4`` replay for the external-LB ones, ``HYB``/``HYB+4`` for the
    hybrid ones) and binding them moved up by its global rank; retried when a port is
    taken meanwhile."""
    ranks = {"ext0": ("ext", 0), "ext1": ("ext", 1), "ext2": ("ext", 2)}
    ranks |= {"hyb2": ("hyb", 2), "hyb3": ("hyb", 3)}
    for _ in range(20):
        ext, hyb = free_port_block(8), free_port_block(8)
        if abs(ext - hyb) < 8:
            continue
        base = {"ext": ext, "hyb": hyb}
        made: dict[str, SimHTTPEngine] = {}
        try:
            for name, (mode, rank) in ranks.items():
                made[name] = SimHTTPEngine(
                    name,
                    events=f"tcp://*:{base[mode]}",
                    replay=f"tcp://*:{base[mode] + 4}",
                    dp_rank=rank,
                )
        except BaseException as exc:
            for e in made.values():
                e.publisher.shutdown()
            if isinstance(exc, KVEventsError | zmq.ZMQError):
                continue  # a port was taken in between
            raise
        for name, (mode, rank) in ranks.items():
            assert made[name].events_endpoint == f"tcp://127.0.0.1:{base[mode] + rank}"
        return ext, hyb, made
    raise AssertionError("no free ports for the engines")


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    loop = _Loop()
    ext, hyb, engines = _engines()
    started: list[SimHTTPEngine] = []
    svc: Proc | None = None
    try:
        for e in engines.values():
            loop.call(e.start())
            started.append(e)
        ev = lambda port: f"tcp://127.0.0.1:{port},tcp://127.0.0.1:{port + 4}"  # noqa: E731
        specs = [
            # external LB: one spec per API server, vLLM's endpoint and its rank
            f"e0={engines['ext0'].url},{ev(ext)}",
            f"e2={engines['ext2'].url},{ev(ext)};rank=2",
            # the same kind of server given without ;rank=, at the ports it binds
            f"own={engines['ext1'].url},{ev(ext + 1)}",
            # hybrid LB: one spec per node's API server, ranks 2 and 3 behind hyb2's front
            f"h={engines['hyb2'].url},{ev(hyb)};dp=2;rank=2",
        ]
        svc, url = serve(specs)
        wait_until(lambda: httpx.get(url + "/readyz", timeout=5).status_code == 200, 60, "/readyz")
        yield Rig(url, svc, engines, ext)
    finally:
        if svc is not None:
            svc.stop()
        for e in started:
            loop.call(e.stop())
        for e in engines.values():
            if e not in started:
                e.publisher.shutdown()
        loop.close()


def _workers(url: str) -> dict[str, dict[str, Any]]:
    body = httpx.get(url + "/workers", timeout=10).json()
    return {w["worker"]: w for w in body["workers"]}


def _warm(engine: SimHTTPEngine, prompt: str) -> None:
    """A request straight to ``engine``'s front: its publisher stores the prompt's blocks."""
    r = httpx.post(engine.url + "/v1/completions", json={"prompt": prompt}, timeout=30)
    assert r.status_code == 200, r.text


def _indexed(url: str, worker: str, entries: int) -> None:
    def check() -> bool:
        return bool(_workers(url)[worker]["blocks"]["GPU"]["entries"] >= entries)

    wait_until(check, 30, f"{worker}'s blocks in /workers")  # /workers' summary: 1 s cache


def test_every_rank_is_known_by_its_global_rank_before_any_event(rig: Rig) -> None:
    w = _workers(rig.url)
    assert {k: v["index_worker"] for k, v in w.items()} == {
        "e0:0": ["e0", 0],
        "e2:2": ["e2", 2],
        "own:0": ["own", 0],
        "h:2": ["h", 2],
        "h:3": ["h@dp3", 3],
    }


def test_an_external_lb_rank_is_indexed_and_routed_to_its_front(rig: Rig) -> None:
    ext2, ext0 = rig.engines["ext2"], rig.engines["ext0"]
    prompt = "only global rank two holds this " * 12
    _warm(ext2, prompt)
    _indexed(rig.url, "e2:2", 1)
    w = _workers(rig.url)
    assert w["e2:2"]["batches"] > 0 and w["e2:2"]["unexpected_batches"] == {}

    r = httpx.post(rig.url + "/v1/completions", json={"prompt": prompt + "more"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-kvevents-worker"] == "e2:2"
    # its own front took it (the warm-up and this one), with no header: it serves one rank
    assert ext2.counters["requests"] == 2 and ext2.dp_headers == {}
    assert ext0.counters["requests"] == 0


def test_hybrid_lb_ranks_get_the_index_among_their_fronts_ranks(rig: Rig) -> None:
    hyb2, hyb3 = rig.engines["hyb2"], rig.engines["hyb3"]
    three = "the node's second rank holds this " * 12
    _warm(hyb3, three)
    _indexed(rig.url, "h:3", 1)
    r = httpx.post(rig.url + "/v1/completions", json={"prompt": three + "more"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-kvevents-worker"] == "h:3"
    assert hyb2.dp_headers == {"1": 1}  # global rank 3 is index 1 of the front's ranks 2, 3

    two = "the node's first rank holds this " * 12
    _warm(hyb2, two)
    _indexed(rig.url, "h:2", 1)
    r = httpx.post(rig.url + "/v1/completions", json={"prompt": two + "more"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-kvevents-worker"] == "h:2"
    assert hyb2.dp_headers == {"1": 1, "0": 1}  # pinned: vLLM would balance it otherwise


def test_a_spec_without_its_rank_skips_the_batches_and_suggests_rank(rig: Rig) -> None:
    _warm(rig.engines["ext1"], "global rank one without ;rank= in its spec " * 12)

    def counted() -> bool:
        return bool(_workers(rig.url)["own:0"]["unexpected_batches"].get("dp_rank", 0) > 0)

    wait_until(counted, 30, "own:0's unexpected batches")
    w = _workers(rig.url)["own:0"]
    assert w["batches"] == 0 and w["blocks"]["GPU"]["entries"] == 0
    hint = (
        "give its spec ;rank=1 and the endpoint vLLM was configured with "
        f"(tcp://127.0.0.1:{rig.ext_base} for this stream)"
    )
    wait_until(lambda: rig.svc.stderr_has(hint), 10, "the ;rank= hint in the log")
    assert any("unexpected_batch" in a for a in w["recent_anomalies"])
