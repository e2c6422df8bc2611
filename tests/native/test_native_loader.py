"""``KVEVENTS_NATIVE`` picks the core: ``0`` forces pure Python (and the router's walk,
assembly and prompt keys are then the Python ones), unset uses the compiled core when it
imports, ``1`` requires it; ``kvevents --version`` says which runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import kvevents.consumers.content as c, kvevents.consumers.router.walk as w;"
    "from kvevents.native import core_name;"
    "print(core_name(), c.NATIVE is None, w.walk is w.python_walk,"
    " w.assemble is w.python_assemble)"
)


def probe(setting: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVEVENTS_NATIVE"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if setting is not None:
        env["KVEVENTS_NATIVE"] = setting
    cmd = [sys.executable, *(args or ("-c", PROBE))]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_zero_forces_pure_python() -> None:
    got = probe("0")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["python,", "KVEVENTS_NATIVE=0", "True", "True", "True"]
    version = probe("0", "-m", "kvevents", "--version")
    assert version.stdout.strip().endswith("(core: python, KVEVENTS_NATIVE=0)")


def test_the_core_runs_when_it_imports() -> None:
    pytest.importorskip("kvevents_native")
    for setting in (None, "1"):
        got = probe(setting)
        assert got.returncode == 0, got.stderr
        assert got.stdout.split()[0] == "native"
        assert got.stdout.split()[2:] == ["False", "False", "False"]
    assert "(core: native " in probe(None, "-m", "kvevents", "--version").stdout


def test_one_without_the_core_fails_loudly(tmp_path: Path) -> None:
    # a stand-in package that fails to import, ahead of any installed core
    fake = tmp_path / "kvevents_native"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no core here')\n")
    env_path = f"{tmp_path}{os.pathsep}{ROOT}"
    for setting, ok in (("1", False), ("", True)):
        env = {**os.environ, "KVEVENTS_NATIVE": setting, "PYTHONPATH": env_path}
        got = subprocess.run(
            [sys.executable, "-c", "import kvevents.native as n; print(n.core_name())"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (got.returncode == 0) is ok
        if ok:
            assert got.stdout.strip() == "python, kvevents-native not installed"
        else:
            assert "pip install ./native" in got.stderr
