"""The simulated engines' OpenAI-compatible HTTP front and tokenizer."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
import httpx

from kvevents.demo.stack import LocalStack
from kvevents.serve.upstream import parse_engine_metrics
from kvevents.sim.http import SimHTTPConfig
from kvevents.tokenizer import SimTokenizer

TOK = SimTokenizer()
words = st.text(alphabet="abc <|>\n", min_size=0, max_size=30)


@settings(max_examples=200, deadline=None)
@given(words, st.text(alphabet="abc<|>", min_size=1, max_size=5), words)
def test_tokenizer_prefix_stable(a: str, head: str, b: str) -> None:
    # text ending in whitespace, followed by text starting with a non-space character
    left = a + " "
    right = head + b
    assert TOK.encode(left + right) == TOK.encode(left) + TOK.encode(right)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["user", "assistant"]), words), min_size=1, max_size=5))
def test_chat_turns_extend_each_other(turns: list[tuple[str, str]]) -> None:
    msgs = [{"role": r, "content": c} for r, c in turns]
    prompt = TOK.encode_chat(msgs)
    nxt = TOK.encode_chat(
        [*msgs, {"role": "assistant", "content": "w1 w2"}, {"role": "user", "content": "more"}]
    )
    # the next turn starts with the previous turn's prompt, token for token
    assert nxt[: len(prompt)] == prompt


@pytest.fixture(scope="module")
def engine_url() -> str:
    with LocalStack(1, sim=SimHTTPConfig(loras=("ad1",))) as stack:
        yield stack.engines[0].url  # type: ignore[misc]


def _sse(text: str) -> list[dict]:
    out = []
    for line in text.split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_completions_report_cached_tokens(engine_url: str) -> None:
    prompt = "shared words " * 40
    with httpx.Client(base_url=engine_url, timeout=30) as c:
        first = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5}).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert first["usage"]["completion_tokens"] == 5
        again = c.post("/v1/completions", json={"prompt": prompt + "tail", "max_tokens": 5}).json()
        n = len(TOK.encode(prompt + "tail"))
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        # the whole first prompt's full 16-token blocks, never the last prompt token
        assert cached == (len(TOK.encode(prompt)) // 16) * 16 and cached <= n - 1
        # same prompt, same answer (deterministic)
        third = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5}).json()
        assert third["choices"][0]["text"] == first["choices"][0]["text"]


def test_streaming_chat_usage_in_last_chunk(engine_url: str) -> None:
    msgs = [{"role": "system", "content": "be brief " * 30}, {"role": "user", "content": "hi"}]
    body = {"messages": msgs, "max_tokens": 40, "stream": True}
    with httpx.Client(base_url=engine_url, timeout=30) as c:
        plain = _sse(c.post("/v1/chat/completions", json=body).text)
        assert all("usage" not in ch for ch in plain)
        body["stream_options"] = {"include_usage": True}
        r = c.post("/v1/chat/completions", json=body)
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(r.text)
        text = "".join(
            ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"]
        )
        assert len(TOK.encode(text)) == 40
        last = chunks[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 40
        assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # the digest route knows what was sent
        d = c.get("/sim/response-digest", params={"id": chunks[0]["id"]}).json()
        assert d["sha256"] == hashlib.sha256(r.content).hexdigest()


def test_tokenize_models_metrics(engine_url: str) -> None:
    msgs = [{"role": "user", "content": "hello there"}]
    with httpx.Client(base_url=engine_url, timeout=30) as c:
        t = c.post("/tokenize", json={"prompt": "hello there"}).json()
        assert t["tokens"] == TOK.encode("hello there") and t["count"] == 2
        t = c.post("/tokenize", json={"messages": msgs}).json()
        assert t["tokens"] == TOK.encode_chat(msgs)
        models = c.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["sim-model", "ad1"]
        assert models[1]["parent"] == "sim-model"
        page = c.get("/metrics").text
        gauges = parse_engine_metrics(page)[0]
        assert set(gauges) == {
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
        }


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", b'{"prompt": 5}', 400),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000}', 400),
        ("/v1/completions", b'{"prompt": "x", "model": "nope"}', 404),
        ("/v1/chat/completions", b'{"messages": []}', 400),
        ("/tokenize", b'{"messages": [{"content": "x"}]}', 400),
    ],
)
def test_bad_requests(engine_url: str, path: str, body: bytes, status: int) -> None:
    r = httpx.post(engine_url + path, content=body, timeout=30)
    assert r.status_code == status
    assert r.json()["object"] == "error" and r.json()["message"]
