"""The index's content keys: chained keys over canonical token units.

The block index keys every *canonical unit* (``canonical_block_size`` tokens) of a
sequence by a chained 64-bit key over the tokens so far and what vLLM mixes into its block
hashes besides tokens.  Nothing here depends on an engine's hash algorithm or seed, so
one index serves engines with any algorithm, seed or block size (a multiple of the unit).

The same key must come out of a block's ``BlockStored`` event (its ``lora_name`` and
per-block event-side ``extra_keys``) and out of a request (:class:`kvevents.RequestKey`),
whatever the engine's block size.  vLLM puts extra keys on *engine* blocks (a salt on
the block starting at token 0, a multimodal input's offset relative to the block), so
they are first brought to a block-size-free form:

* the LoRA name and the cache salt go into the *root* key (the parent of unit 0): vLLM
  puts the name in every block and the salt in block 0, and both chain into every later
  block, so a chain rooted on them carries the same information;
* a multimodal input ``(identifier, offset)`` is folded into the unit holding its first
  placeholder token (absolute position ``block start + offset``); blocks it only
  continues into (negative offsets) add nothing, their chain already holds it.  (vLLM's
  keys also depend on the input's length, which the event does not carry; an input's
  identifier fixes its length in practice.)
* a prompt-embeds digest (``bytes``) and anything this module does not recognise are
  folded at the end of the engine block that carries them: such keys do depend on the
  engine's block size (:func:`request_keys` takes it);
* speculative decoding's lookahead tokens (``lookahead_token_ids``) are part of a block's
  identity but not of its children's chain (they are the children's first tokens), so a
  block hashed with lookahead is *marked* under ``lookahead_key(chain, tokens)`` while its
  children chain on the plain key.

**The keys are stable**: the same in every process, machine and Python version, so an
index snapshot taken by one router can be restored by another.  The algorithm (test
vectors in ``tests/consumers/test_content_keys.py``):

* tokens are packed as little-endian signed 64-bit integers (:func:`pack_tokens`);
* unit ``j``'s key is ``xxh3_64(packed tokens of unit j, seed=key of unit j-1)``, an
  unsigned 64-bit int; the seed of unit 0 is the root key;
* the root key is 0 without LoRA and salt, else the first 8 bytes (little-endian) of
  ``blake2b(b"kvevents-lora\0" + name [+ b"\0kvevents-salt\0" + salt], digest_size=8)``;
* a multimodal input folds as ``xxh3_64(b"mm" + id8 + offset as <i8, seed=key)`` where
  ``id8`` is ``blake2b(b"kvevents-mm\0" + identifier, digest_size=8)``; a tail element
  (prompt-embeds digest) as ``xxh3_64(b"tail" + blake2b-8 of it, seed=key)``; a lookahead
  mark as ``xxh3_64(b"la" + packed lookahead tokens [+ (id8, <i8 offset) per input],
  seed=chain)``.

Chaining with xxh3's seed costs one C call per unit on a slice of the packed prompt.
They are not meant to resist a deliberate collision.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from xxhash import xxh3_64_intdigest as _xxh

from kvevents.errors import ConfigError
from kvevents.native import NATIVE
from kvevents.request import RequestKey, embeds_digest

__all__ = [
    "ROOT_KEY",
    "EventExtras",
    "StoreTokens",
    "chain_block",
    "chain_units",
    "extra_key",
    "lookahead_key",
    "lookahead_mm",
    "pack_tokens",
    "prompt_keys",
    "request_keys",
    "root_key",
    "split_extras",
    "store_tokens",
]

ROOT_KEY = 0
"""The parent key of a sequence's first unit without LoRA adapter or salt."""


_I8 = struct.Struct("<q")
_ID_OFF = struct.Struct("<Qq")


def _b2(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian signed 64-bit integers, the bytes content keys hash.

    Raises :class:`~kvevents.errors.ConfigError` for an id that is not an int in the
    signed 64-bit range: such a sequence has no content key.
    """
    try:
        return struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error as exc:
        raise ConfigError(f"token ids must be integers in the signed 64-bit range: {exc}") from exc


def _chain_packed(k: int, buf: bytes | memoryview, width: int) -> int:
    """Chain ``k`` over whole units of ``width`` bytes of ``buf``."""
    mv = memoryview(buf)
    for a in range(0, len(mv), width):
        k = _xxh(mv[a : a + width], k)
    return k


@lru_cache(maxsize=4096)
def root_key(lora_name: str | None, cache_salt: str | None = None) -> int:
    """The parent key of a sequence's first unit under a LoRA adapter and cache salt."""
    if lora_name is None and cache_salt is None:
        return ROOT_KEY
    data = b"kvevents-lora\x00" + lora_name.encode("utf-8") if lora_name is not None else b""
    if cache_salt is not None:
        data += b"\x00kvevents-salt\x00" + cache_salt.encode("utf-8")
    return _b2(data)


@lru_cache(maxsize=4096)
def _str_int(s: str) -> int:
    return _b2(b"kvevents-mm\x00" + s.encode("utf-8"))


def _normalise(value: Any) -> Any:
    """Lists become tuples, recursively (a decoded extra key has lists where tuples were)."""
    if isinstance(value, (list, tuple)):
        return tuple(_normalise(v) for v in value)
    return value


def extra_key(extra: Any) -> int:
    """A deterministic int for an extra-key element this module folds as a whole."""
    if isinstance(extra, bytes):
        return _b2(b"kvevents-bytes\x00" + extra)
    return _b2(repr(_normalise(extra)).encode("utf-8"))


def _mm_fold(k: int, identifier: str, offset_in_unit: int) -> int:
    return _xxh(b"mm" + _ID_OFF.pack(_str_int(identifier), offset_in_unit), k)


def _tail_fold(k: int, item: Any) -> int:
    return _xxh(b"tail" + extra_key(item).to_bytes(8, "little"), k)


def lookahead_key(chain: int, tokens: Sequence[int], mm: Sequence[tuple[str, int]] = ()) -> int:
    """The mark key of a block whose hash also covers the next ``tokens`` (lookahead).

    ``mm`` are the ``(identifier, offset from the block end)`` of multimodal inputs that
    start among those tokens (vLLM computes a lookahead block's extra keys over the
    widened window).
    """
    data = b"la" + pack_tokens(tokens)
    for i, o in mm:
        data += _ID_OFF.pack(_str_int(i), o)
    return _xxh(data, chain)


class EventExtras:
    """One block's event-side extra keys in block-size-free form (see the module doc)."""

    __slots__ = ("mm", "salt", "tail")

    def __init__(self, salt: str | None, mm: list[tuple[str, int]], tail: list[Any]) -> None:
        self.salt = salt
        self.mm = mm
        """``(identifier, offset from the block start)`` of inputs starting in the block."""
        self.tail = tail
        """Elements folded at the block end (prompt-embeds digests, unknown shapes)."""


def split_extras(extra: Any, lora_name: str | None, first_block: bool) -> EventExtras | None:
    """Sort one block's event-side extra keys by how they enter the content key.

    ``extra`` is the block's entry of ``BlockStored.extra_keys`` (vLLM's order: LoRA name,
    ``(identifier, offset)`` per multimodal input, salt on the block at token 0,
    prompt-embeds digest); ``first_block`` says whether the block starts at token 0.
    Returns ``None`` when nothing but the LoRA name (already in the root) is there.
    """
    if extra is None:
        return None
    items = list(extra) if isinstance(extra, (list, tuple)) else [extra]
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    if not items:
        return None
    salt: str | None = None
    mm: list[tuple[str, int]] = []
    tail: list[Any] = []
    for x in items:
        if (
            isinstance(x, (list, tuple))
            and len(x) == 2
            and isinstance(x[0], str)
            and type(x[1]) is int
        ):
            if x[1] >= 0:
                mm.append((x[0], x[1]))
        elif isinstance(x, str) and first_block and salt is None and not tail:
            salt = x
        else:
            tail.append(x)
    if salt is None and not mm and not tail:
        return None
    return EventExtras(salt, mm, tail)


def chain_units(parent: int, tokens: Sequence[int], unit: int) -> int:
    """The key of the last unit of ``tokens`` (a whole number of units) chained on ``parent``."""
    return _chain_packed(parent, pack_tokens(tokens), 8 * unit)


def chain_block(parent: int, tokens: Sequence[int], unit: int, extras: EventExtras | None) -> int:
    """The chain key at the end of one engine block (``tokens``, a whole number of units)
    chained on ``parent``, with the block's extras (the salt is the root's business)."""
    return _chain_block_packed(parent, memoryview(pack_tokens(tokens)), unit, extras)


def _chain_block_packed(parent: int, mv: memoryview, unit: int, extras: EventExtras | None) -> int:
    """:func:`chain_block` over the block's packed token ids."""
    width = 8 * unit
    if extras is None:
        k = parent
        for a in range(0, len(mv), width):
            k = _xxh(mv[a : a + width], k)
        return k
    starts: dict[int, list[tuple[str, int]]] = {}
    for ident, off in extras.mm:
        # (an input starting at or after the block end is a lookahead-window input: the
        # caller folds it into the block's lookahead key, see lookahead_mm)
        starts.setdefault(off // unit, []).append((ident, off % unit))
    k = parent
    for j, a in enumerate(range(0, len(mv), width)):
        k = _xxh(mv[a : a + width], k)
        for ident, off in starts.get(j, ()):
            k = _mm_fold(k, ident, off)
    for item in extras.tail:
        k = _tail_fold(k, item)
    return k


class StoreTokens:
    """One event's token ids, packed once, from which each block's chain key is made.

    :meth:`block_key` equals :func:`chain_block` over the block's tokens; when some id of
    the event cannot be packed, each block's own ids are packed instead, so a bad id
    costs only the blocks that hold it.
    """

    __slots__ = ("packed", "tokens", "unit")

    def __init__(self, tokens: Sequence[int], unit: int) -> None:
        self.tokens = tokens
        self.unit = unit
        self.packed: memoryview | None
        try:
            self.packed = memoryview(pack_tokens(tokens))
        except ConfigError:
            self.packed = None

    def block_key(self, parent: int, start: int, size: int, extras: EventExtras | None) -> int:
        """The chain key of the block of ``size`` tokens from ``start``, chained on
        ``parent``.  Raises :class:`~kvevents.errors.ConfigError` when its ids are not
        all signed 64-bit ints."""
        packed = self.packed
        if packed is None:
            return chain_block(parent, self.tokens[start : start + size], self.unit, extras)
        if extras is None and size == self.unit:  # (the usual block: one unit)
            return _xxh(packed[8 * start : 8 * (start + size)], parent)
        return _chain_block_packed(
            parent, packed[8 * start : 8 * (start + size)], self.unit, extras
        )


def store_tokens(tokens: Sequence[int], unit: int) -> StoreTokens:
    """The :class:`StoreTokens` of one event's token ids.  A sequence that makes its own
    (a ``store_tokens(unit)`` method: the compiled core's token ids of
    :mod:`kvevents.consumers.index.bulk`, already packed, with native keys) is asked
    for it; its keys must equal :meth:`StoreTokens.block_key`'s."""
    if type(tokens) is not list:
        own = getattr(tokens, "store_tokens", None)
        if own is not None:
            made: StoreTokens = own(unit)
            return made
    return StoreTokens(tokens, unit)


def lookahead_mm(extras: EventExtras | None, block_size: int) -> list[tuple[str, int]]:
    """The multimodal inputs of a block's extras that start in its lookahead window, as
    ``(identifier, offset from the block end)``."""
    if extras is None:
        return []
    return [(i, o - block_size) for i, o in extras.mm if o >= block_size]


def prompt_keys(
    tokens: Sequence[int], unit: int, lora_name: str | None = None, cache_salt: str | None = None
) -> list[int]:
    """Keys of every whole canonical unit of a prompt: ``keys[j]`` covers tokens ``[0, (j+1)·unit)``.

    The compiled core computes the same keys when it runs (:mod:`kvevents.native`)."""
    k = root_key(lora_name, cache_salt)
    if NATIVE is not None and unit > 0:
        try:
            keys: list[int] = NATIVE.prompt_keys(tokens, unit, k)
        except (TypeError, OverflowError) as exc:
            raise ConfigError(
                f"token ids must be integers in the signed 64-bit range: {exc}"
            ) from exc
        return keys
    out: list[int] = []
    append = out.append
    width = 8 * unit
    mv = memoryview(pack_tokens(tokens))
    for a in range(0, len(mv) - width + 1, width):  # a partial tail is dropped
        k = _xxh(mv[a : a + width], k)
        append(k)
    return out


def request_keys(key: RequestKey, unit: int, block_size: int | None = None) -> list[int]:
    """Chain keys of every whole unit of a request, as the index computes them from events.

    ``keys[j]`` covers tokens ``[0, (j+1)·unit)``.  With prompt embeddings the keys depend
    on the engine's block size (digests are folded at its block ends): pass
    ``block_size``; without them it is ignored.
    """
    feats = key.mm_features
    embeds = key.prompt_embeds
    if not feats and embeds is None:
        return prompt_keys(key.tokens, unit, key.lora_name, key.cache_salt)
    starts: dict[int, list[tuple[str, int]]] = {}
    for f in feats:
        starts.setdefault(f.offset // unit, []).append((f.identifier, f.offset % unit))
    k = root_key(key.lora_name, key.cache_salt)
    out: list[int] = []
    append = out.append
    width = 8 * unit
    mv = memoryview(pack_tokens(key.tokens))
    n = len(mv) // width
    if embeds is None:
        # plain chaining between the units where an input starts, folds at those units
        pos = 0
        for j in sorted(starts):
            if j >= n:
                break  # the prompt ends before this input's unit
            for a in range(pos * width, (j + 1) * width, width):
                k = _xxh(mv[a : a + width], k)
                append(k)
            for ident, off in starts[j]:
                k = _mm_fold(k, ident, off)
            out[j] = k
            pos = j + 1
        for a in range(pos * width, n * width, width):
            k = _xxh(mv[a : a + width], k)
            append(k)
        return out
    if block_size is None or block_size % unit:
        raise ValueError("prompt-embeds keys need the engine block size (a multiple of unit)")
    per_block = block_size // unit
    for j in range(n):
        k = _xxh(mv[j * width : (j + 1) * width], k)
        for ident, off in starts.get(j, ()):
            k = _mm_fold(k, ident, off)
        if (j + 1) % per_block == 0:
            end = (j + 1) * unit
            k = _tail_fold(k, embeds_digest(embeds, end - block_size, end))
        append(k)
    return out
