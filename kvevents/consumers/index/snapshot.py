"""Write a :class:`~kvevents.consumers.BlockIndex` to bytes and read it back.

One job: the index's snapshot format.  It lives in the index package because it walks
the index's own state (every object of a class of this package, generically), so no
module outside the package touches the index's insides.  Imports no other index module.

The format is versioned msgpack (msgspec): a header ``{"format", "kvevents", "schema"}``
and the index's whole state, so a restored index answers every query exactly as the
original did and goes on applying the same stream.  That works across processes, machines
and Python versions because content keys are a stable algorithm
(:mod:`kvevents.consumers.content`), not CPython's ``hash()``.

The state is the index's own objects, walked generically: containers are tagged lists
(``["d", keys, values]`` for a dict, ...), ints beyond 64 bits (the index packs records
into wide ints) travel as bytes, so do arrays of numbers (little-endian), and objects of the index package's classes are written
once and referenced after (several tables share them).  ``schema`` names every class and
its fields: a snapshot is refused with :class:`~kvevents.errors.ConfigError` when the
running kvevents lays its index out differently, rather than restored wrongly.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from kvevents.errors import ConfigError
from kvevents.version import __version__

__all__ = ["SNAPSHOT_FORMAT", "restore_index", "snapshot_index"]

SNAPSHOT_FORMAT = 3
"""Version of the snapshot layout, bumped whenever the encoding below changes (3: packed
records carry the free-link bit, the GPU refcount one bit higher); snapshots of other
versions are refused."""

_I64_MIN, _U64_MAX = -(1 << 63), (1 << 64) - 1
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder()


def _fields(obj: Any) -> list[str]:
    cls = type(obj)
    names: list[str] = []
    for klass in reversed(cls.__mro__):
        for s in getattr(klass, "__slots__", ()):
            if s not in names and s not in ("__dict__", "__weakref__"):
                names.append(s)
    if hasattr(obj, "__dict__"):
        names.extend(k for k in vars(obj) if k not in names)
    return names


def _pack_int_dict(d: dict[Any, Any]) -> list[Any] | None:
    """A dict of unsigned 64-bit int keys and int values (the index's big tables) as
    ``["D", keys as <u8, value width in bytes, values as little-endian signed]``, or
    None when it is not one.  Walking such dicts one entry at a time is what makes a
    generic encoding slow."""
    if not d:
        return None
    keys = list(d)
    values = list(d.values())
    if not all(type(k) is int for k in keys) or not all(type(x) is int for x in values):
        return None
    if min(keys) < 0 or max(keys) > _U64_MAX:
        return None
    width = max(max(x.bit_length() for x in values) // 8 + 1, 1)
    try:
        kb = struct.pack(f"<{len(keys)}Q", *keys)
    except struct.error:
        return None
    vb = b"".join(x.to_bytes(width, "little", signed=True) for x in values)
    return ["D", kb, width, vb]


_PRIM = (type(None), bool, str, bytes, float)


def _plain(x: Any) -> bool:
    """A primitive msgpack carries as is, or a tuple of such (or of such tuples)."""
    t = type(x)
    if t is int:
        return bool(_I64_MIN <= x <= _U64_MAX)
    if t in _PRIM:
        return True
    if t is tuple:
        return all(_plain(y) for y in x)
    return False


def _lists(x: Any) -> Any:
    """Tuples (nested) as lists, for msgpack."""
    if type(x) is not tuple:
        return x
    return [_lists(y) if type(y) is tuple else y for y in x]


def _tuples(x: Any) -> Any:
    """Lists (nested) back to tuples: the inverse of :func:`_lists` for plain values."""
    if type(x) is not list:
        return x
    return tuple([_tuples(y) if type(y) is list else y for y in x])


def _pack_plain_dict(d: dict[Any, Any], tag: str) -> list[Any] | None:
    """A dict (or OrderedDict: ``tag``) whose keys and values are all plain, as
    ``[tag, keys, values]`` with tuples as lists: one msgpack array each, read back in
    two comprehensions instead of one generic walk per element."""
    if not all(map(_plain, d)) or not all(map(_plain, d.values())):
        return None
    return [tag, [_lists(k) for k in d], [_lists(v) for v in d.values()]]


def _sorted(items: Any) -> list[Any]:
    """``items`` in an order that depends on their values only (hashes are ints or
    bytes: sorted by type, then value)."""
    try:
        return sorted(items, key=lambda x: (type(x).__name__, x))
    except TypeError:
        return sorted(items, key=repr)


def _le_bytes(a: array[Any]) -> bytes:
    """An array's items as little-endian bytes (its own byte order is the machine's)."""
    if sys.byteorder == "little":
        return a.tobytes()
    b = array(a.typecode, a)  # pragma: no cover - big-endian machines
    b.byteswap()  # pragma: no cover
    return b.tobytes()  # pragma: no cover


def _unpack_int_dict(v: list[Any]) -> dict[int, int]:
    _, kb, width, vb = v
    keys = struct.unpack(f"<{len(kb) // 8}Q", kb)
    frm = int.from_bytes
    values = [frm(vb[i : i + width], "little", signed=True) for i in range(0, len(vb), width)]
    if len(values) != len(keys):
        raise ValueError("packed table is truncated")
    return dict(zip(keys, values))


class _Writer:
    def __init__(self, package: str, forms: Mapping[type, Callable[[Any], Any]]) -> None:
        self.module = package + "."
        self.forms = forms
        self.converted: dict[int, Any] = {}  # id of an object -> its written form
        self.ids: dict[int, int] = {}
        self.keep: list[Any] = []  # keeps ids stable while walking
        self.schema: dict[str, list[str]] = {}

    def enc(self, v: Any) -> Any:
        t = type(v)
        if v is None or t is bool or t is str or t is float or t is bytes:
            return v
        if t is int:
            if _I64_MIN <= v <= _U64_MAX:
                return v
            n = (v.bit_length() + 8) // 8
            return ["i", v.to_bytes(n, "little", signed=True)]
        if t is list:
            if all(map(_plain, v)):
                return ["lp", [_lists(x) for x in v]]
            ids = self.ids
            if v and all(id(x) in ids for x in v):  # objects already written: refs only
                return ["lr", [ids[id(x)] for x in v]]
            return ["l", [self.enc(x) for x in v]]
        if t is tuple:
            return ["t", [self.enc(x) for x in v]]
        if t is dict:
            packed = _pack_int_dict(v) or _pack_plain_dict(v, "dp")
            if packed is not None:
                return packed
            return ["d", [self.enc(k) for k in v], [self.enc(x) for x in v.values()]]
        if t is OrderedDict:
            packed = _pack_plain_dict(v, "op")
            if packed is not None:
                return packed
            return ["o", [self.enc(k) for k in v], [self.enc(x) for x in v.values()]]
        if t is Counter:
            return ["c", [self.enc(k) for k in v], [self.enc(x) for x in v.values()]]
        if t is deque:
            return ["q", [self.enc(x) for x in v], v.maxlen]
        if t is array:
            return ["a", v.typecode, _le_bytes(v)]
        if t is set or t is frozenset:  # (sorted: equal sets give equal bytes)
            return ["s" if t is set else "f", [self.enc(x) for x in _sorted(v)]]
        form = self.forms.get(t)
        if form is not None:  # written as another object (one per object: refs stay)
            done = self.converted.get(id(v))
            if done is None:
                done = self.converted[id(v)] = form(v)
                self.keep.append(v)
            return self.enc(done)
        if not t.__module__.startswith(self.module) and not dataclasses.is_dataclass(v):
            raise ConfigError(f"cannot snapshot a {t.__module__}.{t.__qualname__}")
        ref = self.ids.get(id(v))
        if ref is not None:
            return ["r", ref]
        ref = self.ids[id(v)] = len(self.ids)
        self.keep.append(v)
        names = _fields(v)
        key = f"{t.__module__}:{t.__qualname__}"
        self.schema.setdefault(key, names)
        extra = None
        if isinstance(v, dict):  # a dict subclass with attributes (counted marks)
            extra = self.enc(dict(v))
        return ["n", ref, key, [self.enc(getattr(v, f)) for f in names], extra]


class _Reader:
    def __init__(self, schema: dict[str, list[str]]) -> None:
        self.schema = schema
        self.objs: dict[int, Any] = {}

    def dec(self, v: Any) -> Any:
        if type(v) is not list:
            return v
        tag = v[0]
        if tag == "l":
            return [self.dec(x) for x in v[1]]
        if tag == "t":
            return tuple(self.dec(x) for x in v[1])
        if tag in ("d", "o", "c"):
            pairs = zip((self.dec(k) for k in v[1]), (self.dec(x) for x in v[2]))
            return (
                dict(pairs)
                if tag == "d"
                else OrderedDict(pairs)
                if tag == "o"
                else Counter(dict(pairs))
            )
        if tag == "q":
            return deque((self.dec(x) for x in v[1]), v[2])
        if tag == "s":
            return {self.dec(x) for x in v[1]}
        if tag == "f":
            return frozenset(self.dec(x) for x in v[1])
        if tag == "i":
            return int.from_bytes(v[1], "little", signed=True)
        if tag == "a":
            a = array(v[1])
            a.frombytes(v[2])
            if sys.byteorder != "little":  # pragma: no cover - written little-endian
                a.byteswap()
            return a
        if tag == "D":
            return _unpack_int_dict(v)
        if tag in ("dp", "op"):
            keys = [_tuples(k) if type(k) is list else k for k in v[1]]
            vals = [_tuples(x) if type(x) is list else x for x in v[2]]
            return dict(zip(keys, vals)) if tag == "dp" else OrderedDict(zip(keys, vals))
        if tag == "lp":
            return [_tuples(x) if type(x) is list else x for x in v[1]]
        if tag == "lr":
            objs = self.objs
            return [objs[i] for i in v[1]]
        if tag == "r":
            return self.objs[v[1]]
        if tag == "n":
            _, ref, key, values, extra = v
            cls = _resolve(key)
            obj: Any = cls.__new__(cls)  # type: ignore[call-overload]
            self.objs[ref] = obj
            for name, value in zip(self.schema[key], values):
                object.__setattr__(obj, name, self.dec(value))
            if extra is not None:
                dict.update(obj, self.dec(extra))
            return obj
        raise ConfigError(f"not a kvevents index snapshot (tag {tag!r})")


def _resolve(key: str) -> type:
    import importlib

    module, _, qualname = key.partition(":")
    if not module.startswith("kvevents.consumers"):
        raise ConfigError(f"snapshot names a class outside the index: {key}")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        raise ConfigError(f"snapshot names an unknown class {key}")
    return obj


def _has_instance_dict(cls: type) -> bool:
    """Whether instances of ``cls`` have a ``__dict__`` (a class of its MRO without
    ``__slots__``, or with ``__dict__`` among them)."""
    return any(
        "__dict__" in getattr(k, "__slots__", ("__dict__",)) for k in cls.__mro__ if k is not object
    )


def _current_schema(schema: dict[str, list[str]]) -> list[str]:
    """Classes whose fields differ from the snapshot's (by a fresh instance's slots)."""
    bad = []
    for key, names in schema.items():
        cls = _resolve(key)
        slots: list[str] = []
        for klass in reversed(cls.__mro__):
            for s in getattr(klass, "__slots__", ()):
                if s not in slots and s not in ("__dict__", "__weakref__"):
                    slots.append(s)
        if dataclasses.is_dataclass(cls):
            expected = [f.name for f in dataclasses.fields(cls)]
            if sorted(expected) != sorted(names):
                bad.append(key)
        elif slots and not _has_instance_dict(cls) and sorted(slots) != sorted(names):
            bad.append(key)
    return bad


def snapshot_index(index: Any, forms: Mapping[type, Callable[[Any], Any]] | None = None) -> bytes:
    """The state of ``index`` (a :class:`~kvevents.consumers.BlockIndex`) as bytes.

    ``forms`` maps a type outside the index package to the function that gives the
    object of the package written in its place (the compiled core's tables, written as
    the Python tables they equal: both cores' snapshots are the same bytes)."""

    w = _Writer(type(index).__module__.rpartition(".")[0], forms or {})
    state = w.enc(index)
    header = {"format": SNAPSHOT_FORMAT, "kvevents": __version__, "schema": w.schema}
    return _ENC.encode([header, state])


def restore_index(data: bytes) -> Any:
    """A :class:`~kvevents.consumers.BlockIndex` from :func:`snapshot_index` bytes.

    Raises :class:`ConfigError` when ``data`` is not a snapshot, has another format
    version, or lays the index out differently from this kvevents.
    """
    try:
        header, state = _DEC.decode(data)
        fmt = header["format"]
        schema = header["schema"]
    except (msgspec.DecodeError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"not a kvevents index snapshot: {exc}") from exc
    if fmt != SNAPSHOT_FORMAT:
        raise ConfigError(f"index snapshot format {fmt}; this kvevents reads {SNAPSHOT_FORMAT}")
    bad = _current_schema(schema)
    if bad:
        raise ConfigError(
            f"index snapshot from kvevents {header.get('kvevents')} lays out "
            f"{', '.join(bad)} differently; replay the stream instead"
        )
    try:
        return _Reader(schema).dec(state)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"corrupt index snapshot: {exc}") from exc
