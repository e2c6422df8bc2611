"""The optional compiled core's switches, checked with or without a build present.

``KVEVENTS_PURE_PYTHON=1`` must give the ``.py`` modules (whatever is built), and a build
on a machine without a C compiler must fail with one line, before touching any existing
build.  (The builds' identical answers: tests/consumers/test_compiled_differential.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvevents import compiled

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != compiled.PURE_ENV}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_switch_forces_every_listed_module_to_its_py_file() -> None:
    code = (
        "import importlib, kvevents.compiled as c\n"
        "for m in c.MODULES: importlib.import_module(m)\n"
        "import sys\n"
        "print(sorted({type(sys.modules[m].__loader__).__name__ for m in c.MODULES}))\n"
        "print(c.status().loaded, c.active(), c.describe())\n"
    )
    got = _python(code, **{compiled.PURE_ENV: "1"})
    assert got.returncode == 0, got.stderr
    loaders, state = got.stdout.splitlines()
    assert loaders == "['SourceFileLoader']"
    assert state.startswith("() False pure Python")
    unset = _python(code, **{compiled.PURE_ENV: "0"})  # "0" means not forced
    assert unset.returncode == 0, unset.stderr
    st = compiled.status()
    built = bool(st.present) and not st.stale
    assert unset.stdout.splitlines()[1].startswith(f"{st.present} True" if built else "() False")


def test_a_build_without_a_compiler_fails_in_one_line_and_keeps_the_old_build() -> None:
    before = compiled.status().present
    got = subprocess.run(
        [sys.executable, "-m", "kvevents.compiled", "build"],
        env={**os.environ, "CC": "/nonexistent/cc"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert got.returncode == 1
    lines = [ln for ln in got.stderr.splitlines() if ln.startswith("kvevents.compiled:")]
    assert len(lines) == 1 and ("no C compiler" in lines[0] or "missing" in lines[0]), got.stderr
    assert compiled.status().present == before
