"""The raw-token decode path: ``BlockStored`` events whose token ids stay msgpack.

One job: the event and batch types :meth:`~kvevents.codec.BatchDecoder.decode_raw_tokens`
returns.  A consumer that only hashes or forwards token ids skips building one Python
int per token (about 60 % of decoding a 4-block GPU store).  Imports msgspec, the events,
the errors, the encoder and the decode guards.
"""

from __future__ import annotations

from typing import Union

import msgspec

from kvevents.codec.encode import ENCODER
from kvevents.codec.guards import UNDECODABLE, undecodable
from kvevents.errors import DecodeError
from kvevents.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

__all__ = ["RawTokensBatch", "RawTokensBlockStored", "RawTokensEvent"]

_TOKEN_LIST = msgspec.msgpack.Decoder(list[int])


class RawTokensBlockStored(BlockStored, tag="BlockStored"):
    """A :class:`~kvevents.events.BlockStored` whose ``token_ids`` stay undecoded.

    Derived from ``BlockStored``: the same tag, fields, order and defaults, but
    ``token_ids`` is the payload's own msgpack array as a :class:`msgspec.Raw` (a
    zero-copy view of the payload).  Encoding it writes the same bytes back.  The token
    ids are *not* validated while decoding: :meth:`token_list` validates them (raising
    :class:`~kvevents.errors.DecodeError`), and :meth:`to_stored` builds the plain event,
    which is what code that reads ``token_ids`` as ints must be given.
    """

    token_ids: msgspec.Raw  # type: ignore[assignment]

    def token_list(self) -> list[int]:
        """The token ids as ints; raises :class:`DecodeError` if they are not an int array."""
        try:
            return _TOKEN_LIST.decode(self.token_ids)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise DecodeError(f"BlockStored.token_ids: {exc}") from exc
        except UNDECODABLE as exc:
            raise undecodable(exc, self.token_ids) from exc

    def to_stored(self) -> BlockStored:
        """The equal :class:`~kvevents.events.BlockStored` (token ids decoded and checked)."""
        values = msgspec.structs.astuple(self)
        return BlockStored(values[0], values[1], self.token_list(), *values[3:])

    @classmethod
    def from_stored(cls, event: BlockStored) -> RawTokensBlockStored:
        """``event`` with its token ids re-encoded as msgpack (what a producer sends)."""
        values = msgspec.structs.astuple(event)
        raw = msgspec.Raw(ENCODER.encode(event.token_ids))
        return cls(values[0], values[1], raw, *values[3:])


RawTokensEvent = Union[RawTokensBlockStored, BlockRemoved, AllBlocksCleared]
"""An event as :meth:`BatchDecoder.decode_raw_tokens` returns it."""


class RawTokensBatch(EventBatch):
    """A batch as :meth:`BatchDecoder.decode_raw_tokens` returns it."""

    events: list[RawTokensEvent]
