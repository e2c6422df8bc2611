"""The optional compiled core: which modules mypyc compiles, and which build is in use.

The package is pure Python and a plain ``pip install`` stays pure.  In a source or
editable checkout, ``python -m kvevents.compiled build`` compiles the modules listed in
:data:`MODULES` with mypyc (needs ``mypy``, ``setuptools`` and a C compiler; see
:mod:`kvevents.compiled.build`) into extension files next to their ``.py`` files;
Python's import system then prefers the extension files, so the compiled core is picked
automatically.  ``python -m kvevents.compiled clean`` removes them again.

Both builds run the same source and must give identical results (a differential test
checks it).  Two guards keep them from drifting apart:

* ``KVEVENTS_PURE_PYTHON=1`` in the environment forces the ``.py`` modules even when
  compiled ones are present (a meta-path finder installed by ``kvevents/__init__.py``).
* The build writes a manifest of its sources' digests; when a listed source changed
  since the build, the stale extension files are ignored (pure Python is used) and a
  :class:`RuntimeWarning` says so.

:func:`active` says whether the compiled core is what imports pick; ``kvevents
--version`` prints :func:`describe`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

#: The modules the compiled core holds: the block index's rooms, the router's prompt walk
#: and the content keys (the apply and find_matches hot loops), chosen by measurement
#: (docs/benchmarks.md, "Compiled core").
MODULES: tuple[str, ...] = (
    "kvevents.consumers.index",
    "kvevents.consumers.index.apply",
    "kvevents.consumers.index.block_index",
    "kvevents.consumers.index.eviction",
    "kvevents.consumers.index.join",
    "kvevents.consumers.index.layout",
    "kvevents.consumers.index.legacy",
    "kvevents.consumers.index.marks",
    "kvevents.consumers.index.queries",
    "kvevents.consumers.index.records",
    "kvevents.consumers.index.refs",
    "kvevents.consumers.index.snapshot",
    "kvevents.consumers.index.stats",
    "kvevents.consumers.index.stores",
    "kvevents.consumers.index.workers",
    "kvevents.consumers.router.walk",
    "kvevents.consumers.content",
)

#: Set to ``1`` to force the pure-Python modules even where a compiled build is present.
PURE_ENV = "KVEVENTS_PURE_PYTHON"

#: mypyc's group name: the shared library all compiled modules load is
#: ``kvevents_compiled_core__mypyc<suffix>`` at the checkout's root (mypyc derives each
#: module's ``__file__`` from it being there).
GROUP = "kvevents_compiled_core"

ROOT = Path(__file__).resolve().parent.parent.parent
#: Written by the build: the Python that built it and each source's size, mtime, digest.
MANIFEST = ROOT / "kvevents" / "compiled" / "manifest.json"


if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr as mypyc_attr
else:

    def mypyc_attr(*attrs: str, **kwattrs: Any) -> Any:
        """``mypy_extensions.mypyc_attr`` where it matters (mypyc reads it when compiling;
        its name resolves there through this module), a no-op here.  The index marks
        ``serializable=True`` on the classes its snapshot rebuilds without ``__init__``."""
        return lambda cls: cls


def source_path(module: str) -> Path:
    """The ``.py`` file of a listed module (a package's ``__init__.py``)."""
    rel = Path(*module.split("."))
    pkg = ROOT / rel / "__init__.py"
    return pkg if pkg.exists() else (ROOT / rel).with_suffix(".py")


def extension_files(module: str) -> list[Path]:
    src = source_path(module)
    stem = "__init__" if src.name == "__init__.py" else src.stem
    return [
        src.with_name(stem + suffix)
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
        if src.with_name(stem + suffix).exists()
    ]


def digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def pure_forced() -> bool:
    """True when ``KVEVENTS_PURE_PYTHON`` asks for the pure-Python modules."""
    return os.environ.get(PURE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def stale_sources() -> list[str]:
    """The listed modules whose source changed since the compiled build (empty when there
    is no build, or it is fresh).  A size and mtime match skips reading the file."""
    try:
        manifest = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return []
    if manifest.get("python") != sys.implementation.cache_tag:
        return []  # another interpreter's build: its extension files never load here
    stale = []
    recorded = manifest.get("sources", {})
    for module in MODULES:
        entry = recorded.get(module)
        src = source_path(module)
        if entry is None:
            stale.append(module)
            continue
        try:
            st = src.stat()
            if [st.st_size, st.st_mtime_ns] != entry[:2] and digest(src) != entry[2]:
                stale.append(module)
        except OSError:
            stale.append(module)
    return stale


@dataclass(frozen=True)
class BuildStatus:
    """Where the compiled core stands in this interpreter."""

    present: tuple[str, ...]  #: listed modules with an extension file next to their source
    stale: tuple[str, ...]  #: listed modules whose source changed since the build
    forced_pure: bool  #: ``KVEVENTS_PURE_PYTHON`` is set
    loaded: tuple[str, ...]  #: listed modules already imported from an extension file

    @property
    def active(self) -> bool:
        """The compiled modules are what imports pick (present, fresh, not forced off)."""
        return bool(self.present) and not self.stale and not self.forced_pure


def status() -> BuildStatus:
    """Inspect the build without importing any listed module."""
    present = tuple(m for m in MODULES if extension_files(m))
    loaded = tuple(m for m in MODULES if _is_extension(sys.modules.get(m)))
    return BuildStatus(present, tuple(stale_sources()) if present else (), pure_forced(), loaded)


def _is_extension(module: ModuleType | None) -> bool:
    return module is not None and isinstance(
        getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader
    )


def active() -> bool:
    """True when imports of the listed modules give the compiled build."""
    return status().active


def describe() -> str:
    """Which build imports pick, in a few words (``kvevents --version`` shows it)."""
    st = status()
    if not st.present:
        return "pure Python"
    if st.forced_pure:
        return f"pure Python: {PURE_ENV}=1"
    if st.stale:
        return "pure Python: the compiled core is stale"
    return f"compiled core: mypyc, {len(st.present)} modules"


class _PureFinder(importlib.abc.MetaPathFinder):
    """Finds every ``kvevents.*`` module from its ``.py`` file only (no extension files)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("kvevents.") or path is None:
            return None
        loader = (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES)
        for entry in path:
            spec = importlib.machinery.FileFinder(entry, loader).find_spec(fullname, target)
            if spec is not None and spec.loader is not None:
                return spec
        return None


def select_build() -> None:
    """Run when this package is imported, which ``kvevents/__init__.py`` does first,
    before any listed module is imported: keep the
    compiled modules when they are fresh and wanted, else make imports take the ``.py``
    files.  Costs one ``stat`` when no compiled build exists."""
    if any(type(f).__name__ == "_PureFinder" for f in sys.meta_path):
        return
    if pure_forced():
        sys.meta_path.insert(0, _PureFinder())
        return
    if not MANIFEST.exists():
        return
    stale = stale_sources()
    if stale:
        import warnings

        warnings.warn(
            f"kvevents: the compiled core is older than its sources ({', '.join(stale[:3])}"
            f"{' ...' if len(stale) > 3 else ''} changed); using pure Python. Rebuild it "
            "with `python -m kvevents.compiled build` or remove it with `... clean`.",
            RuntimeWarning,
            stacklevel=2,
        )
        sys.meta_path.insert(0, _PureFinder())


select_build()
