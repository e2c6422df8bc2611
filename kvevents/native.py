"""Which core runs: the optional compiled core (``kvevents-native``) or pure Python.

One job: load the compiled core once, at import, and say which core is in use.  The core
is its own distribution in this repository (``pip install ./native``); kvevents uses it
when it imports and ``KVEVENTS_NATIVE`` is not ``0``.  ``KVEVENTS_NATIVE=0`` forces pure
Python; ``KVEVENTS_NATIVE=1`` requires the core (importing kvevents fails without it, so
a test run meant for the compiled core cannot silently run pure Python).  Every answer is
the same either way: the Python code is the specification the core is tested against.

Also :func:`native_decode`, the compiled wire parser's reading of a payload as the
:class:`~kvevents.events.KVEventBatch` the Python decoder would return (for the
differential tests and tools; hot paths read the parsed batch directly).  Imports msgspec,
the events and, when present, ``kvevents_native``.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import msgspec

from kvevents.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

__all__ = ["NATIVE", "batch_from_parsed", "core_name", "native_decode", "native_version"]

_SETTING = os.environ.get("KVEVENTS_NATIVE", "").strip()
_REQUIRED = (
    "Lookups",
    "RecordTable",
    "RetainedQueue",
    "SlotMarks",
    "assembler",
    "gpu_remove_run",
    "gpu_store_blocks",
    "parse_batch",
    "prompt_keys",
    "walk",
)
"""What kvevents calls in the core: a build without one of them is not used."""


def _load() -> tuple[ModuleType | None, str]:
    if _SETTING == "0":
        return None, "KVEVENTS_NATIVE=0"
    try:
        import kvevents_native
    except ImportError as exc:
        if _SETTING == "1":
            raise ImportError(
                "KVEVENTS_NATIVE=1 but the compiled core does not import "
                f"({exc}); build it with `pip install ./native`"
            ) from exc
        return None, "kvevents-native not installed"
    missing = [name for name in _REQUIRED if not hasattr(kvevents_native, name)]
    if missing:  # an older build than this kvevents: rebuild it
        why = f"kvevents-native {kvevents_native.__version__} lacks {', '.join(missing)}"
        if _SETTING == "1":
            raise ImportError(f"KVEVENTS_NATIVE=1 but {why}; rebuild: `pip install ./native`")
        return None, why
    return kvevents_native, ""


NATIVE, _WHY_PYTHON = _load()
"""The ``kvevents_native`` module, or ``None`` when pure Python runs."""


def native_version() -> str | None:
    """The compiled core's version, or ``None`` when pure Python runs."""
    return None if NATIVE is None else str(NATIVE.__version__)


def core_name() -> str:
    """Which core runs, in words: ``"native 0.1.0"``, or ``"python"`` with the reason
    (``"python, KVEVENTS_NATIVE=0"``, ``"python, kvevents-native not installed"``)."""
    if NATIVE is not None:
        return f"native {NATIVE.__version__}"
    return f"python, {_WHY_PYTHON}"


_EXTRA = msgspec.msgpack.Decoder(list[tuple[Any, ...] | None])
_LOOKAHEAD = msgspec.msgpack.Decoder(list[list[int]])


def _event(t: tuple[Any, ...]) -> KVEvent:
    if t[0] == "BlockStored":
        extra = None if t[8] is None else _EXTRA.decode(t[8])
        lookahead = None if t[15] is None else _LOOKAHEAD.decode(t[15])
        return BlockStored(*t[1:8], extra, *t[9:15], lookahead)  # type: ignore[call-arg]
    if t[0] == "BlockRemoved":
        return BlockRemoved(*t[1:])
    return AllBlocksCleared()


def batch_from_parsed(parsed: Any) -> KVEventBatch:
    """The :class:`~kvevents.events.KVEventBatch` a ``kvevents_native.ParsedBatch``
    holds (one Python object per event: for checks and tools, not for hot paths)."""
    events = [_event(parsed.event(i)) for i in range(len(parsed))]
    return KVEventBatch(parsed.ts, events, parsed.data_parallel_rank)


def native_decode(payload: bytes | bytearray | memoryview) -> KVEventBatch | None:
    """The compiled parser's reading of ``payload``, or ``None`` when it leaves the
    payload to the Python decoder (a shape it does not read natively, malformed input
    included) or when pure Python runs."""
    if NATIVE is None:
        return None
    parsed = NATIVE.parse_batch(payload)
    return None if parsed is None else batch_from_parsed(parsed)
