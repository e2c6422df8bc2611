"""What a payload's shape says about its producer's version (``describe_payload``).

One job: infer the vLLM release range that could have written a payload, from its
event form, batch length, map keys and positional event lengths.  Imports msgspec, the
errors, the layouts and the decode guards.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvevents.codec.guards import guarded
from kvevents.codec.layouts import ARRAY_FIELDS, foreign_positional, split_batch
from kvevents.errors import DecodeError

__all__ = ["WireShape", "describe_payload"]

# Inclusive (first, last) 0.x minor releases that can write an array event of a given
# element count (tag included).  Boundaries follow the field history of vLLM's
# ``kv_events.py`` and the golden vectors; where a field's first release is only known to a
# range, both neighbours are allowed.
_STORED_LEN_MINORS = {6: (9, 11), 7: (11, 15), 8: (13, 18), 9: (16, 20), 10: (19, 22), 12: (21, 23)}
_REMOVED_LEN_MINORS = {2: (9, 11), 3: (11, 20), 4: (19, 23)}
_MAP_KEY_MINORS = (  # newest first: a key present means "at least this release"
    ("lookahead_token_ids", 33),
    ("session_id", 30),
    ("ownership", 29),
    ("locality", 26),
)


@dataclass(frozen=True)
class WireShape:
    """What a payload's shape says about its producer.

    ``event_form`` is ``"map"`` (vLLM >= 0.24), ``"array"`` (<= 0.23), ``"mixed"`` or
    ``"none"`` (no events).  ``vllm_versions`` is the narrowest vLLM release range the
    shape fits (``"0.11-0.15"``, ``">=0.26"``), or ``""`` when it says nothing or fits
    no known release (a newer or foreign producer).
    """

    event_form: str
    batch_elements: int
    vllm_versions: str


def describe_payload(payload: bytes | bytearray | memoryview) -> WireShape:
    """Infer the producer's wire generation from a payload's shape.

    Raises :class:`DecodeError` if the payload is not a msgpack batch (nothing else
    escapes).
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise DecodeError(f"payload must be bytes, got {type(payload).__name__}")
    return guarded(_describe, payload)


def _describe(payload: bytes | bytearray | memoryview) -> WireShape:
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, TypeError) as exc:
        raise DecodeError(f"$: not a msgpack document: {exc}") from exc
    _, events, _ = split_batch(raw)
    n = len(raw) if isinstance(raw, (list, tuple)) else 0
    forms = {"array" if isinstance(e, (list, tuple)) else "map" for e in events}
    form = forms.pop() if len(forms) == 1 else ("mixed" if forms else "none")
    lo, hi = (9, 9) if n == 2 else (10, 99) if n == 3 else (0, 99)
    if form == "map":
        lo = max(lo, 24)
        keys = {k for e in events if isinstance(e, dict) for k in e}
        lo = max([lo] + [minor for key, minor in _MAP_KEY_MINORS if key in keys])
    elif form == "array":
        hi = min(hi, 23)
        tables = {"BlockStored": _STORED_LEN_MINORS, "BlockRemoved": _REMOVED_LEN_MINORS}
        for e in events:
            table = tables.get(e[0]) if e and isinstance(e[0], str) else None
            if table is not None:
                first, last = table.get(len(e), (0, -1))
                if foreign_positional(e[0], dict(zip(ARRAY_FIELDS[e[0]], e[1:]))):
                    first, last = 0, -1  # a value no vLLM release wrote in that slot
                lo, hi = max(lo, first), min(hi, last)
    if form in ("mixed",) or lo > hi or (lo, hi) == (0, 99):
        versions = ""
    elif hi == 99:
        versions = f">=0.{lo}"
    elif lo == hi:
        versions = f"0.{lo}"
    else:
        versions = f"0.{max(lo, 9)}-0.{hi}"
    return WireShape(form, n, versions)
