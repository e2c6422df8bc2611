"""``kvevents serve`` in process, in front of simulated engines, over real HTTP and ZMQ."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
import httpx
from _ports import free_port_block

from kvevents.demo.stack import LocalStack
from kvevents.native import core_name
from kvevents.serve import ServeConfig
from kvevents.sim.http import SimHTTPConfig

SYSTEM = "You are a careful assistant who answers in short words. " * 6


def wait_until(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture()
def stack() -> Iterator[LocalStack]:
    with LocalStack(3, serve=ServeConfig(scrape_interval_s=0.2)) as s:
        wait_until(lambda: ready(s.url), what="/readyz")
        yield s


def chat(client: httpx.Client, messages: list[dict], **extra: object) -> httpx.Response:
    return client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 8, **extra}
    )


def caught_up(stack: LocalStack) -> Callable[[], bool]:
    """The index has applied every batch each engine published."""

    def check() -> bool:
        w = httpx.get(stack.url + "/workers", timeout=5).json()["workers"]
        published = [e.engine.stats.batches_published for e in stack.engines]
        return all(x["batches"] >= p for x, p in zip(w, published))

    return check


def test_follow_up_goes_where_the_index_says_and_prediction_is_exact(stack: LocalStack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        msgs = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "first question"},
        ]
        r1 = chat(c, msgs)
        assert r1.status_code == 200
        worker = r1.headers["x-kvevents-worker"]
        answer = r1.json()["choices"][0]["message"]["content"]
        wait_until(caught_up(stack), what="the index to catch up")
        msgs2 = [
            *msgs,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "next"},
        ]
        ranked = c.post("/route", json={"messages": msgs2}).json()["ranked"]
        assert ranked[0]["engine"] + ":0" == worker and ranked[0]["gpu"] > 0
        assert {r["engine"] for r in ranked} == {"sim-0", "sim-1", "sim-2"}
        assert set(ranked[0]) == {
            "engine",
            "rank",
            "gpu",
            "cpu",
            "storage",
            "pending",
            "load",
            "cost",
        }
        r2 = chat(c, msgs2)
        assert r2.headers["x-kvevents-worker"] == worker
        reported = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = ranked[0]["gpu"] + ranked[0]["cpu"] + ranked[0]["storage"]
        assert reported == predicted > 0
        everything = c.get("/workers").json()
        assert everything["core"] == core_name()  # which core the service runs
        w = {x["worker"]: x for x in everything["workers"]}[worker]
        assert w["truth"]["exact"] == 2 and w["truth"]["over"] == w["truth"]["under"] == 0
        assert w["reported_cached_tokens"] == reported and w["routed"] == 2
        assert w["state"] == "live"

        def holds_blocks() -> bool:  # tier counts refresh at most once a second
            ws = {x["worker"]: x for x in c.get("/workers").json()["workers"]}
            return ws[worker]["blocks"]["GPU"]["entries"] > 0

        wait_until(holds_blocks, what="the GPU tier count on /workers")
        metrics = c.get("/metrics").text
        name = worker.split(":")[0]
        assert f'kvevents_serve_predictions_total{{engine="{name}",outcome="exact"}} 2.0' in metrics
        assert "kvevents_subscriber_batches_total" in metrics
        assert "kvevents_index_applied_total" in metrics
        assert f'kvevents_serve_routing_decisions_total{{engine="{name}",rank="0"}} 2.0' in metrics
        assert "kvevents_serve_prediction_error_tokens_bucket" in metrics
        assert "kvevents_serve_request_latency_seconds_count" in metrics


def test_responses_arrive_byte_for_byte(stack: LocalStack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        for stream in (False, True):
            for path, body in (
                ("/v1/completions", {"prompt": "a b c " * 20, "max_tokens": 12}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x y"}]}),
            ):
                body = {**body, "stream": stream, "stream_options": {"include_usage": True}}
                if not stream:
                    del body["stream_options"]
                r = c.post(path, json=body)
                assert r.status_code == 200
                first = r.text.split("\n")[0].removeprefix("data: ") if stream else r.text
                rid = json.loads(first)["id"]
                engine = stack.engines[int(r.headers["x-kvevents-worker"][4])]
                sent = httpx.get(engine.url + "/sim/response-digest", params={"id": rid}).json()
                assert sent["sha256"] == hashlib.sha256(r.content).hexdigest()


def test_new_conversations_spread_follow_ups_stay() -> None:
    # slow engine steps so that requests overlap; a local tokenizer so routing is
    # decided in arrival order without a /tokenize round trip
    sim = SimHTTPConfig(step_s=0.05)
    with LocalStack(3, serve=ServeConfig(scrape_interval_s=0.2), sim=sim) as s:
        wait_until(lambda: ready(s.url), what="/readyz")
        with httpx.Client(base_url=s.url, timeout=60) as c:
            warm = chat(
                c, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "w"}]
            )
            home = warm.headers["x-kvevents-worker"]
            wait_until(caught_up(s), what="the index to catch up")

            def new_conversation(i: int) -> httpx.Response:
                msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"q{i}"}]
                return chat(c, msgs, max_tokens=64)

            with ThreadPoolExecutor(3) as pool:
                answers = list(pool.map(new_conversation, range(3)))
            workers = [a.headers["x-kvevents-worker"] for a in answers]
            # sharing only the system prompt, concurrent new chats spread out
            assert len(set(workers)) == 3, workers
            wait_until(caught_up(s), what="the index to catch up")
            # a follow-up stays with the engine that holds its conversation
            for i, a in enumerate(answers):
                msgs = [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"q{i}"},
                    {"role": "assistant", "content": a.json()["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "and then?"},
                ]
                assert chat(c, msgs).headers["x-kvevents-worker"] == workers[i]
            assert home in workers


def test_bad_input_gets_openai_errors(stack: LocalStack) -> None:
    cases = [
        ("/v1/completions", b"{oops"),
        ("/v1/completions", b"[]"),
        ("/v1/completions", b'{"max_tokens": 3}'),
        ("/v1/completions", b'{"prompt": {"a": 1}}'),
        ("/v1/chat/completions", b'{"messages": "hi"}'),
        ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream": 3}'),
        ("/route", b'{"model": "x"}'),
        ("/route", b"nope"),
    ]
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        for path, body in cases:
            r = c.post(path, content=body)
            assert r.status_code == 400, (path, body, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"]
        # an error the engine itself finds (context too long) comes back unchanged
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**6})
        assert r.status_code == 400 and "maximum context length" in r.json()["message"]
        assert c.get("/healthz").json() == {"status": "ok"}


def test_models_merge_and_lora_routing() -> None:
    sim = SimHTTPConfig(loras=("adapter-a",))
    with LocalStack(2, serve=ServeConfig(scrape_interval_s=0.2), sim=sim) as s:
        wait_until(lambda: ready(s.url), what="/readyz")
        with httpx.Client(base_url=s.url, timeout=30) as c:
            ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
            assert ids == ["sim-model", "adapter-a"]
            prompt = "lora prompt words " * 20
            r = c.post("/v1/completions", json={"prompt": prompt, "model": "adapter-a"})
            home = r.headers["x-kvevents-worker"]
            wait_until(caught_up(s), what="the index to catch up")
            lora = c.post("/route", json={"prompt": prompt, "model": "adapter-a"}).json()
            base = c.post("/route", json={"prompt": prompt}).json()
            # the adapter's blocks are keyed by its name: the base model has no hit
            assert all(x["gpu"] == 0 for x in base["ranked"])
            assert lora["ranked"][0]["engine"] + ":0" == home and lora["ranked"][0]["gpu"] > 0


def test_engine_down_is_marked_skipped_and_retried() -> None:
    # no metrics scrape after the first: the request itself finds the engine gone
    with (
        LocalStack(3, serve=ServeConfig(scrape_interval_s=600)) as stack,
        httpx.Client(base_url=stack.url, timeout=30) as c,
    ):
        wait_until(lambda: ready(stack.url), what="/readyz")
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "down?"}]
        victim = chat(c, msgs).headers["x-kvevents-worker"]
        wait_until(caught_up(stack), what="the index to catch up")
        stack.stop_engine(int(victim[4]))
        # the index still says the victim holds the prefix; the request is re-sent
        for _ in range(3):
            r = chat(c, msgs)
            assert r.status_code == 200 and r.headers["x-kvevents-worker"] != victim
        w = {x["worker"]: x for x in c.get("/workers").json()["workers"]}
        assert w[victim]["up"] is False and w[victim]["state"] == "stale"
        assert w[victim]["down_reason"]
        assert "kvevents_serve_retries_total 1.0" in c.get("/metrics").text
        assert 'kvevents_serve_engine_up{engine="' + victim[:5] + '"} 0.0' in c.get("/metrics").text


def test_readyz_names_engines_not_ready() -> None:
    # an engine whose publisher is not there: its stream never connects
    cfg = ServeConfig(scrape_interval_s=0.2)
    with LocalStack(1, serve=cfg) as s:
        wait_until(lambda: ready(s.url), what="/readyz")
    from kvevents.serve.app import ServeApp
    from kvevents.serve.config import parse_engine_spec

    app = ServeApp(
        replace(
            cfg,
            engines=(
                parse_engine_spec("ghost=http://127.0.0.1:9,tcp://127.0.0.1:9,tcp://127.0.0.1:9"),
            ),
        )
    )
    try:
        assert app.fleet.not_ready() == ["ghost:0 (events stream not connected)"]
    finally:
        app.fleet.close()


def test_data_parallel_rank_gets_the_header() -> None:
    import asyncio

    from kvevents.serve.config import parse_engine_spec
    from kvevents.sim.http import SimHTTPEngine

    ev = free_port_block(4)  # events on ev and ev + 1, replay on ev + 2 and ev + 3
    rep = ev + 2
    stack = LocalStack(1, serve=ServeConfig(scrape_interval_s=0.2))
    stack.start()
    try:
        # rank 0 and rank 1 of engine "x": one HTTP front (rank 0's), two publishers
        rank0 = SimHTTPEngine("x", events=f"tcp://*:{ev}", replay=f"tcp://*:{rep}")
        rank1 = SimHTTPEngine("x1", events=f"tcp://*:{ev}", replay=f"tcp://*:{rep}", dp_rank=1)
        assert rank1.events_endpoint.endswith(f":{ev + 1}")
        stack.call(rank0.start())
        stack.call(rank1.start())
        from kvevents.serve.app import ServeApp

        spec = parse_engine_spec(f"x={rank0.url},tcp://127.0.0.1:{ev},tcp://127.0.0.1:{rep};dp=2")
        service = ServeApp(replace(ServeConfig(scrape_interval_s=0.2), engines=(spec,)))

        async def serve_it() -> tuple[object, str]:
            import socket

            import uvicorn

            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            server = uvicorn.Server(uvicorn.Config(service.app, log_level="warning"))
            asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
            while not server.started:
                await asyncio.sleep(0.005)
            return server, f"http://127.0.0.1:{sock.getsockname()[1]}"

        server, url = stack.call(serve_it())
        try:
            wait_until(lambda: ready(url), what="/readyz of the dp engine")
            prompt = "only rank one holds this " * 12
            # warm rank 1 directly, then ask the service
            httpx.post(rank1.url + "/v1/completions", json={"prompt": prompt}, timeout=30)
            wait_until(
                lambda: httpx.get(url + "/workers").json()["workers"][1]["batches"] > 0,
                what="rank 1's events",
            )
            r = httpx.post(url + "/v1/completions", json={"prompt": prompt + "more"}, timeout=30)
            assert r.status_code == 200 and r.headers["x-kvevents-worker"] == "x:1"
            # rank 0's front got it with vLLM's header naming rank 1
            assert rank0.dp_headers == {"1": 1}
        finally:
            server.should_exit = True  # type: ignore[attr-defined]
            stack.call(rank0.stop())
            stack.call(rank1.stop())
    finally:
        stack.close()


def test_cache_salt_is_keyed(stack: LocalStack) -> None:
    prompt = "salted prompt words " * 20
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "cache_salt": "tenant-a"})
        home = r.headers["x-kvevents-worker"]
        wait_until(caught_up(stack), what="the index to catch up")
        salted = c.post("/route", json={"prompt": prompt, "cache_salt": "tenant-a"}).json()
        other = c.post("/route", json={"prompt": prompt, "cache_salt": "tenant-b"}).json()
        plain = c.post("/route", json={"prompt": prompt}).json()
        best = salted["ranked"][0]
        assert best["engine"] + ":0" == home and best["gpu"] > 0
        # another salt, or none, shares nothing with it (vLLM salts the first block)
        assert all(x["gpu"] == x["cpu"] == 0 for x in other["ranked"] + plain["ranked"])
        again = c.post(
            "/v1/completions", json={"prompt": prompt + "more", "cache_salt": "tenant-a"}
        )
        assert again.headers["x-kvevents-worker"] == home
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == best["gpu"] + best["cpu"] > 0


def test_local_tokenizer_gives_the_engines_tokens(tmp_path: pytest.TempPathFactory) -> None:
    from kvevents.tokenizer import SimTokenizer

    path = str(tmp_path / "tok.json")  # type: ignore[operator]
    SimTokenizer().save(path)
    with LocalStack(2, serve=ServeConfig(scrape_interval_s=0.2, tokenizer=path)) as s:
        wait_until(lambda: ready(s.url), what="/readyz")
        with httpx.Client(base_url=s.url, timeout=30) as c:
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "local"}]
            r1 = chat(c, msgs)
            wait_until(caught_up(s), what="the index to catch up")
            msgs2 = [
                *msgs,
                {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
            ]
            msgs2.append({"role": "user", "content": "again"})
            engine = s.engines[0]
            # the service's tokens (local) are the engine's own (its /tokenize)
            local = c.post("/route", json={"messages": msgs2}).json()
            remote = httpx.post(engine.url + "/tokenize", json={"messages": msgs2}).json()
            assert local["tokens"] == remote["count"]
            r2 = chat(c, msgs2)
            best = local["ranked"][0]
            assert r2.headers["x-kvevents-worker"] == r1.headers["x-kvevents-worker"]
            cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == best["gpu"] + best["cpu"] > 0


def test_only_engines_serving_the_model_are_candidates() -> None:
    with LocalStack(3, serve=ServeConfig(scrape_interval_s=600)) as s:
        wait_until(lambda: ready(s.url), what="/readyz")
        wait_until(
            lambda: len(s.service.upstream.engine_models) == 3, what="the engines' model lists"
        )
        assert s.service.upstream.engine_models["sim-0"] == {"sim-model"}
        # as if sim-1 served another model
        s.service.upstream.engine_models["sim-1"] = {"other-model"}
        with httpx.Client(base_url=s.url, timeout=30) as c:

            def engines(body: dict) -> list[str]:
                return [x["engine"] for x in c.post("/route", json=body).json()["ranked"]]

            assert engines({"prompt": [1, 2, 3], "model": "other-model"}) == ["sim-1"]
            assert sorted(engines({"prompt": [1, 2, 3], "model": "sim-model"})) == [
                "sim-0",
                "sim-2",
            ]
            # a model nobody lists: every engine (it will say so itself)
            assert len(engines({"prompt": [1, 2, 3], "model": "nope"})) == 3
            for _ in range(4):
                r = c.post("/v1/completions", json={"prompt": "x y", "model": "sim-model"})
                assert r.headers["x-kvevents-worker"] != "sim-1:0"
