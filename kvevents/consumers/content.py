"""The index's content keys: chained keys over canonical token units.

The block index keys every *canonical unit* (``canonical_block_size`` tokens) of a
sequence by a chained 64-bit key over the tokens so far, the LoRA name and the event-side
extra keys.  Nothing here depends on an engine's hash algorithm or seed, so one index
serves engines with any algorithm, seed or block size (a multiple of the canonical size).

The keys are built for speed (the router computes one per 16 prompt tokens on every
request): ``hash((parent, tokens_of_unit))`` over a tuple of ints, which CPython computes
with its xxHash-based tuple hash.  Int and tuple hashing is *not* randomised by
``PYTHONHASHSEED``, so the keys are deterministic for a given 64-bit CPython; strings
(LoRA names) and extra keys are first reduced to ints with BLAKE2b.  The keys are private
to one process (never sent anywhere), and are not meant to resist a deliberate collision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

__all__ = ["ROOT_KEY", "chain_units", "extra_key", "prompt_keys", "root_key"]

ROOT_KEY = 0
"""The parent key of a sequence's first unit without a LoRA adapter."""


@lru_cache(maxsize=4096)
def root_key(lora_name: str | None) -> int:
    """The parent key of a sequence's first unit under ``lora_name`` (``None``: no LoRA)."""
    if lora_name is None:
        return ROOT_KEY
    digest = hashlib.blake2b(b"kvevents-lora\x00" + lora_name.encode("utf-8"), digest_size=8)
    return int.from_bytes(digest.digest(), "little", signed=True)


def _normalise(value: Any) -> Any:
    """Lists become tuples, recursively (a decoded extra key has lists where tuples were)."""
    if isinstance(value, (list, tuple)):
        return tuple(_normalise(v) for v in value)
    return value


def extra_key(extra: Any) -> int:
    """A deterministic int for one block's event-side extra keys (C§4.2)."""
    text = repr(_normalise(extra)).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def chain_units(parent: int, tokens: Sequence[int], unit: int) -> int:
    """The key of the last unit of ``tokens`` (a whole number of units) chained on ``parent``."""
    t = tuple(tokens)
    k = parent
    for a in range(0, len(t), unit):
        k = hash((k, t[a : a + unit]))
    return k


def prompt_keys(tokens: Sequence[int], unit: int, lora_name: str | None = None) -> list[int]:
    """Keys of every whole canonical unit of a prompt: ``keys[j]`` covers tokens ``[0, (j+1)·unit)``."""
    k = root_key(lora_name)
    out: list[int] = []
    append = out.append
    # zip over one iterator yields the whole units as tuples (a partial tail is dropped)
    for unit_tokens in zip(*[iter(tokens)] * unit):
        k = hash((k, unit_tokens))
        append(k)
    return out
