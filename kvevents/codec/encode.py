"""Encoding a KV event batch: exactly vLLM 0.33's payload bytes.

One job: :func:`encode_batch` and the one msgpack encoder (:data:`ENCODER`) every
encoding in the codec shares.  Imports msgspec, the events and the errors.
"""

from __future__ import annotations

import msgspec

from kvevents.errors import EncodeError
from kvevents.events import EventBatch

__all__ = ["ENCODER", "encode_batch"]

ENCODER = msgspec.msgpack.Encoder()
"""The msgpack encoder of every kvevents payload (``msgspec.msgpack.Encoder()``)."""


def encode_batch(batch: EventBatch) -> bytes:
    """Encode ``batch`` to the msgpack payload frame, byte-identical to vLLM 0.33.

    Raises :class:`~kvevents.errors.EncodeError` for objects msgpack cannot carry.
    """
    try:
        return ENCODER.encode(batch)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise EncodeError(f"cannot encode batch: {exc}") from exc
