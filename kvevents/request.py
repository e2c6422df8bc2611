"""What vLLM keys a prompt's KV blocks by: tokens plus the request's extra keys.

vLLM's prefix cache does not key a block by its tokens alone.  Its block hasher
(``generate_block_hash_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``) mixes in, per
block, the LoRA adapter, every multimodal input the block overlaps, the request's cache
salt (on the block starting at token 0 only) and a digest of the block's slice of the
prompt embeddings.  The same values travel on the block's ``BlockStored`` event, untagged,
in ``extra_keys`` (vLLM's ``to_event_extra_keys``)::

    (lora_name, (mm_identifier, offset_in_block), ..., cache_salt, embeds_digest)

:class:`RequestKey` holds what a request contributes; :func:`block_extra_keys` computes
the event-side extra keys of one block of it.  The block index (to key a request like the
events of the blocks it would hit) and the simulator (to put extra keys on its events)
both use that one function, so the two sides cannot drift.

Extra keys depend on *where blocks start*: an engine that hashes at 16 tokens gives the
salt to block ``[0, 16)`` and a multimodal item at token 20 the offset 4 in block
``[16, 32)``; one hashing at 32 tokens gives them to block ``[0, 32)`` with offset 20.
Always pass the engine's own block boundaries.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union

from kvevents.errors import ConfigError

__all__ = ["MMFeature", "PromptEmbeds", "RequestKey", "block_extra_keys", "embeds_digest"]


class MMFeature(NamedTuple):
    """One multimodal input of a prompt (vLLM's ``mm_features[i]``).

    ``identifier`` is vLLM's ``MultiModalFeatureSpec.identifier`` (the item's content hash,
    what the engine puts in extra keys); ``offset`` is the prompt position of the first
    placeholder token and ``length`` the number of placeholder tokens (vLLM's
    ``PlaceholderRange``).
    """

    identifier: str
    offset: int
    length: int


PromptEmbeds = Union[Sequence[bytes], Callable[[int, int], bytes]]
"""Prompt embeddings, torch-free, in one of two forms:

* a sequence with one ``bytes`` per prompt token: that token's embedding row as raw,
  C-contiguous bytes (``emb[i].contiguous().numpy().tobytes()`` for a torch tensor
  ``emb``).  A block ``[start, end)`` is keyed by ``sha256(b"".join(rows[start:end]))``,
  which equals vLLM's ``sha256`` of the slice's tensor data;
* a callable ``digest(start, end) -> bytes`` returning that digest directly (for callers
  that keep the tensor elsewhere or cached the digests).
"""


@dataclass(frozen=True)
class RequestKey:
    """A prompt as vLLM's prefix cache sees it.

    Only ``tokens`` is required; a plain token list is the same as ``RequestKey(tokens)``.
    ``mm_features`` are sorted by ``offset`` on construction (vLLM keeps them in that
    order).  ``cache_salt`` follows vLLM: an empty salt is no salt.
    """

    tokens: Sequence[int]
    lora_name: str | None = None
    cache_salt: str | None = None
    mm_features: Sequence[MMFeature] = ()
    prompt_embeds: PromptEmbeds | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        feats = tuple(MMFeature(*f) for f in self.mm_features)
        for f in feats:
            if f.offset < 0 or f.length <= 0:
                raise ConfigError(f"bad multimodal placeholder range: {f!r}")
        if any(feats[i].offset > feats[i + 1].offset for i in range(len(feats) - 1)):
            feats = tuple(sorted(feats, key=lambda f: f.offset))
        object.__setattr__(self, "mm_features", feats)
        if self.cache_salt == "":
            object.__setattr__(self, "cache_salt", None)

    @property
    def has_extras(self) -> bool:
        """Whether any block of this request carries extra keys."""
        return (
            self.lora_name is not None
            or self.cache_salt is not None
            or bool(self.mm_features)
            or self.prompt_embeds is not None
        )


def embeds_digest(prompt_embeds: PromptEmbeds, start: int, end: int) -> bytes:
    """The digest vLLM keys block ``[start, end)`` of the prompt embeddings by."""
    if callable(prompt_embeds):
        return prompt_embeds(start, end)
    return hashlib.sha256(b"".join(prompt_embeds[start:end])).digest()


def block_extra_keys(key: RequestKey, start: int, end: int) -> tuple[Any, ...] | None:
    """The event-side extra keys of the block ``[start, end)`` of ``key`` (or ``None``).

    In vLLM's order: the LoRA name; ``(identifier, offset - start)`` for every multimodal
    input the block overlaps (the offset is relative to the block start, negative when the
    input began in an earlier block); the cache salt, only when ``start == 0``; the
    prompt-embeds digest of the block's slice.  ``start`` and ``end`` are the engine's
    block boundaries at its hashing granularity.
    """
    out: list[Any] = []
    if key.lora_name is not None:
        out.append(key.lora_name)
    feats = key.mm_features
    if feats:
        last = feats[-1]
        if last.offset + last.length > start:
            # vLLM's walk over the offset-sorted inputs: skip those that ended before
            # the block, take those it overlaps, stop at the first one that starts after
            # it or runs past its end
            for f in feats:
                if end <= f.offset:
                    break
                if start >= f.offset + f.length:
                    continue
                out.append((f.identifier, f.offset - start))
                if end < f.offset + f.length:
                    break
    if start == 0 and key.cache_salt:
        out.append(key.cache_salt)
    if key.prompt_embeds is not None:
        out.append(embeds_digest(key.prompt_embeds, start, end))
    return tuple(out) if out else None
