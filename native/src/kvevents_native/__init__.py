"""kvevents' optional compiled core (C++17, nanobind).

kvevents imports it when it is installed (``pip install ./native``) and
``KVEVENTS_NATIVE`` is not ``0``; kvevents works the same without it.  What it holds:
:func:`parse_batch`, a bounded reader of vLLM's KV-event msgpack wire that builds no
Python object per event, and the content-key kernels :func:`prompt_keys` and
:func:`chain_units` (the xxh3-64 chain of :mod:`kvevents.consumers.content`), and
:func:`walk` and :func:`assembler`, the router's prefix walk and the assembly of its
answer (:mod:`kvevents.consumers.router.walk`), and :class:`SlotMarks`, a tier's marks
(content key -> slots holding it) in flat tables the walk reads directly
(:mod:`kvevents.consumers.index.marks`), and :class:`RecordTable`, a KV-cache group's
metadata records (engine hash -> packed record) in a flat table
(:mod:`kvevents.consumers.index.records`), and :class:`RetainedQueue`, the records kept
for late joins, oldest first (:mod:`kvevents.consumers.index.join`), and :class:`Lookups`,
the router's per-worker lookup by vLLM's rules over the tier marks
(:mod:`kvevents.consumers.router.lookup`).
"""

from kvevents_native._core import (
    Lookups,
    ParsedBatch,
    RecordTable,
    RetainedQueue,
    SlotMarks,
    __version__,
    assembler,
    chain_units,
    gpu_remove_run,
    gpu_store_blocks,
    parse_batch,
    prompt_keys,
    walk,
)

__all__ = [
    "Lookups",
    "ParsedBatch",
    "RecordTable",
    "RetainedQueue",
    "SlotMarks",
    "__version__",
    "assembler",
    "chain_units",
    "gpu_remove_run",
    "gpu_store_blocks",
    "parse_batch",
    "prompt_keys",
    "walk",
]
