"""What the simulated engine keys a block by, computed the way vLLM 0.33's request block
hasher does (``generate_block_hash_extra_keys`` / ``to_event_extra_keys`` in
``vllm/v1/core/kv_cache_utils.py``).

This module is the engine side's own reading of vLLM and deliberately does not reuse the
consumer side's :func:`kvevents.request.block_extra_keys`: the differential test compares
the router (built on that function) with this engine, so a disagreement between the two
readings shows up as a wrong prediction instead of cancelling out.

*Hash-side* extra keys of the block ``[start, end)`` are tagged tuples, concatenated in this
order (the tuple is ``None`` when empty):

1. ``("lora", name, path)`` when the request has a LoRA adapter;
2. ``("mm", identifier, offset - start)`` for every multimodal input the block overlaps,
   walking the offset-sorted inputs from a start index (0 on the request's first hashing
   call, the *last* input on later calls, as vLLM's incremental hasher does);
3. ``("cache_salt", salt)`` on the block starting at token 0 only;
4. ``("prompt_embeds", sha256(rows[start:end]))`` when the prompt came as embeddings.

*Event-side* extra keys (``BlockStored.extra_keys[i]``) are the same values untagged: the
LoRA name, ``(identifier, offset)``, the salt, the digest.

*Lookahead hashing* (``L > 0``, speculative decoding with EAGLE): the hash of the block
``[start, end)`` also covers the next ``L`` tokens; the hash-side extra keys become
``(E, t)`` for ``L == 1`` and ``(E, t1, …, tL)`` otherwise, with ``E`` the extra keys over
``[start, end + L)``, and the hash exists only once those tokens do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvevents.request import MMFeature

__all__ = ["SimKey", "event_extra_keys", "hash_extra_keys", "lora_path", "untag_extra_keys"]


def lora_path(name: str) -> str:
    """The adapter path the simulated engine loads LoRA ``name`` from (part of the hash,
    never on the wire)."""
    return f"/loras/{name}"


@dataclass(frozen=True)
class SimKey:
    """The fields of a request the engine's hasher reads (vLLM's ``Request``): prompt
    tokens live elsewhere; these are the extras.  ``mm_features`` are offset-sorted;
    ``prompt_embeds`` has one ``bytes`` row per prompt token."""

    lora_name: str | None = None
    cache_salt: str | None = None
    mm_features: tuple[MMFeature, ...] = ()
    prompt_embeds: tuple[bytes, ...] | None = None


def _mm_keys(feats: Sequence[MMFeature], start: int, end: int, first: int) -> list[tuple[str, int]]:
    """``(identifier, offset - start)`` for the inputs overlapping ``[start, end)``,
    walking from input index ``first`` (vLLM's ``_gen_mm_extra_hash_keys``)."""
    out: list[tuple[str, int]] = []
    if not feats:
        return out
    last = feats[-1]
    if last.offset + last.length <= start:
        return out
    i = first
    while i < len(feats):
        f = feats[i]
        if end <= f.offset:
            break  # the block ends before this input starts
        if start >= f.offset + f.length:
            i += 1  # the block is past this input
            continue
        out.append((f.identifier, f.offset - start))
        if end >= f.offset + f.length:
            i += 1  # this input ends inside the block: the next may start here too
        else:
            break
    return out


def hash_extra_keys(
    key: SimKey, start: int, end: int, *, first_mm: int = 0
) -> tuple[Any, ...] | None:
    """vLLM's hash-side extra keys of ``[start, end)`` (tagged; ``None`` when empty)."""
    out: list[Any] = []
    if key.lora_name is not None:
        out.append(("lora", key.lora_name, lora_path(key.lora_name)))
    for ident, off in _mm_keys(key.mm_features, start, end, first_mm):
        out.append(("mm", ident, off))
    if start == 0 and key.cache_salt:
        out.append(("cache_salt", key.cache_salt))
    if key.prompt_embeds is not None:
        rows = key.prompt_embeds[start:end]
        out.append(("prompt_embeds", hashlib.sha256(b"".join(rows)).digest()))
    return tuple(out) if out else None


def untag_extra_keys(tagged: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """vLLM's ``to_event_extra_keys``: each tagged key to its untagged wire value."""
    if not tagged:
        return None
    out: list[Any] = []
    for k in tagged:
        tag = k[0]
        if tag == "lora":
            out.append(k[1])
        elif tag == "mm":
            out.append((k[1], k[2]))
        else:  # cache_salt, prompt_embeds
            out.append(k[1])
    return tuple(out)


def event_extra_keys(key: SimKey, start: int, end: int) -> tuple[Any, ...] | None:
    """The ``extra_keys`` entry of the block ``[start, end)`` on a GPU ``BlockStored``
    (``start``/``end`` are the *group's* block boundaries, as vLLM's ``cache_full_blocks``
    passes them)."""
    return untag_extra_keys(hash_extra_keys(key, start, end))
