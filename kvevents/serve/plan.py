"""One request's plan: its body checked, its tokens, its request key and the engine ranks
ranked for it.

One job: parse → tokens → key → rank, the same for ``POST /v1/completions``,
``POST /v1/chat/completions`` (which then forward the request, :mod:`kvevents.serve.proxy`)
and ``POST /route`` (which answers the ranking).  A request that cannot be planned raises
:class:`~kvevents.serve.tokens.BadRequest` naming the field at fault, answered as OpenAI's
400.  Imports the fleet, routing, tokens and upstream rooms, all below it; nothing here
calls back into the application.

The request key is what the engine will hash: the tokens, the LoRA adapter when
``model`` names one of the engines' adapters (a ``/v1/models`` card with a ``parent``, as
vLLM picks the adapter by ``model``), and the ``cache_salt``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvevents.errors import ConfigError
from kvevents.request import RequestKey
from kvevents.serve.answers import decode_json_body
from kvevents.serve.fleet import Fleet
from kvevents.serve.routing import Ranked, RoutingPolicy
from kvevents.serve.tokens import (
    BadRequest,
    LocalTokenizer,
    build_key,
    check_body,
    tokenize_body,
    tokenize_request_body,
)
from kvevents.serve.upstream import EngineClients

__all__ = ["Planner", "RequestPlan"]


@dataclass(frozen=True)
class RequestPlan:
    """What the service decided for one request: the ``raw`` body (forwarded unchanged),
    the checked ``body``, whether it is a ``chat``, its ``tokens`` and ``key``, and the
    engine ranks that are up ``ranked`` best first (empty: none is available)."""

    raw: bytes
    body: dict[str, Any]
    chat: bool
    tokens: list[int]
    key: RequestKey
    ranked: list[Ranked]

    @property
    def stream(self) -> bool:
        """Whether the answer is a server-sent event stream."""
        return self.body.get("stream") is True


class Planner:
    """Plans requests against ``fleet`` with ``policy``; tokenises with ``local`` when
    given, else through an engine's ``/tokenize`` (``upstream``, which also knows the
    engines' models and adapters)."""

    def __init__(
        self,
        fleet: Fleet,
        policy: RoutingPolicy,
        upstream: EngineClients,
        local: LocalTokenizer | None = None,
    ) -> None:
        self.fleet = fleet
        self.policy = policy
        self.upstream = upstream
        self.local = local

    async def plan(self, raw: bytes, chat: bool | None = None) -> RequestPlan:
        """The plan of the request body ``raw``: a chat when ``chat`` (``None``: when it
        has ``messages``, as ``/route`` takes either).  :class:`BadRequest` if it cannot
        be planned."""
        body = decode_json_body(raw)
        if chat is None:
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            chat = "messages" in body
            if not chat and body.get("prompt") is None and body.get("prompt_token_ids") is None:
                raise BadRequest("give 'prompt', 'prompt_token_ids' or 'messages'", param="prompt")
        body = check_body(body, chat)
        tokens = await self.tokens(body, chat)
        try:
            key = build_key(tokens, body, self.upstream.loras)
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
        model = body.get("model")
        return RequestPlan(raw, body, chat, tokens, key, self.rank(key, model))

    async def tokens(self, body: dict[str, Any], chat: bool) -> list[int]:
        """Token ids of a checked ``body``: its own token ids, the local tokenizer's, else
        an engine's ``/tokenize``."""
        tokens = tokenize_body(body, chat, self.local)
        if tokens is not None:
            return tokens
        payload = tokenize_request_body(body, chat)
        assert payload is not None  # token-id prompts were answered by tokenize_body
        return await self.upstream.tokenize(payload)

    def rank(self, key: RequestKey, model: str | None = None) -> list[Ranked]:
        """The up engine ranks for ``key``, best first.  With ``model``, only engines
        that list it in ``/v1/models`` are candidates, when any does (an engine whose
        list is unknown yet stays a candidate)."""
        now = time.monotonic()
        ranks = [st for st in self.fleet.ranks if self.fleet.is_up(st.engine.name, now)]
        listed = self.upstream.engine_models
        if model is not None and any(model in m for m in listed.values()):
            ranks = [st for st in ranks if model in listed.get(st.engine.name, {model})]
        return self.policy.rank(key, ranks)
