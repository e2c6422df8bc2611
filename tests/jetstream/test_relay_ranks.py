"""Exactly once for every DP rank form: relays killed, run side by side, nats-server restarted.

Four engines, each written as a user writes ``--engine``: a plain rank 0; a DP rank 1
with its own endpoints (``NAME=EVENTS,REPLAY``, so one rank in the spec but rank 1 on
the wire) behind a topic; a two-rank engine at vLLM's offset ports behind a topic; and
the API server of global rank 1 under external load balancing (``--data-parallel-rank
1``), given as ``;rank=1`` with the endpoints vLLM was configured with (it binds them
moved up by 1).
Real relay subprocesses (SIGKILL), a real nats-server.  The stream must end holding
every batch of every rank exactly once, all in epoch 0, and a reader must see no
``publisher_restart``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvevents.jetstream import LocalNatsServer
from kvevents.publishers import ZmqEventPublisher

from .helpers import batch, free_port, stream_seqs_or_empty, wait_until

REPO = Path(__file__).resolve().parents[2]


def free_pair() -> int:
    """A port P such that P and P + 1 are both free (rank r of a DP engine binds P + r)."""
    import socket

    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


def stream_keys(url: str) -> list[tuple[str, int, int, int]]:
    """(engine, rank, epoch, seq) of every stored batch, in stream order."""
    import asyncio

    async def read() -> list[tuple[str, int, int, int]]:
        import nats

        nc = await nats.connect(url)
        js = nc.jetstream()
        info = await js.stream_info("KV_EVENTS")
        out = []
        for s in range(info.state.first_seq, info.state.last_seq + 1):
            h = (await js.get_msg("KV_EVENTS", s)).headers or {}
            out.append(
                (
                    h["Kvevents-Source"],
                    int(h["Kvevents-Rank"]),
                    int(h["Kvevents-Epoch"]),
                    int(h["Kvevents-Seq"]),
                )
            )
        await nc.close()
        return out

    return asyncio.run(read())


class Fleet:
    """The three engines: (engine, wire rank) -> publisher, and their ``--engine`` values."""

    def __init__(self) -> None:
        self.pubs: dict[tuple[str, int], ZmqEventPublisher] = {}
        self.sent: Counter[tuple[str, int]] = Counter()
        plain = ZmqEventPublisher(endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
        self.pubs[("plain", 0)] = plain
        # DP rank 1 given its own (already offset) endpoints: one rank in the spec.
        own = ZmqEventPublisher(
            data_parallel_rank=1,
            endpoint="tcp://*:0",
            replay_endpoint="tcp://*:0",
            topic="kv",
        )
        self.pubs[("own", 1)] = own
        # Two ranks at vLLM's offsets (rank r binds base + r).
        base = free_pair()
        rbase = free_pair()
        for rank in (0, 1):
            self.pubs[("dp2", rank)] = ZmqEventPublisher(
                data_parallel_rank=rank,
                endpoint=f"tcp://*:{base}",
                replay_endpoint=f"tcp://*:{rbase}",
                topic="kv",
            )
        # External LB: vLLM's endpoints given, rank 1 binds them + 1 and tags rank 1.
        ext, rext = free_pair(), free_pair()
        self.pubs[("ext", 1)] = ZmqEventPublisher(
            data_parallel_rank=1,
            endpoint=f"tcp://*:{ext - 1}",
            replay_endpoint=f"tcp://*:{rext - 1}",
        )
        assert self.pubs[("ext", 1)].endpoint.endswith(f":{ext}")
        local = lambda ep: ep.replace("0.0.0.0", "127.0.0.1")  # noqa: E731
        self.specs = [
            f"plain={local(plain.endpoint)},{local(plain.replay_endpoint or '')}",
            f"own={local(own.endpoint)},{local(own.replay_endpoint or '')};topic=kv",
            f"dp2=tcp://127.0.0.1:{base},tcp://127.0.0.1:{rbase};dp=2;topic=kv",
            f"ext=tcp://127.0.0.1:{ext - 1},tcp://127.0.0.1:{rext - 1};rank=1",
        ]

    def publish(self, n: int) -> None:
        for key, pub in self.pubs.items():
            for _ in range(n):
                b = batch(self.sent[key])
                b.data_parallel_rank = None  # the publisher's own rank goes on the wire
                pub.publish(b)
                self.sent[key] += 1

    def total(self) -> int:
        return sum(self.sent.values())

    def close(self) -> None:
        for pub in self.pubs.values():
            pub.shutdown()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        f.close()


def relay(url: str, fleet: Fleet) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "kvevents.cli", "relay", "--nats", url, "-q"]
    for spec in fleet.specs:
        cmd += ["--engine", spec]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)


def kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def stored(url: str) -> int:
    return len(stream_seqs_or_empty(url))


def test_every_rank_form_is_stored_once_across_relay_kills_pairs_and_a_server_restart(
    nats_server: LocalNatsServer, fleet: Fleet
) -> None:
    url = nats_server.url
    first = relay(url, fleet)
    second: subprocess.Popen[bytes] | None = None
    try:
        fleet.publish(20)
        assert wait_until(lambda: stored(url) >= fleet.total(), 60)
        kill(first)
        fleet.publish(15)  # while no relay runs
        first, second = relay(url, fleet), relay(url, fleet)  # two side by side
        assert wait_until(lambda: stored(url) >= fleet.total(), 60)
        fleet.publish(10)
        assert wait_until(lambda: stored(url) >= fleet.total(), 60)
        kill(first)
        nats_server.stop()
        nats_server.start()
        first = relay(url, fleet)
        fleet.publish(10)
        assert wait_until(lambda: stored(url) >= fleet.total(), 60)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                kill(proc)
    keys = stream_keys(url)
    copies = Counter((e, r, s) for e, r, _epoch, s in keys)
    assert [k for k, n in copies.items() if n > 1] == []
    assert {(e, r) for e, r, _epoch, _s in keys} == set(fleet.sent)
    for (engine, rank), n in fleet.sent.items():
        seqs = sorted(s for e, r, _epoch, s in keys if (e, r) == (engine, rank))
        assert seqs == list(range(n)), (engine, rank)
    assert {epoch for *_, epoch, _s in keys} == {0}
