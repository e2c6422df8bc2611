"""Prefill/decode disaggregation: whether a request is split in two, which engine ranks
take the two steps, and the bodies of the steps in vLLM's KV-connector protocol.

One job: the decision and the wire shapes (no I/O; :mod:`kvevents.serve.proxy` sends
the steps).  Imports msgspec, the plan and routing rooms.

An engine's role (``--engine NAME=...;role=ROLE``) is ``both`` (whole requests),
``prefill`` or ``decode``.  In a fleet with engines of both split roles, a request is
disaggregated when a ``decode`` engine is up and the best ``prefill`` engine would
compute at least ``pd_min_uncached_tokens`` of its prompt (the prompt minus what that
engine holds and what is pending there); otherwise a ``both`` or ``decode`` engine
serves it whole, ranked as usual (a ``prefill`` engine only when nothing else is up).

The prefill rank is the first ``prefill`` engine of the policy's ranking (the KV-aware
cost: prompt tokens to compute plus load).  The decode rank is chosen by load, plus a
small charge per prompt token it does not hold (``DECODE_TRANSFER_WEIGHT``: what it
holds need not be transferred; vLLM's decode side pulls only the blocks its own prefix
cache lacks).  ``round-robin`` and ``random`` choose each step's rank in turn (or at
random) among that role's engines, as baselines.

The two steps (vLLM's toy disaggregation proxy and NixlConnector's ``request_finished``
agree on them):

1. **prefill**: the client's body with ``kv_transfer_params`` set to
   :data:`PREFILL_PARAMS` (``do_remote_decode`` on), ``max_tokens`` 1 (and
   ``max_completion_tokens`` 1 when the body has it), ``stream`` false and no
   ``stream_options``.  The engine computes the prompt, keeps its blocks for the decode
   side to pull, and answers with ``kv_transfer_params`` naming them
   (``do_remote_prefill`` on, ``remote_engine_id``, ``remote_request_id``,
   ``remote_block_ids``, ``remote_host``, ``remote_port``, its parallel sizes);
2. **decode**: the client's body with ``kv_transfer_params`` replaced by the prefill
   answer's, passed through untouched (the JSON value's bytes are copied, never
   re-encoded), streamed back to the client.

Every other field of the client's body is copied byte for byte into both steps.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvevents.serve.plan import RequestPlan
from kvevents.serve.routing import Ranked
from kvevents.serve.tokens import BadRequest

__all__ = [
    "DECODE_TRANSFER_WEIGHT",
    "PREFILL_PARAMS",
    "Disaggregator",
    "PDRoute",
    "answer_params",
    "decode_body",
    "prefill_body",
]

PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""The ``kv_transfer_params`` of a prefill step."""

DECODE_TRANSFER_WEIGHT = 0.1
"""What choosing a decode rank charges per prompt token it does not hold (tokens):
blocks to transfer are cheap next to computing them, so load decides unless loads
are close."""

_RawDoc = dict[str, msgspec.Raw]
_decoder = msgspec.json.Decoder(_RawDoc)
_ONE = msgspec.Raw(b"1")


def _fields(raw: bytes) -> _RawDoc:
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError:
        raise BadRequest("the request body must be a JSON object") from None


def prefill_body(raw: bytes) -> bytes:
    """The prefill step's body for the client's body ``raw`` (see the module
    docstring); every other field is copied byte for byte."""
    doc = _fields(raw)
    doc["kv_transfer_params"] = msgspec.Raw(msgspec.json.encode(PREFILL_PARAMS))
    doc["max_tokens"] = _ONE
    if "max_completion_tokens" in doc:
        doc["max_completion_tokens"] = _ONE
    doc["stream"] = msgspec.Raw(b"false")
    doc.pop("stream_options", None)
    return msgspec.json.encode(doc)


def answer_params(answer: bytes) -> msgspec.Raw | None:
    """The ``kv_transfer_params`` of a prefill answer, as the raw bytes of its JSON
    value (None: absent, null, or the answer is not a JSON object)."""
    try:
        doc = _decoder.decode(answer)
    except msgspec.DecodeError:
        return None
    params = doc.get("kv_transfer_params")
    if params is None or bytes(params).strip() == b"null":
        return None
    return params


def decode_body(raw: bytes, params: msgspec.Raw) -> bytes:
    """The decode step's body: the client's body ``raw`` with ``kv_transfer_params``
    set to the prefill answer's ``params`` (its bytes, untouched)."""
    doc = _fields(raw)
    doc["kv_transfer_params"] = params
    return msgspec.json.encode(doc)


@dataclass(frozen=True)
class PDRoute:
    """Where one request goes.

    ``prefill``: the prefill step's candidates, best first (empty: not disaggregated);
    ``decode``: the decode step's candidates, best first, or, when not disaggregated,
    the candidates that serve it whole; ``whole``: who serves it whole if every
    prefill candidate fails; ``reason``: ``disaggregated``, ``short`` (the best
    prefill engine would compute fewer than the threshold), ``no_decode`` /
    ``no_prefill`` (no engine of that role is up) or ``unsplit`` (no engine has a split
    role); ``uncached``: prompt tokens the best prefill candidate would compute."""

    prefill: list[Ranked]
    decode: list[Ranked]
    whole: list[Ranked] = field(default_factory=list)
    reason: str = "unsplit"
    uncached: int = 0

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    def as_json(self) -> dict[str, Any]:
        """``/route``'s view: the path, and the rank each step would take."""
        return {
            "disaggregated": self.disaggregated,
            "reason": self.reason,
            "prefill": self.prefill[0].as_json() if self.prefill else None,
            "decode": self.decode[0].as_json() if self.decode else None,
            "prefill_uncached_tokens": self.uncached,
        }


def _role(r: Ranked) -> str:
    return r.state.engine.role


class Disaggregator:
    """Decides each request's path (see the module docstring) for ``policy`` with the
    threshold ``min_uncached`` (tokens)."""

    def __init__(self, policy: str, min_uncached: int, seed: int = 0) -> None:
        self.policy = policy
        self.min_uncached = min_uncached
        self._next: dict[str, int] = {}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _turn(self, role: str, cands: list[Ranked]) -> list[Ranked]:
        """Baseline policies: ``cands`` rotated to this role's next (or a random) one."""
        cands = sorted(cands, key=lambda r: (r.state.engine.name, r.state.rank))
        with self._lock:
            if self.policy == "random":
                i = self._rng.randrange(len(cands))
            else:
                i = self._next.get(role, 0) % len(cands)
                self._next[role] = i + 1
        return cands[i:] + cands[:i]

    def route(self, plan: RequestPlan) -> PDRoute:
        """The path of ``plan`` over its ranked candidates (those that are up)."""
        ranked = plan.ranked
        if not any(_role(r) != "both" for r in ranked):
            return PDRoute([], ranked, ranked)
        prefill = [r for r in ranked if _role(r) == "prefill"]
        decode = [r for r in ranked if _role(r) == "decode"]
        whole = [r for r in ranked if _role(r) != "prefill"] + prefill
        if not decode:
            return PDRoute([], whole, whole, "no_decode")
        if not prefill:
            return PDRoute([], whole, whole, "no_prefill")
        kv = self.policy.startswith("kv-aware")
        prefill = prefill if kv else self._turn("prefill", prefill)
        n = len(plan.tokens)
        best = prefill[0]
        uncached = max(0, n - best.match.total - best.pending)
        if uncached < self.min_uncached:
            return PDRoute([], whole, whole, "short", uncached)
        if kv:
            decode = sorted(
                decode,
                key=lambda r: (
                    r.load + DECODE_TRANSFER_WEIGHT * max(0, n - r.match.total),
                    r.state.engine.name,
                    r.state.rank,
                ),
            )
        else:
            decode = self._turn("decode", decode)
        return PDRoute(prefill, decode, whole, "disaggregated", uncached)
