"""Build and remove the optional compiled core (``python -m kvevents.compiled build``).

One job: run mypyc over :data:`kvevents.compiled.MODULES` in place, in a source or
editable checkout, and write the manifest :func:`kvevents.compiled.stale_sources` checks.
The build needs ``mypy`` (which ships mypyc; the ``dev`` extra), ``setuptools`` and a C
compiler; when one is missing it fails with one line saying which, before compiling.
Nothing here runs on a plain install or at import time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from kvevents.compiled import (
    GROUP,
    MANIFEST,
    MODULES,
    PURE_ENV,
    ROOT,
    digest,
    extension_files,
    source_path,
)
from kvevents.errors import KVEventsError

__all__ = ["BuildError", "build", "clean", "shared_libs"]

#: Where mypyc's C sources and the compiler's objects go (ignored by git, like ``build/``).
BUILD_DIR = ROOT / "build" / "kvevents-compiled"

_SETUP = """\
import sys
from setuptools import setup
from mypyc.build import mypycify

paths = sys.argv[1:]
sys.argv[1:] = ["build_ext", "--inplace", "--build-temp", {temp!r}, "--build-lib", {lib!r}]
setup(
    name="kvevents-compiled-core",
    ext_modules=mypycify(paths, opt_level="3", group_name={group!r}, target_dir={target!r}),
)
"""


class BuildError(KVEventsError):
    """The compiled core could not be built; the message says why in one line (plus the
    compiler's last lines when compiling failed)."""


def check_tools() -> None:
    """Raise :class:`BuildError` unless mypyc, setuptools and a C compiler are present."""
    missing = []
    for mod in ("mypyc", "setuptools"):
        try:
            __import__(mod)
        except ImportError:
            missing.append("mypy" if mod == "mypyc" else mod)
    if missing:
        raise BuildError(
            f"missing {' and '.join(missing)}: pip install 'mypy>=1.8' setuptools "
            "(or the dev extra)"
        )
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    if shutil.which(cc.split()[0]) is None:
        raise BuildError(f"no C compiler: {cc.split()[0]!r} is not on PATH (install gcc or clang)")
    if not (ROOT / "pyproject.toml").exists():
        raise BuildError(f"{ROOT} is not a source checkout (no pyproject.toml): nothing to build")


def shared_libs() -> list[Path]:
    """The group's shared library (one per interpreter that built it)."""
    return sorted(p for p in ROOT.glob(GROUP + "__mypyc.*") if p.suffix in (".so", ".pyd"))


def build(verbose: bool = False) -> list[Path]:
    """Compile :data:`~kvevents.compiled.MODULES` in place (about a minute on one core);
    return the extension files written.  A failed build leaves no extension file behind.

    Raises :class:`BuildError` when a tool is missing or mypyc or the compiler fails."""
    check_tools()
    clean()
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    setup_py = BUILD_DIR / "setup.py"
    setup_py.write_text(
        _SETUP.format(
            temp=str(BUILD_DIR / "temp"),
            lib=str(BUILD_DIR / "lib"),
            group=GROUP,
            target=str(BUILD_DIR / "c"),
        )
    )
    paths = [str(source_path(m).relative_to(ROOT)) for m in MODULES]
    env = {k: v for k, v in os.environ.items() if k != PURE_ENV}
    proc = subprocess.run(
        [sys.executable, str(setup_py), *paths],
        cwd=ROOT,
        env=env,
        stdout=None if verbose else subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stdout or "").strip().splitlines()[-15:]
        clean()
        lines = "\n".join(tail)
        raise BuildError(f"mypyc failed (exit {proc.returncode}):\n{lines}")
    written = [f for m in MODULES for f in extension_files(m)] + shared_libs()
    sources = {}
    for m in MODULES:
        src = source_path(m)
        st = src.stat()
        sources[m] = [st.st_size, st.st_mtime_ns, digest(src)]
    manifest = {"python": sys.implementation.cache_tag, "sources": sources}
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    return written


def clean() -> list[Path]:
    """Remove the compiled core: extension files, the shared library, the manifest and
    the build directory.  Returns the files removed."""
    removed = [f for m in MODULES for f in extension_files(m)] + shared_libs()
    for f in removed:
        f.unlink()
    if MANIFEST.exists():
        MANIFEST.unlink()
        removed.append(MANIFEST)
    if BUILD_DIR.exists():
        shutil.rmtree(BUILD_DIR)
    return removed
