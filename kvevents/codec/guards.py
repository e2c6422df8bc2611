"""Guards that keep every decode path's failures inside :class:`DecodeError`.

One job: whatever a payload's size or nesting, decoding raises
:class:`~kvevents.errors.DecodeError` and nothing else.  Under Python's usual recursion
limit msgspec stops a too-deep payload with ``RecursionError``; under a raised limit
(above :data:`TRUSTED_RECURSION_LIMIT`) the nesting is first bounded by
:data:`MAX_NESTING_DEPTH` with an iterative walk (:func:`nested_deeper_than`).  Imports
only the errors.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

from kvevents.errors import DecodeError

__all__ = [
    "MAX_NESTING_DEPTH",
    "TRUSTED_RECURSION_LIMIT",
    "UNDECODABLE",
    "bound_nesting",
    "guarded",
    "nested_deeper_than",
    "undecodable",
]

MAX_NESTING_DEPTH = 1000
"""Deepest container nesting decoded when the process raised Python's recursion limit.

msgspec walks nested containers recursively and stops at Python's recursion limit with a
``RecursionError`` (turned into :class:`~kvevents.errors.DecodeError`).  With a limit
raised above 4,000 that stop could come only after the C stack overflows, so the
decoder then checks the payload's nesting against this bound before decoding."""

TRUSTED_RECURSION_LIMIT = 4000
"""Recursion limits up to this keep msgspec's recursion well inside a thread's C stack."""

_T = TypeVar("_T")

# Every decode path (typed, positional, generic) walks nested containers recursively, in
# msgspec and in msgspec.convert.  Under Python's usual recursion limit a too-deep
# payload stops them with RecursionError, which becomes a DecodeError; under a raised
# limit (above TRUSTED_RECURSION_LIMIT) the nesting is first bounded by
# MAX_NESTING_DEPTH, so that no walk can run past the C stack.  A buffer that cannot be
# read (a released or non-contiguous memoryview) is a DecodeError too.
UNDECODABLE = (RecursionError, MemoryError, BufferError, ValueError)
"""Exceptions a decode walk raises for reasons other than the payload's shape."""


def guarded(
    decode: Callable[[bytes | bytearray | memoryview], _T],
    payload: bytes | bytearray | memoryview,
) -> _T:
    """Run ``decode(payload)`` letting only :class:`DecodeError` escape."""
    if sys.getrecursionlimit() > TRUSTED_RECURSION_LIMIT:
        bound_nesting(payload)
    try:
        return decode(payload)
    except DecodeError:
        raise
    except UNDECODABLE as exc:
        raise undecodable(exc, payload) from exc


def bound_nesting(payload: bytes | bytearray | memoryview) -> None:
    """Raise :class:`DecodeError` if ``payload`` nests deeper than :data:`MAX_NESTING_DEPTH`
    (or its buffer cannot be read)."""
    try:
        too_deep = nested_deeper_than(payload, MAX_NESTING_DEPTH)
    except (BufferError, ValueError, TypeError) as exc:
        raise undecodable(exc, payload) from exc
    if too_deep:
        raise DecodeError(f"$: containers nested deeper than {MAX_NESTING_DEPTH} levels")


def undecodable(exc: BaseException, payload: bytes | bytearray | memoryview) -> DecodeError:
    """The :class:`DecodeError` for a failure that is not about the payload's shape."""
    if isinstance(exc, RecursionError):
        return DecodeError(
            "$: containers nested too deeply to decode (past Python's recursion limit)"
        )
    if isinstance(exc, MemoryError):
        return DecodeError(f"$: payload of {len(payload)} bytes is too large to decode")
    return DecodeError(f"$: cannot read the payload buffer: {exc}")


# Bytes after a msgpack type byte, for the scalars of fixed size.
_FIXED_SIZES: dict[int, int] = {
    0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,
}  # fmt: skip
# (length bytes, extra bytes) of the length-prefixed types: bin, ext, str.
_SIZED: dict[int, tuple[int, int]] = {
    0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),
    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),
}  # fmt: skip
# (length bytes, items per entry) of the containers with a length field.
_CONTAINERS: dict[int, tuple[int, int]] = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def nested_deeper_than(data: bytes | bytearray | memoryview, limit: int) -> bool:
    """Whether the msgpack document in ``data`` nests containers more than ``limit`` deep.

    An iterative walk of the type bytes (no recursion, no allocation per value).  It
    stops early on bytes that are not msgpack (the decoder reports those).
    """
    view = memoryview(data).cast("B")
    end = len(view)
    pos = 0
    open_items: list[int] = []  # items still expected by each open container
    while pos < end:
        b = view[pos]
        pos += 1
        items = -1  # a scalar; a container's entry count otherwise
        if b <= 0x7F or b >= 0xE0:
            pass
        elif b <= 0x8F:
            items = 2 * (b & 0x0F)
        elif b <= 0x9F:
            items = b & 0x0F
        elif b <= 0xBF:
            pos += b & 0x1F
        elif b in _FIXED_SIZES:
            pos += _FIXED_SIZES[b]
        elif b in _SIZED:
            width, extra = _SIZED[b]
            pos += width + extra + int.from_bytes(view[pos : pos + width], "big")
        elif b in _CONTAINERS:
            width, per_entry = _CONTAINERS[b]
            items = per_entry * int.from_bytes(view[pos : pos + width], "big")
            pos += width
        else:
            return False  # 0xC1 is never used: not msgpack
        if items >= 0 and len(open_items) >= limit:
            return True  # this container sits at depth len(open_items) + 1
        if items > 0:
            open_items.append(items)
            continue
        while open_items:  # one value is complete
            open_items[-1] -= 1
            if open_items[-1]:
                break
            open_items.pop()
        if not open_items:
            return False  # the document is complete
    return False
