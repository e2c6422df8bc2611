"""The KV-connector side of a simulated engine: the ``kv_transfer_params`` a prefill
engine answers with and what a decode engine takes from them, as vLLM's NixlConnector
does.

One job: the disaggregation protocol's parameters (no engine, no server).  A request
whose ``kv_transfer_params`` has ``do_remote_decode`` is a prefill step: the engine
computes the prompt, keeps its blocks cached, and its answer names them
(:func:`prefill_params`, what the connector's ``request_finished`` returns).  A request
whose parameters have ``do_remote_prefill`` is a decode step: the prompt's KV up to
the named blocks comes from the prefill engine instead of being computed
(:func:`remote_prompt_tokens`).  :class:`TransferLog` keeps both sides, for tests.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvevents.sim.http.openai import SimBadRequest

__all__ = ["TransferLog", "prefill_params", "remote_prompt_tokens", "transfer_params"]


def transfer_params(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's ``kv_transfer_params`` (None: absent or null);
    :class:`SimBadRequest` when it is not an object."""
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise SimBadRequest("'kv_transfer_params' must be an object")
    return params


def prefill_params(
    engine_id: str,
    request_id: str,
    block_ids: Sequence[Sequence[int]],
    host: str,
    port: int,
) -> dict[str, Any]:
    """What a prefill engine's answer carries for the decode engine: the flags turned
    round (``do_remote_prefill`` on, ``do_remote_decode`` off), the prompt's block ids
    (a flat list with one KV-cache group, one list per group otherwise), this engine's
    id, the request's id on it, its side channel's host and port, and its tensor
    parallel size."""
    ids: list[Any] = list(block_ids[0]) if len(block_ids) == 1 else [list(g) for g in block_ids]
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": ids,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


def remote_prompt_tokens(params: dict[str, Any], block_size: int, prompt_len: int) -> int:
    """Prompt tokens whose KV a decode step receives: the named blocks' tokens, at most
    the prompt; :class:`SimBadRequest` when the parameters lack what the connector
    needs to pull them."""
    for key in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port"):
        if params.get(key) is None:
            raise SimBadRequest(f"kv_transfer_params with do_remote_prefill needs {key!r}")
    ids = params["remote_block_ids"]
    if not isinstance(ids, list):
        raise SimBadRequest("'remote_block_ids' must be a list")
    first = ids[0] if ids and isinstance(ids[0], list) else ids
    return min(prompt_len, len(first) * block_size)


class TransferLog:
    """The last ``limit`` parameters sent (prefill side) and received (decode side),
    as JSON text, by the prefill engine's request id."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self.sent: OrderedDict[str, str] = OrderedDict()
        self.received: OrderedDict[str, str] = OrderedDict()

    def note(self, side: OrderedDict[str, str], params: dict[str, Any]) -> None:
        side[str(params.get("remote_request_id"))] = json.dumps(params)
        while len(side) > self.limit:
            side.popitem(last=False)

    def lookup(self, request_id: str) -> dict[str, Any]:
        """``{"sent": text | None, "received": text | None}`` for ``request_id``."""
        return {"sent": self.sent.get(request_id), "received": self.received.get(request_id)}
