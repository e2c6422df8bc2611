"""The OpenAI wire shapes a simulated engine reads and writes, as vLLM's OpenAI server
does: the request fields it accepts (prompt or messages, model or LoRA, ``max_tokens``,
``n``, ``cache_salt``), the completion and chat-completion bodies, their SSE chunks, the
usage with ``prompt_tokens_details.cached_tokens``, ``/v1/models`` and the error body.

One job: request bodies in, answer bytes out (no engine, no server).  Imports the sim
engine's :class:`~kvevents.sim.engine.RequestResult` and the sim tokenizer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvevents.errors import KVEventsError
from kvevents.sim.engine import RequestResult
from kvevents.tokenizer import SimTokenizer

__all__ = [
    "Pending",
    "SimBadRequest",
    "completion_body",
    "error_body",
    "models_body",
    "prompt_tokens",
    "request_lora",
    "request_options",
    "sse_chunks",
    "usage_body",
]


class SimBadRequest(KVEventsError, ValueError):
    """A request a simulated engine refuses; ``status`` is the HTTP status it answers
    with (400 unless said otherwise, 404 for an unknown model)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Pending:
    """A request submitted to a simulated engine and not answered yet: its prompt, the
    output ``pieces`` (text, token id) it will produce, the queue its progress arrives
    on (``("tokens", pieces)`` then ``("done", RequestResult)``) and how many pieces
    were handed out so far."""

    request_id: str
    prompt: list[int]
    pieces: list[tuple[str, int]]
    queue: asyncio.Queue[tuple[str, Any]]
    lora: str | None = None
    salt: str | None = None
    emitted: int = 0
    remote: int = 0
    """Prompt tokens whose KV comes from a remote prefill engine (a decode step)."""


def error_body(message: str, status: int) -> dict[str, Any]:
    """vLLM's error body for HTTP ``status``."""
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def request_lora(body: dict[str, Any], model: str, loras: Sequence[str]) -> str | None:
    """The LoRA a request names in ``model`` (None: the base ``model``);
    :class:`SimBadRequest` (404) for a model that is not served."""
    asked = body.get("model")
    if asked is None or asked == model:
        return None
    if asked in loras:
        return str(asked)
    raise SimBadRequest(f"The model `{asked}` does not exist.", 404)


def prompt_tokens(tokenizer: SimTokenizer, body: dict[str, Any], *, chat: bool) -> list[int]:
    """The prompt's token ids: ``messages`` through the chat template when ``chat``,
    else ``prompt`` as text, token ids, or a one-text list; :class:`SimBadRequest` when
    neither is usable."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SimBadRequest("'messages' must be a non-empty list")
        return tokenizer.encode_chat(
            messages,
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
        )
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return tokenizer.encode(prompt[0])
    raise SimBadRequest("'prompt' must be a string or a list of token ids")


def request_options(
    body: dict[str, Any], *, chat: bool, default_max_tokens: int
) -> tuple[int, str | None]:
    """``(max_tokens, cache_salt)`` of a request (``max_completion_tokens`` for chat when
    given); :class:`SimBadRequest` for a bad value or ``n`` other than 1."""
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise SimBadRequest(f"'{key}' must be a positive integer")
    n = body.get("n", 1)
    if n != 1:
        raise SimBadRequest("only n=1 is supported")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise SimBadRequest("'cache_salt' must be a string")
    return max_tokens, salt or None


def usage_body(p: Pending, result: RequestResult) -> dict[str, Any]:
    """The ``usage`` of an answer; ``cached_tokens`` is what the engine did not compute:
    reused (GPU and CPU tiers) and, for a disaggregated decode, received from the
    prefill engine (vLLM counts the connector's tokens as computed before the step)."""
    cached = result.gpu_hit_tokens + result.cpu_hit_tokens + result.remote_tokens
    return {
        "prompt_tokens": len(p.prompt),
        "total_tokens": len(p.prompt) + len(p.pieces),
        "completion_tokens": len(p.pieces),
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_body(
    rid: str,
    model: str,
    created: int,
    text: str,
    usage: dict[str, Any],
    *,
    chat: bool,
    kv_transfer_params: dict[str, Any] | None = None,
) -> bytes:
    """A whole (non-streamed) completion or chat completion, as JSON bytes (with the
    ``kv_transfer_params`` a prefill step answers, when given)."""
    choice: dict[str, Any]
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    doc: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }
    if kv_transfer_params is not None:
        doc["kv_transfer_params"] = kv_transfer_params
    return json.dumps(doc).encode()


async def sse_chunks(
    p: Pending,
    rid: str,
    model: str,
    created: int,
    *,
    chat: bool,
    include_usage: bool,
    usage: Callable[[Pending, RequestResult], dict[str, Any]],
) -> AsyncIterator[bytes]:
    """The SSE events of a streamed answer as ``p``'s progress arrives: a role delta
    (chat), one chunk per batch of tokens, a last chunk with ``finish_reason``, a
    usage-only chunk when ``include_usage`` (from ``usage(p, result)``, called once),
    and ``data: [DONE]``."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], use: Any = None) -> bytes:
        d: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if use is not None:
            d["usage"] = use
        return b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n"

    if chat:
        yield chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        )
    while True:
        kind, value = await p.queue.get()
        if kind == "tokens":
            text = "".join(s for s, _ in value)
            part: dict[str, Any] = (
                {"index": 0, "delta": {"content": text}, "finish_reason": None}
                if chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
            )
            yield chunk([part])
            continue
        use = usage(p, value)
        last: dict[str, Any] = (
            {"index": 0, "delta": {}, "finish_reason": "length"}
            if chat
            else {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
        )
        yield chunk([last])
        if include_usage:
            yield chunk([], use)
        yield b"data: [DONE]\n\n"
        return


def models_body(model: str, loras: Sequence[str], max_model_len: int) -> dict[str, Any]:
    """``GET /v1/models``: the base ``model`` and one card per LoRA adapter."""
    created = 0
    data = [
        {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "kvevents",
            "root": model,
            "parent": None,
            "max_model_len": max_model_len,
        }
    ]
    for lora in loras:
        data.append(
            {
                "id": lora,
                "object": "model",
                "created": created,
                "owned_by": "kvevents",
                "root": f"/loras/{lora}",
                "parent": model,
                "max_model_len": None,
            }
        )
    return {"object": "list", "data": data}
