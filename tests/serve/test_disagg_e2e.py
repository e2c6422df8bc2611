"""Prefill/decode disaggregation end to end: ``kvevents sim serve`` prefill and decode
engines (separate processes), ``kvevents serve`` in front, and the official ``openai``
client, streaming and not.  Conditions are waited on, never slept on."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("openai")
import httpx
import openai

from tests.serve._procs import Proc, serve, wait_until

SYSTEM = "You answer questions about caches, briefly and kindly. " * 12
THRESHOLD = 48


@dataclass
class Stack:
    url: str
    service: Proc
    doomed: Proc
    """The process of prefill engine ``x-prefill-0`` (killed by the last test)."""
    engines: dict[str, str]
    """Engine name -> its HTTP URL."""

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)


def _sim(*args: str) -> tuple[Proc, list[str]]:
    proc = Proc("sim", "serve", *args)
    n = sum(int(args[i + 1]) for i, a in enumerate(args) if a in ("--prefill", "--decode"))
    return proc, [line.removeprefix("--engine ") for line in proc.read_lines(n)]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    doomed, d_specs = _sim("--prefill", "1", "--name-prefix", "x-")
    rest, r_specs = _sim("--prefill", "1", "--decode", "2")
    specs = d_specs + r_specs
    service, url = serve(specs, "--pd-min-uncached-tokens", str(THRESHOLD))
    engines = {s.split("=", 1)[0]: s.split("=", 1)[1].split(",")[0] for s in specs}
    try:
        wait_until(lambda: httpx.get(url + "/readyz").status_code == 200, 60, "the service ready")
        yield Stack(url, service, doomed, engines)
    finally:
        service.stop()
        doomed.stop()
        rest.stop()


def _role(name: str) -> str:
    return "prefill" if "prefill" in name else "decode"


def _chat(
    st: Stack, messages: list[dict[str, str]], *, stream: bool, max_tokens: int = 16
) -> tuple[dict[str, str], str, int | None]:
    """One chat through the official client: (headers, answer text, cached_tokens)."""
    c = st.client()
    if stream:
        raw = c.chat.completions.with_raw_response.create(
            model="sim-model", messages=messages, max_tokens=max_tokens, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )  # fmt: skip
        text, cached = "", None
        for chunk in raw.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        return dict(raw.headers), text, cached
    raw = c.chat.completions.with_raw_response.create(
        model="sim-model",
        messages=messages,
        max_tokens=max_tokens,  # type: ignore[arg-type]
    )
    answer = raw.parse()
    details = answer.usage.prompt_tokens_details if answer.usage else None
    return (
        dict(raw.headers),
        answer.choices[0].message.content or "",
        (details.cached_tokens if details else None),
    )


def _transfers(st: Stack) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """Every kv_transfer_params sent by a prefill engine (by its request id) and
    received by a decode engine (request id -> (decode engine, JSON text))."""
    sent: dict[str, str] = {}
    received: dict[str, tuple[str, str]] = {}
    for name, url in st.engines.items():
        try:
            log = httpx.get(url + "/sim/kv-transfer", timeout=5).json()
        except httpx.HTTPError:
            continue  # the killed engine
        sent.update(log["sent"])
        received.update({k: (name, v) for k, v in log["received"].items()})
    return sent, received


@pytest.mark.timeout(180)
def test_every_disaggregated_request_reaches_one_prefill_and_one_decode(stack: Stack) -> None:
    sent0, received0 = _transfers(stack)
    pairs: Counter[tuple[str, str]] = Counter()
    for i, stream in enumerate([False, True, False, True]):
        msgs = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Question {i}: how are blocks hashed? " * 12},
        ]
        headers, text, cached = _chat(stack, msgs, stream=stream)
        assert text
        prefill, decode = headers["x-kvevents-prefill"], headers["x-kvevents-worker"]
        assert _role(prefill) == "prefill" and _role(decode) == "decode"
        assert cached is not None and cached >= THRESHOLD  # the decode received the prefix
        pairs[(prefill.split(":")[0], decode.split(":")[0])] += 1
    sent, received = _transfers(stack)
    new_sent = {k: v for k, v in sent.items() if k not in sent0}
    new_received = {k: v for k, v in received.items() if k not in received0}
    assert len(new_sent) == len(new_received) == 4
    seen: Counter[tuple[str, str]] = Counter()
    for rid, (decode, text) in new_received.items():
        # the decode request carried the prefill answer's parameters byte for byte
        assert new_sent[rid] == text
        raw_bodies = httpx.get(
            stack.engines[decode] + "/sim/kv-transfer", params={"id": rid}
        ).json()["raw_bodies"]
        assert any(f'"kv_transfer_params":{text}'.encode() in b.encode() for b in raw_bodies)
        params = json.loads(text)
        assert params["do_remote_prefill"] is True and params["remote_block_ids"]
        engine_id = params["remote_engine_id"]
        seen[(engine_id, decode)] += 1
    assert seen == pairs


@pytest.mark.timeout(180)
def test_follow_up_turns_reuse_their_prefix_on_the_same_prefill_engine(stack: Stack) -> None:
    msgs = [
        {"role": "system", "content": "A different tenant, with its own long rules. " * 12},
        {"role": "user", "content": "Start a story about a cache that never forgets. " * 6},
    ]
    first = None
    for turn in range(3):
        headers, text, _ = _chat(stack, msgs, stream=turn % 2 == 1)
        prefill = headers["x-kvevents-prefill"]
        first = first or prefill
        assert prefill == first
        reused = int(headers["x-kvevents-prefill-cached-tokens"])
        if turn == 0:
            assert reused == 0
        else:
            assert reused >= THRESHOLD  # the prefill engine reported the history cached
        msgs += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Go on with part {turn + 2}, with more detail. " * 8},
        ]
    workers = httpx.get(stack.url + "/workers").json()
    roles = workers["roles"]["prefill"]
    assert roles["prefills"] >= 3 and roles["reported_cached_tokens"] > 0
    assert roles["exact"] + roles["over"] + roles["under"] >= 3
    by_name = {w["worker"]: w for w in workers["workers"]}
    assert by_name[first]["role"] == "prefill" and by_name[first]["prefills"] >= 3
    metrics = httpx.get(stack.url + "/metrics").text
    assert 'kvevents_serve_role_predictions_total{outcome="exact",role="prefill"}' in metrics
    assert 'kvevents_serve_pd_requests_total{path="disaggregated"}' in metrics


@pytest.mark.timeout(120)
def test_short_uncached_prompts_go_straight_to_a_decode_engine(stack: Stack) -> None:
    for stream in (False, True):
        headers, text, _ = _chat(stack, [{"role": "user", "content": "hi"}], stream=stream)
        assert text
        assert "x-kvevents-prefill" not in headers
        assert _role(headers["x-kvevents-worker"]) == "decode"
    route = httpx.post(
        stack.url + "/route", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert route["disaggregated"] is False and route["reason"] == "short"
    assert route["prefill"] is None and route["decode"]["engine"].startswith("decode")
    long = [{"role": "user", "content": "A long and new question about eviction. " * 20}]
    route = httpx.post(stack.url + "/route", json={"messages": long}).json()
    assert route["disaggregated"] is True
    assert route["prefill"]["engine"].endswith("prefill-0")
    assert route["decode"]["engine"].startswith("decode")


@pytest.mark.timeout(180)
def test_models_and_workers_show_roles(stack: Stack) -> None:
    models = stack.client().models.list()
    card = next(m for m in models.data if m.id == "sim-model")
    engines = card.model_extra["kvevents_engines"] if card.model_extra else {}
    assert engines.get("decode-0") == "decode" and engines.get("x-prefill-0") == "prefill"
    roles = {w["engine"]: w["role"] for w in httpx.get(stack.url + "/workers").json()["workers"]}
    assert roles == {
        "x-prefill-0": "prefill", "prefill-0": "prefill", "decode-0": "decode",
        "decode-1": "decode",
    }  # fmt: skip


@pytest.mark.timeout(240)
def test_a_prefill_engine_killed_mid_run_is_failed_over(stack: Stack) -> None:
    # a conversation whose prefix lives on the doomed engine: KV-aware prefill picks it
    msgs = [
        {"role": "system", "content": "Rules of the doomed tenant, long enough. " * 12},
        {"role": "user", "content": "First question, a long one about the tiers. " * 6},
    ]
    # warm the doomed engine with the prefix directly; the service learns it from its events
    doomed_url = stack.engines["x-prefill-0"]
    r = httpx.post(doomed_url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    assert r.status_code == 200

    def best_prefill() -> str:
        ranked = httpx.post(stack.url + "/route", json={"messages": msgs}).json()["ranked"]
        return str(next(r["engine"] for r in ranked if "prefill" in r["engine"]))

    wait_until(lambda: best_prefill() == "x-prefill-0", 30, "the prefix seen on x-prefill-0")
    msgs += [{"role": "user", "content": "Second question, long as well, about eviction. " * 6}]

    def one(i: int) -> dict[str, str]:
        m = [*msgs, {"role": "user", "content": f"Variant {i}: please elaborate further. " * 14}]
        return _chat(stack, m, stream=i % 2 == 0)[0]

    with ThreadPoolExecutor(4) as pool:
        before = list(pool.map(one, range(4)))
        assert any(h.get("x-kvevents-prefill") == "x-prefill-0:0" for h in before)
        stack.doomed.stop()  # mid-run: the next requests still prefer its prefix
        after = list(pool.map(one, range(4, 12)))
    for h in after:
        assert h["x-kvevents-prefill"] == "prefill-0:0"
        assert _role(h["x-kvevents-worker"]) == "decode"
    workers = {w["worker"]: w for w in httpx.get(stack.url + "/workers").json()["workers"]}
    assert workers["x-prefill-0:0"]["up"] is False
