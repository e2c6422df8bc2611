"""One request plan behind ``/v1/*`` and ``/route``: the same checks, the same OpenAI 400s
naming the field at fault, the same key.  Real HTTP against ``kvevents serve`` in front of
simulated engines."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
import httpx

from kvevents.demo.stack import LocalStack
from kvevents.serve import ServeConfig

CHAT = [{"role": "user", "content": "hello there"}]

BAD: list[tuple[str, dict[str, object], str]] = [
    # (the OpenAI route the body belongs to, the body, the field named in the error)
    ("/v1/completions", {"prompt_token_ids": "abc"}, "prompt_token_ids"),
    ("/v1/completions", {"prompt_token_ids": []}, "prompt_token_ids"),
    ("/v1/completions", {"prompt_token_ids": [1, 2.5]}, "prompt_token_ids"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "model": 3}, "model"),
    ("/v1/completions", {"prompt": [1, 2], "cache_salt": 7}, "cache_salt"),
    ("/v1/completions", {"prompt": [1, 2], "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": [1, 2], "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "add_generation_prompt": 1}, "add_generation_prompt"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs"),
]  # fmt: skip


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    with LocalStack(2, serve=ServeConfig(scrape_interval_s=0.2)) as s:
        deadline = time.monotonic() + 30
        while httpx.get(s.url + "/readyz", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the service never became ready"
            time.sleep(0.05)
        yield s


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{b}" for _, b, _ in BAD])
def test_a_wrong_type_is_the_same_openai_400_on_both_routes(
    stack: LocalStack, path: str, body: dict[str, object], param: str
) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        answers = [c.post(path, json=body), c.post("/route", json=body)]
    for r in answers:
        assert r.status_code == 400, (r.request.url.path, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["code"] == 400
        assert error["param"] == param and param in error["message"]
    assert answers[0].json() == answers[1].json()


def test_a_good_body_plans_the_same_on_both_routes(stack: LocalStack) -> None:
    """Token ids given as ``prompt`` or ``prompt_token_ids`` are the tokens as they are:
    ``/route`` counts them, and the service forwards the request to the engine it ranks
    first when nothing else has changed."""
    ids = list(range(100, 164))
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        for body in ({"prompt": ids}, {"prompt_token_ids": ids}, {"prompt": [ids, [1, 2]]}):
            r = c.post("/route", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == len(ids)
        r = c.post("/route", json={"messages": CHAT, "stream": None, "model": None})
        assert r.status_code == 200 and r.json()["tokens"] > 0
        best = c.post("/route", json={"prompt": ids}).json()["ranked"][0]
        sent = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 2})
        assert sent.status_code == 200, sent.text
        assert sent.headers["x-kvevents-worker"] == f"{best['engine']}:{best['rank']}"


def test_route_needs_a_prompt_or_messages(stack: LocalStack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        r = c.post("/route", json={"model": "sim-model"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = c.post("/route", content=b"[1, 2]")
        assert r.status_code == 400 and r.json()["error"]["param"] is None
