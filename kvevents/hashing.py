"""Block hashing as a vLLM engine does it (the simulator emits the same hashes).

Engine hashes are what a vLLM engine puts on the wire::

    digest(block) = H((parent_digest or NONE_HASH, tuple(token_ids), extra_keys or None))
    NONE_HASH     = H(seed)          # seed: $PYTHONHASHSEED, else "vllm-none-hash"
    wire(digest)  = int.from_bytes(digest, "big") & (2**64 - 1)

where ``H`` is SHA-256 of ``pickle.dumps(obj, HIGHEST_PROTOCOL)`` (``"sha256"``) or of
``cbor2.dumps(obj, canonical=True)`` (``"sha256_cbor"``).  The simulator uses these to
emit the same hashes as a real engine.  The router's own content keys, independent of
any engine's algorithm or seed, are in :mod:`kvevents.consumers.content`.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from kvevents.errors import ConfigError, MissingDependencyError

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "HASH_ALGORITHMS",
    "hash_block_tokens",
    "hash_function",
    "hash_request_blocks",
    "none_hash",
    "to_wire_hash",
]

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    try:
        import cbor2
    except ImportError as exc:
        raise MissingDependencyError(
            "vLLM's sha256_cbor block hashes need cbor2, which is not installed: "
            "pip install 'kvevents[cbor]'"
        ) from exc
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


HASH_ALGORITHMS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
}
"""vLLM's reproducible prefix-caching hash functions, by ``prefix_caching_hash_algo``."""


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """The digest function for ``algo`` (``"sha256"`` or ``"sha256_cbor"``)."""
    try:
        return HASH_ALGORITHMS[algo]
    except KeyError:
        raise ConfigError(
            f"unknown hash algorithm {algo!r}; known: {', '.join(sorted(HASH_ALGORITHMS))}"
        ) from None


def _env_seed() -> str:
    """``$PYTHONHASHSEED`` whenever it is set (even to ""), else the default seed."""
    seed = os.environ.get("PYTHONHASHSEED")
    return DEFAULT_NONE_HASH_SEED if seed is None else seed


def none_hash(algo: str = "sha256_cbor", seed: str | None = None) -> bytes:
    """vLLM's ``NONE_HASH``: the parent digest of a sequence's first block.

    ``seed`` defaults to ``$PYTHONHASHSEED`` if set (even to ``""``, as vLLM reads it),
    else ``"vllm-none-hash"``.
    """
    if seed is None:
        seed = _env_seed()
    return hash_function(algo)(seed)


def hash_block_tokens(
    parent: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
    *,
    algo: str = "sha256_cbor",
    none: bytes | None = None,
) -> bytes:
    """The digest of one full block chained on ``parent`` (``None`` for the first block)."""
    if parent is None:
        parent = none if none is not None else none_hash(algo)
    return hash_function(algo)((parent, tuple(token_ids), extra_keys))


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256_cbor",
    seed: str | None = None,
    extra_keys: Callable[[int], tuple[Any, ...] | None] | None = None,
) -> list[bytes]:
    """Digests of every *full* block of ``token_ids`` at ``block_size`` tokens per block.

    ``extra_keys(i)`` gives the hash-side extra keys of block ``i`` (``None`` if none).
    Raises :class:`~kvevents.errors.ConfigError` (a ``ValueError``) unless
    ``block_size > 0``, and for an unknown ``algo``.
    """
    if block_size <= 0:
        raise ConfigError(f"block_size must be positive, got {block_size}")
    fn = hash_function(algo)
    parent = fn(seed if seed is not None else _env_seed())
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = fn((parent, block, extra_keys(i) if extra_keys else None))
        out.append(parent)
    return out


def to_wire_hash(digest: bytes) -> int:
    """The int a vLLM publisher sends for ``digest``: its last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")
