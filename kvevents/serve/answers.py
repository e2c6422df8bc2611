"""Shapes of HTTP bodies the service reads and writes: OpenAI's error body, a request
body decoded as JSON, an upstream error's message, the ``cached_tokens`` an engine
reports, and the hop-by-hop headers a proxy must not forward.

One job: bytes and dicts in, plain values out (no I/O).  Imports only msgspec and
:mod:`kvevents.serve.tokens` (for :class:`~kvevents.serve.tokens.BadRequest`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

import msgspec

from kvevents.serve.tokens import BadRequest

__all__ = [
    "BODY_CAP_BYTES",
    "HOP_HEADERS",
    "SSE_TAIL_BYTES",
    "cached_tokens",
    "decode_json_body",
    "error_body",
    "error_message",
]

HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
"""Headers (lower case) that belong to one connection and are not forwarded either way."""

SSE_TAIL_BYTES = 1 << 16
"""How much of the end of a streamed answer is kept to find its ``usage`` (bytes)."""

BODY_CAP_BYTES = 8 << 20
"""How much of a non-streamed answer is kept to find its ``usage`` (bytes)."""


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}`` for an
    HTTP ``status``; ``param`` names the request field at fault (None: none in
    particular)."""
    kind = {
        400: "invalid_request_error",
        404: "not_found_error",
        502: "upstream_error",
        503: "service_unavailable",
        504: "upstream_timeout",
    }.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def decode_json_body(raw: bytes) -> Any:
    """``raw`` decoded as JSON; :class:`BadRequest` (400) if it is not JSON."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise BadRequest("the request body is not valid JSON") from None


def error_message(answer: Any) -> str | None:
    """The message of an upstream error answer (OpenAI's ``error.message``, or a
    ``message`` / ``detail`` field), or None when it has none."""
    if isinstance(answer, Mapping):
        if isinstance(answer.get("error"), Mapping):
            return str(answer["error"].get("message"))
        if answer.get("message"):
            return str(answer["message"])
        if answer.get("detail"):
            return str(answer["detail"])
    return None


def cached_tokens(body: bytes, stream: bool) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an answer (the last SSE event
    carrying usage when ``stream``), or None."""
    docs: list[Any] = []
    if stream:
        for event in reversed(body.split(b"\n\n")):
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and b'"usage"' in line:
                    with contextlib.suppress(ValueError):
                        docs.append(json.loads(line[5:].strip()))
            if docs:
                break
    else:
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            docs.append(json.loads(body))
    for doc in docs:
        usage = doc.get("usage") if isinstance(doc, dict) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and not isinstance(cached, bool):
            return cached
    return None
