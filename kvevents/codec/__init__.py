"""Encoding and decoding of KV event batches and of their ZMQ frames.

* :func:`encode_batch` writes exactly the bytes vLLM 0.33's ``ZmqEventPublisher`` sends.
* :func:`decode_batch` / :class:`BatchDecoder` read every shape a live producer sends:
  map events (vLLM ≥ 0.24) with unknown or missing optional keys, positional
  array events of every historical length (vLLM ≤ 0.23), 2- and 3-element batches,
  missing ``medium`` / ``lora_name`` / ``lora_id``, int (signed or unsigned 64-bit) or
  bytes hashes, and map-shaped batches (``{"ts", "events", rank}``) from other producers.
  An event with an unknown ``type`` tag is skipped and counted; the rest of the batch is
  kept.  Anything else raises :class:`~kvevents.errors.DecodeError`, and no other
  exception type escapes, whatever the payload's size or nesting depth: a payload nested
  deeper than Python's recursion limit lets msgspec walk (about 1,000 levels by default;
  :data:`MAX_NESTING_DEPTH` when the process raised that limit) is a ``DecodeError``.
* Frame helpers build and parse the live message ``[topic, seq, payload]`` and the
  replay request/reply that vLLM's ``ZmqEventPublisher`` answers on its
  ROUTER socket.

:meth:`BatchDecoder.decode_raw_tokens` is a faster path for consumers that only hash or
forward token ids: GPU stores keep ``token_ids`` as the undecoded msgpack array
(:class:`RawTokensBlockStored`), so no Python int is built per token; turning 64 token ids
into ints is about 60 % of decoding a 4-block GPU store.

Decoding tries the fastest typed path first (map events, then array events) and only
falls back to a generic walk when the payload needs it, so well-formed vLLM traffic pays
no tolerance tax.

The package's rooms: :mod:`~kvevents.codec.encode` (encoding),
:mod:`~kvevents.codec.decode` (``BatchDecoder``), :mod:`~kvevents.codec.raw_tokens` (the
raw-token types), :mod:`~kvevents.codec.layouts` (the field layouts of every producer
generation and the generic walk's helpers), :mod:`~kvevents.codec.guards` (nesting and
buffer guards), :mod:`~kvevents.codec.shape` (``describe_payload``) and
:mod:`~kvevents.codec.frames` (the ZMQ frames).  This module only re-exports them.
"""

from kvevents.codec.decode import BatchDecoder, DecodeStats, decode_batch
from kvevents.codec.encode import encode_batch
from kvevents.codec.frames import (
    END_SEQ,
    LiveMessage,
    ReplayReply,
    pack_live,
    pack_replay_end,
    pack_replay_reply,
    pack_replay_request,
    pack_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    unpack_seq,
)
from kvevents.codec.guards import MAX_NESTING_DEPTH
from kvevents.codec.raw_tokens import RawTokensBatch, RawTokensBlockStored, RawTokensEvent
from kvevents.codec.shape import WireShape, describe_payload

__all__ = [
    "END_SEQ",
    "MAX_NESTING_DEPTH",
    "BatchDecoder",
    "DecodeStats",
    "LiveMessage",
    "RawTokensBatch",
    "RawTokensBlockStored",
    "RawTokensEvent",
    "ReplayReply",
    "WireShape",
    "decode_batch",
    "describe_payload",
    "encode_batch",
    "pack_live",
    "pack_replay_end",
    "pack_replay_reply",
    "pack_replay_request",
    "pack_seq",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "unpack_seq",
]
