"""Peer bootstrap and completeness, with real processes: ``kvevents sim serve`` engines
keeping a small replay ring, ``kvevents serve`` services in front of them.

A service that starts after the rings wrapped cannot know the engines' oldest blocks:
it reports them incomplete and is not ready.  One bootstrapped from a running peer's
``/snapshot`` restores its index, catches each stream up from the snapshot's resume
point, and ends with the same index, byte for byte.  A resume point the ring no longer
holds, or one whose payload differs, makes that worker start over, said in one line."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
import httpx

from kvevents.serve.bootstrap import PeerSnapshot, StreamPoint
from serve._procs import Proc, serve, sim_engines, spec_parts, wait_until

RING = 8


@dataclass
class Rig:
    sims: Proc
    specs: list[str]
    first: Proc
    url: str
    procs: list[Proc]


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    sims, specs = sim_engines(2, "--buffer-steps", str(RING))
    procs = [sims]
    try:
        first, url = serve(specs)
        procs.append(first)
        wait_until(lambda: httpx.get(url + "/readyz").status_code == 200, what="/readyz")
        yield Rig(sims, specs, first, url, procs)
    finally:
        for p in reversed(procs):
            p.stop()


def workers(url: str) -> dict[str, dict]:
    return {w["worker"]: w for w in httpx.get(url + "/workers", timeout=30).json()["workers"]}


def publish_on(rig: Rig, engine: int, n: int, tag: str) -> None:
    """``n`` requests straight to engine ``engine`` (each stores blocks: batches)."""
    http = spec_parts(rig.specs[engine])[1]
    for i in range(n):
        prompt = f"{tag} {i}: a prompt long enough to fill a few blocks. " * 6
        r = httpx.post(
            http + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=60
        )
        assert r.status_code == 200


def wrap_rings(rig: Rig, tag: str, engines: tuple[int, ...] = (0, 1)) -> None:
    """Publish on ``engines`` until each is 2 * RING batches past where it stood."""
    start = {f"sim-{i}:0": workers(rig.url)[f"sim-{i}:0"]["last_seq"] for i in engines}
    for k in range(200):
        w = workers(rig.url)
        behind = [
            i for i in engines if w[f"sim-{i}:0"]["last_seq"] < start[f"sim-{i}:0"] + 2 * RING
        ]
        if not behind:
            return
        for i in behind:
            publish_on(rig, i, 1, f"{tag}-{k}")
    raise AssertionError("the rings did not wrap")


def settled(*urls: str) -> bool:
    """Every service's workers stand at the same seqs, twice in a row."""
    seqs = [tuple(w["last_seq"] for w in workers(u).values()) for u in urls]
    again = [tuple(w["last_seq"] for w in workers(u).values()) for u in urls]
    return len(set(seqs)) == 1 and seqs == again


def same_points(*urls: str) -> list[PeerSnapshot]:
    """The services' snapshots, taken once they stand at the same resume points (a late
    batch between two snapshots: taken again)."""
    for _ in range(20):
        wait_until(lambda: settled(*urls), what="the services to settle")
        snaps = [snapshot(u) for u in urls]
        if all(s.streams == snaps[0].streams for s in snaps):
            return snaps
    raise AssertionError("the services never stood at the same points")


def snapshot(url: str) -> PeerSnapshot:
    r = httpx.get(url + "/snapshot", timeout=60)
    assert r.status_code == 200, r.text
    return PeerSnapshot.decode(r.content)


class SnapshotServer:
    """Serves fixed ``/snapshot`` bytes on a loopback port (a peer frozen in time)."""

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


def test_a_late_service_is_incomplete_and_a_bootstrapped_one_ends_equal(rig: Rig) -> None:
    # The rings wrap: each engine publishes well beyond RING batches.
    wrap_rings(rig, "wrap")
    assert all(w["completeness"] == "complete" for w in workers(rig.url).values())

    # A service started now, without a peer, misses the engines' oldest batches.
    late, late_url = serve(rig.specs)
    rig.procs.append(late)
    wait_until(lambda: all(w["replay_answered"] for w in workers(late_url).values()),
               what="the late service's catch-up")  # fmt: skip
    wait_until(lambda: all(w["completeness"] == "incomplete" for w in workers(late_url).values()),
               what="incomplete workers")  # fmt: skip
    r = httpx.get(late_url + "/readyz")
    assert r.status_code == 503 and sorted(r.json()["incomplete"]) == [
        "sim-0:0 (incomplete)", "sim-1:0 (incomplete)",
    ]  # fmt: skip
    metrics = httpx.get(late_url + "/metrics").text
    assert 'kvevents_stream_complete{engine="sim-0",rank="0"} 0.0' in metrics
    assert all(w["stream"]["batches_missing"] > 0 for w in workers(late_url).values())
    late.stop()

    # Bootstrapped from the first service: complete, ready, and the same index.
    boot, boot_url = serve(rig.specs, "--bootstrap-from", rig.url)
    rig.procs.append(boot)
    wait_until(lambda: httpx.get(boot_url + "/readyz").status_code == 200,
               what="the bootstrapped service's /readyz")  # fmt: skip
    assert all(w["completeness"] == "complete" for w in workers(boot_url).values())
    assert (
        'kvevents_stream_complete{engine="sim-1",rank="0"} 1.0'
        in httpx.get(boot_url + "/metrics").text
    )
    for i in range(4):  # both services follow the same events
        publish_on(rig, i % 2, 1, f"after-{i}")
        wait_until(lambda: settled(rig.url, boot_url), what="both services to settle")
    # routing reads the index (and fills its layout cache) on one service only
    r = httpx.post(rig.url + "/route", json={"prompt": "wrap-0 0: a prompt"}, timeout=30)
    assert r.status_code == 200
    a, b = same_points(rig.url, boot_url)
    assert a.index == b.index
    boot.stop()


def test_resume_points_checked_by_replay_catch_up_or_start_over(rig: Rig) -> None:
    wait_until(lambda: settled(rig.url), what="the first service to settle")
    frozen = snapshot(rig.url)
    peer = SnapshotServer(frozen.encode())
    try:
        # Engine 0 moves on by less than its ring: caught up from the resume point.
        publish_on(rig, 0, 1, "window")
        wait_until(lambda: settled(rig.url), what="the first service to settle")
        boot, boot_url = serve(rig.specs, "--bootstrap-from", peer.url)
        rig.procs.append(boot)
        wait_until(lambda: httpx.get(boot_url + "/readyz").status_code == 200,
                   what="/readyz after a catch-up from the resume point")  # fmt: skip
        a, b = same_points(rig.url, boot_url)
        assert a.index == b.index
        assert boot.stderr_has("sim-0:0: resumed from the snapshot's seq")
        assert all(w["anomalies"] == {} for w in workers(boot_url).values())
        boot.stop()

        # Engine 0's ring wraps past the resume point; engine 1's point is forged.
        wrap_rings(rig, "past-the-ring", (0,))
        forged = PeerSnapshot(
            frozen.index,
            tuple(
                p if p.engine == "sim-0" else StreamPoint(
                    p.engine, p.rank, p.worker, p.seq, p.fingerprint ^ 1, p.complete
                )
                for p in frozen.streams
            ),
            frozen.taken_at,
        )  # fmt: skip
        peer.close()
        peer = SnapshotServer(forged.encode())
        over, over_url = serve(rig.specs, "--bootstrap-from", peer.url)
        rig.procs.append(over)
        wait_until(lambda: over.stderr_has("sim-0:0: the snapshot's resume point")
                   and over.stderr_has("sim-1:0: the snapshot's resume point"),
                   what="the start-over lines")  # fmt: skip
        assert over.stderr_has("is no longer in the engine's replay ring")
        assert over.stderr_has("does not match the engine's stream")
        w = workers(over_url)
        wait_until(lambda: workers(over_url)["sim-0:0"]["completeness"] == "incomplete",
                   what="sim-0 incomplete")  # fmt: skip
        assert w["sim-1:0"]["stream"]["restarts"] == 1
        assert httpx.get(over_url + "/readyz").status_code == 503
        over.stop()
    finally:
        peer.close()


def test_snapshot_needs_the_admin_token_beyond_loopback() -> None:
    import asyncio
    import socket
    from dataclasses import replace

    import uvicorn

    from kvevents.demo.stack import LocalStack
    from kvevents.serve import ServeConfig
    from kvevents.serve.app import ServeApp

    with LocalStack(1, serve=ServeConfig(scrape_interval_s=0.2)) as stack:
        wait_until(lambda: httpx.get(stack.url + "/readyz").status_code == 200, what="/readyz")
        # On loopback without a token: answered.
        assert PeerSnapshot.decode(httpx.get(stack.url + "/snapshot").content).streams == ()

        async def serve_app(app: ServeApp) -> tuple[uvicorn.Server, asyncio.Task[None], str]:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            server = uvicorn.Server(uvicorn.Config(app.app, log_level="warning"))
            task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
            while not server.started:
                await asyncio.sleep(0.005)
            return server, task, f"http://127.0.0.1:{sock.getsockname()[1]}"

        async def stopped(task: asyncio.Task[None]) -> None:
            await asyncio.wait_for(task, 20)

        # (the service is configured for these hosts; the test reaches it on loopback)
        for host, token, header, status in [
            ("0.0.0.0", None, None, 403),  # beyond loopback, no token configured
            ("0.0.0.0", "s3cret", None, 401),
            ("0.0.0.0", "s3cret", "Bearer wrong", 401),
            ("0.0.0.0", "s3cret", "Bearer s3cret", 200),
            ("127.0.0.1", "s3cret", None, 401),  # a configured token is always required
        ]:
            app = ServeApp(replace(stack.service.config, host=host, admin_token=token))
            server, task, url = stack.call(serve_app(app))
            try:
                headers = {"Authorization": header} if header else {}
                r = httpx.get(url + "/snapshot", headers=headers, timeout=30)
                assert r.status_code == status, (host, token, header, r.text)
                if status == 403:
                    assert "--admin-token" in r.json()["error"]["message"]
            finally:
                server.should_exit = True  # (its lifespan closes the service's fleet)
                stack.call(stopped(task))
